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
    # The assignment precision (float32 by default) is saved with the quantiser; the facts say
    # where the map was made.
    assert m.facts["encode_dtype"] == q.cfg.encode_dtype == "float32"
    assert m.facts["machine"]["fit_threads"] == 1 and "cpu_model" in m.facts["machine"]
    # Where the stage's wall time went (facts.timing, gti.timing).
    assert {"check_s", "ray_start_s", "sample_read_s", "kmeans_s", "rqvae_train_s", "assign_s", "resolve_s",
            "write_s", "total_s"} <= set(m.facts["timing"])


@pytest.mark.slow
@pytest.mark.ray
def test_rqkmeans_reassign(tmp_path, ray_start_4_cpus, monkeypatch):
    # local_max_items=0: the assignment on Ray Data's actor pool, even for 200 items.
    cfg = _cfg(tmp_path, "sid.method=rqkmeans", "sid.dedup=reassign", "sid.codebook_size=16",
               "sid.sinkhorn_last_level=false", "local_max_items=0")
    run_dir = cfg.resolved_run_dir()
    vecs = clustered(n=200)
    write_embed_stage(run_dir, vecs)
    m = run_stage(spec("sid"), cfg, run_dir)
    t = _check_outputs(m, run_dir, 200)
    assert m.facts["levels"] in (2, 3)
    # A catalog of at most local_max_items items is assigned in this process: the same codes.
    from types import SimpleNamespace

    from gti.stages import sid as S

    import ray

    emb = run_dir / "embed" / "embeddings.parquet"
    ctx = {n: SimpleNamespace(cfg=cfg.model_copy(update={"local_max_items": n}), log=lambda m: None) for n in (0, 200)}
    codes = {0: S.assign_all(ctx[0], emb, run_dir / "sid", 200)}
    monkeypatch.setattr(ray.data, "read_parquet", lambda *a, **k: pytest.fail("the local path read through Ray Data"))
    codes[200] = S.assign_all(ctx[200], emb, run_dir / "sid", 200)
    assert codes[0].shape == (200, 2)
    np.testing.assert_array_equal(codes[0], codes[200])


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


# --------------------------------------------------------------------------- reproducibility
def _map_hash_without_ray(tmp_path, cfg, vecs, torch_threads: int, actors: int) -> str:
    """The sid stage's map hash for `vecs`, through its own fit, assignment and resolution
    functions, without Ray: the quantiser is fitted with `torch_threads` set outside the stage
    (as a machine with that many cores would have), and the assignment batches of
    `sid.assign_batch_size` rows are dealt round-robin to `actors` AssignBatch instances, as
    Ray Data's actor pool does."""
    from types import SimpleNamespace

    from gti.sid.embeddings import AssignBatch, EmbeddingRows
    from gti.sid.mapfile import sid_map_hash, sid_strings
    from gti.sid.codec import SidCodec
    from gti.sid.quantizer import CONFIG_NAME, WEIGHTS_NAME, save_quantizer
    from gti.stages import sid as stage

    run_dir = tmp_path / f"t{torch_threads}a{actors}"
    write_embed_stage(run_dir, vecs)
    emb = run_dir / "embed" / "embeddings.parquet"
    ctx = SimpleNamespace(cfg=cfg, log=lambda msg: None, work_dir=run_dir)
    before = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        rows = EmbeddingRows(emb)
        q, _, _, _, _ = stage._train(ctx, emb, rows, len(vecs), vecs.shape[1])
        save_quantizer(q, run_dir)
        pool = [AssignBatch((run_dir / WEIGHTS_NAME).read_bytes(), (run_dir / CONFIG_NAME).read_text())
                for _ in range(actors)]
        table, bs = pq.read_table(emb, columns=["embedding"]), cfg.sid.assign_batch_size
        parts = [pool[i % actors](table.slice(s, bs))["codes"] for i, s in enumerate(range(0, len(vecs), bs))]
        codes = torch.from_numpy(np.concatenate(parts)).long()
        final, sizes, _ = stage._resolve(ctx, q, codes, rows)
    finally:
        torch.set_num_threads(before)
    ids = pa.array([f"item{i}" for i in range(len(vecs))])
    return sid_map_hash(ids, sid_strings(SidCodec(final.shape[1], sizes, cfg.sid.token_format), final))


def test_same_map_hash_across_thread_and_worker_counts(tmp_path):
    # Balanced residual k-means with collisions to resolve: every step that picks codes runs.
    cfg = _cfg(tmp_path, "sid.method=rqkmeans", "sid.codebook_size=8", "sid.assign_batch_size=96",
               "sid.gates.min_utilisation=0.0")
    vecs = clustered(n=400, dim=16, k=30, seed=3)
    hashes = {(t, a): _map_hash_without_ray(tmp_path, cfg, vecs, t, a) for t, a in ((1, 1), (2, 1), (1, 2), (2, 2))}
    assert len(set(hashes.values())) == 1, hashes


def test_fingerprint_holds_the_resolved_assign_dtype(tmp_path, monkeypatch):
    from gti.pipeline import fingerprint
    import gti.sid.rqvae as rqvae

    def fp(native: bool, *over):
        monkeypatch.setattr(rqvae, "native_bf16", lambda device="cpu": native)
        cfg = _cfg(tmp_path, *over)
        return fingerprint(spec("sid"), cfg, cfg.resolved_run_dir())

    write_embed_stage(_cfg(tmp_path).resolved_run_dir(), clustered(n=20))
    assert C.SidConfig().assign_dtype == "float32"  # the same codes on every machine by default
    # auto: bf16 hardware resolves to bf16, other machines to float32, and the fingerprints say so.
    on_bf16, elsewhere = fp(True, "sid.assign_dtype=auto"), fp(False, "sid.assign_dtype=auto")
    assert on_bf16[0] != elsewhere[0]
    assert on_bf16[1]["assign_dtype"] == "bfloat16" and elsewhere[1]["assign_dtype"] == "float32"
    # An explicit value is the same everywhere.
    assert fp(True, "sid.assign_dtype=float32") == fp(False, "sid.assign_dtype=float32")
    # Residual k-means never runs the encoder MLP: no precision in its fingerprint.
    assert "assign_dtype" not in fp(True, "sid.method=rqkmeans", "sid.assign_dtype=auto")[1]


def test_fingerprint_holds_the_balanced_kmeans_version(tmp_path, monkeypatch):
    """A map fitted by an earlier balanced k-means is not up to date: the algorithm's version
    is in the fingerprint of balanced rqkmeans configs, and only there."""
    from gti.pipeline import fingerprint
    from gti.stages import sid as sid_stage

    def fp(*over):
        cfg = _cfg(tmp_path, *over)
        return fingerprint(spec("sid"), cfg, cfg.resolved_run_dir())

    write_embed_stage(_cfg(tmp_path).resolved_run_dir(), clustered(n=20))
    before = fp("sid.method=rqkmeans", "sid.balanced=true")
    assert before[1]["balanced_kmeans"] == sid_stage.BALANCED_KMEANS_VERSION
    assert "balanced_kmeans" not in fp("sid.method=rqkmeans", "sid.balanced=false")[1]
    assert "balanced_kmeans" not in fp("sid.method=rqvae")[1]
    monkeypatch.setattr(sid_stage, "BALANCED_KMEANS_VERSION", "next")
    assert fp("sid.method=rqkmeans", "sid.balanced=true")[0] != before[0]
