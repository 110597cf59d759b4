"""Tests of the `sid` stage (gti/stages/sid.py) on a small embeddings.parquet written here."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gti import config as C
from gti.common.errors import DataError, GateError
from gti.run.manifest import Manifest
from gti.run.pipeline import run_stage, spec


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
    from gti.common.tracking import read_scalars

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
    # Where the stage's wall time went (facts.timing, gti.common.timing).
    assert {"check_s", "ray_start_s", "sample_read_s", "kmeans_s", "rqvae_train_s", "assign_s", "scan_s",
            "resolve_s", "sinkhorn_s", "write_s", "total_s"} <= set(m.facts["timing"])
    # The driver's peak memory per phase (Linux /proc), so a scale run shows which phase holds it.
    peaks = m.facts["driver_peak_mb"]
    assert {"kmeans_peak_mb", "assign_peak_mb", "scan_peak_mb", "resolve_peak_mb", "sinkhorn_peak_mb"} <= set(peaks)
    assert all(v > 50 for v in peaks.values())  # a Python process with torch is past 50 MB


@pytest.mark.slow
@pytest.mark.ray
def test_rqkmeans_reassign(tmp_path, ray_start_4_cpus, monkeypatch, capsys):
    # local_max_items=0: the assignment on Ray Data's actor pool, even for 200 items;
    # sid.resolve_bucket_rows=50: the stage resolves its colliders in 4 buckets of the catalog.
    cfg = _cfg(tmp_path, "sid.method=rqkmeans", "sid.dedup=reassign", "sid.codebook_size=16",
               "sid.sinkhorn_last_level=false", "local_max_items=0", "sid.resolve_bucket_rows=50")
    run_dir = cfg.resolved_run_dir()
    vecs = clustered(n=200)
    write_embed_stage(run_dir, vecs)
    m = run_stage(spec("sid"), cfg, run_dir)
    t = _check_outputs(m, run_dir, 200)
    assert m.facts["levels"] in (2, 3)
    out = capsys.readouterr()
    assert "items in colliding prefix groups (4 bucket(s))" in out.out + out.err
    # A catalog of at most local_max_items items is assigned in this process: the same codes.
    from types import SimpleNamespace

    from gti.stages import sid as S

    import ray

    from gti.sid.collide import iter_codes
    from gti.sid.mapfile import sid_map_hash

    # The map is streamed and its hash taken without holding it (ids "item10" < "item2": not in
    # code-point order, so from the finished file); the codes file is gone.
    assert m.facts["sid_map_hash"] == sid_map_hash(t.column("item_id"), t.column("sid"))
    assert not (run_dir / "sid" / S.CODES_FILE).exists() and not (run_dir / "sid" / "hash_runs").exists()
    emb = run_dir / "embed" / "embeddings.parquet"
    ctx = {n: SimpleNamespace(cfg=cfg.model_copy(update={"local_max_items": n}), log=lambda m: None) for n in (0, 200)}
    out = {n: tmp_path / f"codes{n}.parquet" for n in (0, 200)}
    S.assign_all(ctx[0], emb, run_dir / "sid", 200, out[0])
    monkeypatch.setattr(ray.data, "read_parquet", lambda *a, **k: pytest.fail("the local path read through Ray Data"))
    S.assign_all(ctx[200], emb, run_dir / "sid", 200, out[200])
    codes = {n: np.concatenate(list(iter_codes(out[n]))) for n in (0, 200)}
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
def _stage_without_ray(run_dir, cfg, vecs, torch_threads: int = 1, actors: int = 1, ids=None):
    """The sid stage's fit, assignment, resolution and map writing for `vecs`, through its own
    functions, without Ray: the quantiser is fitted with `torch_threads` set outside the stage
    (as a machine with that many cores would have), and the assignment batches of
    `sid.assign_batch_size` rows are dealt round-robin to `actors` AssignBatch instances, as
    Ray Data's actor pool does. Returns (quantiser, greedy codes long [N, L], EmbeddingRows,
    the scan of the codes file, the resolution's facts, the map's hash)."""
    from types import SimpleNamespace

    from gti.sid.codec import SidCodec
    from gti.sid.collide import CodesWriter, scan_codes
    from gti.sid.embeddings import AssignBatch, EmbeddingRows
    from gti.sid.quantizer import CONFIG_NAME, WEIGHTS_NAME, save_quantizer
    from gti.stages import sid as stage

    write_embed_stage(run_dir, vecs, ids)
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
        codes_path = run_dir / stage.CODES_FILE
        with CodesWriter(codes_path) as w:
            for p in parts:
                w.write(p)
        with scan_codes(codes_path, list(q.codebook_sizes), run_dir / "buckets",  # as `run` calls it
                        bucket_rows=cfg.sid.resolve_bucket_rows) as scan:
            res, facts = stage._resolve(ctx, q, scan, rows)
            map_hash = stage._write_map(ctx, emb, codes_path, scan, res,
                                        SidCodec(len(res.sizes), res.sizes, cfg.sid.token_format))
    finally:
        torch.set_num_threads(before)
    return q, torch.from_numpy(np.concatenate(parts)).long(), rows, scan, facts, map_hash


def test_same_map_hash_across_thread_and_worker_counts(tmp_path):
    # Balanced residual k-means with collisions to resolve: every step that picks codes runs.
    cfg = _cfg(tmp_path, "sid.method=rqkmeans", "sid.codebook_size=8", "sid.assign_batch_size=96",
               "sid.gates.min_utilisation=0.0")
    vecs = clustered(n=400, dim=16, k=30, seed=3)
    hashes = {(t, a): _stage_without_ray(tmp_path / f"t{t}a{a}", cfg, vecs, t, a)[-1]
              for t, a in ((1, 1), (2, 1), (1, 2), (2, 2))}
    assert len(set(hashes.values())) == 1, hashes


def _whole_array_map(cfg, q, codes: torch.Tensor, rows_reader, ids: list[str]):
    """The map, the resolution's facts and the hash as the stage made them before issue 33
    item 5: every function on all N greedy codes [N, L] at once, the map written in one table."""
    from gti.sid.codec import SidCodec
    from gti.sid.embeddings import LastResiduals
    from gti.sid.kmeans import sq_dists
    from gti.sid.mapfile import sid_map_hash, sid_strings
    from gti.sid.quality import level_usage
    from gti.sid.resolve import collision_rate, dedup_extra_level, dedup_reassign, sinkhorn_resolve

    s = cfg.sid
    before = collision_rate(codes)
    last_cb = q.level_codebooks()[-1].float()
    last_residuals = LastResiduals(q, rows_reader, cache_mb=s.resolve_cache_mb)

    def last_cost(rows):
        return sq_dists(last_residuals(rows.numpy()), last_cb)

    after_sk, sk_rounds = before, 0
    if s.sinkhorn_last_level and before > 0 and s.sinkhorn_rounds > 0:
        codes, sk_rounds = sinkhorn_resolve(codes, last_cost, s.sinkhorn_epsilon, s.sinkhorn_iters, s.sinkhorn_rounds,
                                            sample_rows=s.sinkhorn_sample_rows, seed=cfg.seed,
                                            min_gain=s.sinkhorn_min_gain)
        after_sk = collision_rate(codes)
    final = dedup_extra_level(codes) if s.dedup == "extra_level" else dedup_reassign(codes, last_cost)
    sizes = list(q.codebook_sizes)
    if final.shape[1] > len(sizes):
        sizes.append(int(final[:, -1].max()) + 1)
    util, perp = level_usage(final, sizes)
    facts = {"code_dim": int(last_cb.shape[1]), "utilisation": [round(u, 6) for u in util],
             "perplexity": [round(p, 4) for p in perp], "collision_rate_before": before,
             "collision_rate_after_sinkhorn": after_sk, "collision_rate_after": collision_rate(final),
             "sinkhorn_rounds": sk_rounds}
    sids = sid_strings(SidCodec(final.shape[1], sizes, s.token_format), final)
    codes_arr = pa.FixedSizeListArray.from_arrays(pa.array(final.to(torch.int32).flatten().numpy()), final.shape[1])
    table = pa.table({"item_id": pa.array(ids, pa.string()), "codes": codes_arr.cast(pa.list_(pa.int32())),
                      "sid": sids})
    return table, sizes, facts, sid_map_hash(table.column("item_id"), sids)


@pytest.mark.parametrize("dedup,sorted_ids", [("extra_level", False), ("reassign", True), ("reassign", False)])
def test_streamed_map_equals_the_whole_array_map(tmp_path, monkeypatch, dedup, sorted_ids):
    """Issue 33 item 5: the stage holds only the colliding prefix groups, writes the map batch by
    batch and hashes it without holding it, and the map, its hash and the resolution's facts are
    exactly those of the whole-array resolution (small batches and buckets here, so several of
    each)."""
    from gti.stages import sid as stage

    monkeypatch.setattr(stage, "MAP_BATCH_ROWS", 64)
    file_hashes = []
    monkeypatch.setattr(stage, "sid_map_hash_file", lambda *a, **k: file_hashes.append(a) or collide_hash(*a, **k))
    cfg = _cfg(tmp_path, "sid.method=rqkmeans", "sid.levels=3", "sid.codebook_size=8", "sid.assign_batch_size=96",
               "sid.gates.min_utilisation=0.0", f"sid.dedup={dedup}", "sid.sinkhorn_sample_rows=32",
               "sid.resolve_bucket_rows=100")
    vecs = clustered(n=400, dim=16, k=30, seed=3)
    ids = [f"item{i:03d}" if sorted_ids else f"item{i}" for i in range(400)]
    run_dir = tmp_path / "run"
    q, codes, rows, scan, facts, map_hash = _stage_without_ray(run_dir, cfg, vecs, ids=ids)
    table, sizes, want_facts, want_hash = _whole_array_map(cfg, q, codes, rows, ids)
    got = pq.read_table(run_dir / "sid_map.parquet")
    assert got.schema == table.schema and got.equals(table)
    assert map_hash == want_hash and facts == want_facts
    assert scan.parts == 4 and 0 < scan.size < 400  # only the colliding prefix groups were held
    assert scan.buckets.peak_rows < scan.size  # and one bucket of them at a time
    assert facts["collision_rate_before"] > 0 and facts["sinkhorn_rounds"] > 0 and facts["collision_rate_after"] == 0
    assert len(file_hashes) == (0 if sorted_ids else 1)  # sorted ids: hashed as written
    assert not (run_dir / "hash_runs").exists() and not (run_dir / "buckets").exists()


def collide_hash(*a, **k):
    from gti.sid.mapfile import sid_map_hash_file

    return sid_map_hash_file(*a, **k)


def test_fingerprint_holds_the_resolved_assign_dtype(tmp_path, monkeypatch):
    from gti.run.pipeline import fingerprint
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
    from gti.run.pipeline import fingerprint
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


def test_fingerprint_holds_the_kmeans_seeding_version(tmp_path, monkeypatch):
    """k-means++ seeds every RQ-VAE codebook and RQ-KMeans: a map made with an earlier seeding
    is not up to date for the same config, whatever the method."""
    from gti.run.pipeline import fingerprint
    from gti.stages import sid as sid_stage

    def fp(*over):
        cfg = _cfg(tmp_path, *over)
        return fingerprint(spec("sid"), cfg, cfg.resolved_run_dir())

    write_embed_stage(_cfg(tmp_path).resolved_run_dir(), clustered(n=20))
    methods = (["sid.method=rqvae"], ["sid.method=rqkmeans", "sid.balanced=false"],
               ["sid.method=rqkmeans", "sid.balanced=true"])
    before = [fp(*m) for m in methods]
    assert all(b[1]["kmeans_seeding"] == sid_stage.KMEANS_SEEDING_VERSION for b in before)
    monkeypatch.setattr(sid_stage, "KMEANS_SEEDING_VERSION", "next")
    assert all(fp(*m)[0] != b[0] for m, b in zip(methods, before))


def test_fingerprint_holds_the_sinkhorn_resolve_version(tmp_path, monkeypatch):
    """A map whose collisions were spread by an earlier Sinkhorn resolution (v1: the sample by
    position, count chunks) is not up to date: its version is in the fingerprint wherever
    Sinkhorn spreading runs, and only there."""
    from gti.run.pipeline import fingerprint
    from gti.stages import sid as sid_stage

    def fp(*over):
        cfg = _cfg(tmp_path, *over)
        return fingerprint(spec("sid"), cfg, cfg.resolved_run_dir())

    write_embed_stage(_cfg(tmp_path).resolved_run_dir(), clustered(n=20))
    for method in ("rqvae", "rqkmeans"):
        before = fp(f"sid.method={method}")
        assert before[1]["sinkhorn_resolve"] == sid_stage.SINKHORN_RESOLVE_VERSION
        assert "sinkhorn_resolve" not in fp(f"sid.method={method}", "sid.sinkhorn_last_level=false")[1]
        assert "sinkhorn_resolve" not in fp(f"sid.method={method}", "sid.sinkhorn_rounds=0")[1]
        monkeypatch.setattr(sid_stage, "SINKHORN_RESOLVE_VERSION", "next")
        assert fp(f"sid.method={method}")[0] != before[0]
        monkeypatch.undo()


def test_sid_seed_makes_another_map_and_none_is_the_run_seed(tmp_path):
    """`sid.seed` seeds every draw of the map: another value, another map of the same catalog;
    None is the run's `seed`, bit for bit (the maps made before the key existed)."""
    vecs = clustered(n=200, dim=16, k=30, seed=3)
    base = ["seed=5", "sid.method=rqkmeans", "sid.gates.min_utilisation=0.0"]

    def made(name, *over):
        run = tmp_path / name
        _stage_without_ray(run, _cfg(tmp_path, *base, *over), vecs)
        return (run / "sid_map.parquet").read_bytes(), (run / "quantizer.safetensors").read_bytes()

    none = made("none")
    assert made("five", "sid.seed=5") == none
    other = made("six", "sid.seed=6")
    assert other[0] != none[0] and other[1] != none[1]


def test_fingerprint_holds_sid_seed_and_none_leaves_it_as_before(tmp_path):
    from gti.run.pipeline import fingerprint

    def fp(*over):
        cfg = _cfg(tmp_path, *over)
        return fingerprint(spec("sid"), cfg, cfg.resolved_run_dir())[0]

    write_embed_stage(_cfg(tmp_path).resolved_run_dir(), clustered(n=20))
    # None is not in the sid section at all, so the fingerprints of earlier maps stand.
    assert "seed" not in _cfg(tmp_path).model_dump(mode="json")["sid"]
    assert len({fp(), fp("sid.seed=1"), fp("sid.seed=2")}) == 3
    assert fp("sid.seed=1") == fp("sid.seed=1")
