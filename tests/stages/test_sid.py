"""Tests of the `sid` stage (gti/stages/sid.py) on a small embeddings.parquet written here."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gti import config as C
from gti.errors import DataError, GateError
from gti.manifest import Manifest
from gti.pipeline import run_stage, spec


def write_embed_stage(run_dir, vecs: np.ndarray, ids=None):
    """A finished `embed` stage (manifest + embeddings.parquet) holding `vecs` [N, dim]."""
    d = run_dir / "embed"
    d.mkdir(parents=True)
    n, dim = vecs.shape
    ids = ids or [f"item{i}" for i in range(n)]
    flat = pa.array(np.ascontiguousarray(vecs, dtype=np.float32).reshape(-1))
    pq.write_table(pa.table({"item_id": ids, "embedding": pa.FixedSizeListArray.from_arrays(flat, dim)}),
                   d / "embeddings.parquet")
    Manifest(stage="embed", fingerprint=f"test-{n}-{dim}", config={},
             facts={"dim": dim, "n_items": n, "encoder": "test"},
             outputs={"embeddings": "embeddings.parquet"}).write(d)


def clustered(n=240, dim=16, k=12, seed=0):
    g = np.random.default_rng(seed)
    centres = g.normal(size=(k, dim))
    return (centres[g.integers(k, size=n)] + 0.3 * g.normal(size=(n, dim))).astype(np.float32)


def _cfg(tmp_path, *over):
    base = [f"run_dir={tmp_path / 'run'}", "ray_num_cpus=4", "sid.levels=2", "sid.codebook_size=8",
            "sid.code_dim=4", "sid.encoder_dims=[16]", "sid.epochs=3", "sid.batch_size=64",
            "sid.kmeans_iters=5", "sid.dropout=0.0"]
    return C.load(None, base + list(over))


def _check_outputs(m, run_dir, n):
    d = run_dir / "sid"
    t = pq.read_table(d / "sid_map.parquet")
    assert t.num_rows == n
    assert t.column("item_id").to_pylist() == [f"item{i}" for i in range(n)]
    sids = t.column("sid").to_pylist()
    assert len(set(sids)) == n  # every item unique
    codes = t.column("codes").to_pylist()
    f = m.facts
    assert all(len(c) == f["levels"] for c in codes)
    for lv in range(f["levels"]):
        assert max(c[lv] for c in codes) < f["codebook_sizes"][lv]
    assert f["collision_rate_after"] == 0.0 and f["n_items"] == n
    assert len(f["new_tokens"]) == sum(f["codebook_sizes"]) and f["new_tokens"][0] == "<a_0>"
    assert len(f["utilisation"]) == f["levels"] == len(f["perplexity"])
    from safetensors.torch import load_file

    cb = load_file(str(d / "codebooks.safetensors"))
    assert sorted(cb) == [f"level_{i}" for i in range(f["quantizer_levels"])]
    from gti.sid.codec import SidCodec

    codec = SidCodec.from_facts(f)
    assert [codec.from_string(s) for s in sids[:20]] == codes[:20]
    return t


@pytest.mark.slow
@pytest.mark.ray
def test_two_worker_rqvae_assigns_every_item(tmp_path, ray_start_4_cpus, capsys):
    # Revival every 2 steps exercises the in-epoch collective path on both workers.
    cfg = _cfg(tmp_path, "sid.num_workers=2", "sid.gates.min_utilisation=0.2", "sid.revive_every_steps=2")
    run_dir = cfg.resolved_run_dir()
    vecs = clustered()
    write_embed_stage(run_dir, vecs)
    m = run_stage(spec("sid"), cfg, run_dir)
    _check_outputs(m, run_dir, len(vecs))
    # Tracking: `tensorboard --logdir <run_dir>` has the RQ-VAE's curves (one point per epoch)
    # and the stage's quality figures; the driver printed epoch progress.
    from gti.tracking import read_scalars

    tb = read_scalars(run_dir / "tensorboard" / "sid")
    assert [s for s, _ in tb["train/loss"]] == [1, 2, 3]
    assert {"train/recon_loss", "train/quant_loss", "train/utilisation/l0", "sid/recon_mse",
            "sid/collision_rate_after", "sid/utilisation/l0"} <= set(tb)
    out = capsys.readouterr()
    assert "[sid] 3/3 epochs (100.0%)" in out.out + out.err
    hist = m.facts["train_history"]
    assert [h["epoch"] for h in hist] == [1, 2, 3]
    assert hist[-1]["items"] == len(vecs)  # both shards together saw the whole catalog
    assert hist[-1]["recon_loss"] < hist[0]["recon_loss"]
    # The saved quantiser reproduces the stage's pre-dedup codes.
    from gti.sid.quantizer import load_quantizer

    q = load_quantizer(run_dir / "sid")
    codes = q.encode(torch.from_numpy(vecs))
    assert codes.shape == (len(vecs), 2)
    # The assignment precision is resolved once and saved with the quantiser.
    from gti.sid.rqvae import resolve_encode_dtype

    assert m.facts["encode_dtype"] == q.cfg.encode_dtype == resolve_encode_dtype("auto")


@pytest.mark.slow
@pytest.mark.ray
def test_rqkmeans_reassign(tmp_path, ray_start_4_cpus):
    cfg = _cfg(tmp_path, "sid.method=rqkmeans", "sid.dedup=reassign", "sid.codebook_size=16",
               "sid.sinkhorn_last_level=false")
    run_dir = cfg.resolved_run_dir()
    vecs = clustered(n=200)
    write_embed_stage(run_dir, vecs)
    m = run_stage(spec("sid"), cfg, run_dir)
    t = _check_outputs(m, run_dir, 200)
    assert m.facts["levels"] in (2, 3)


def test_nan_embedding_names_the_item(tmp_path):
    cfg = _cfg(tmp_path)
    run_dir = cfg.resolved_run_dir()
    vecs = clustered(n=50)
    vecs[7, 3] = np.nan
    vecs[9, 0] = np.inf
    write_embed_stage(run_dir, vecs)
    with pytest.raises(DataError, match=r"item_id\(s\) item7, item9"):
        run_stage(spec("sid"), cfg, run_dir)


@pytest.mark.slow
@pytest.mark.ray
def test_gate_failure_stops_the_stage(tmp_path, ray_start_4_cpus):
    # 64 codes per level for 40 items: utilisation can never reach 0.9.
    cfg = _cfg(tmp_path, "sid.method=rqkmeans", "sid.codebook_size=64", "sid.gates.min_utilisation=0.9")
    run_dir = cfg.resolved_run_dir()
    write_embed_stage(run_dir, clustered(n=40))
    with pytest.raises(GateError, match="min_utilisation=0.9"):
        run_stage(spec("sid"), cfg, run_dir)
    assert not (run_dir / "sid").exists()
