"""Stage `sid`: semantic IDs for every catalog item (quantiser training, assignment, de-dup).

What it is for: turning `embed`'s embeddings into one unique SID per item. Codebooks start
from k-means on a seeded sample; the quantiser trains (`rqvae` on Ray Train workers, resumable
per epoch; `rqkmeans` on the driver); every item is assigned in a Ray Data actor pool (in this
process for a small catalog); colliding items are spread and de-duplicated one prefix bucket at
a time (`gti.sid.collide`, `gti.sid.resolve`); quality gates; the map is written and hashed as
it streams. The driver holds nothing that grows with the catalog. Every draw is seeded by
`map_seed`, so one run can make several maps (`gti compare --sid-seeds`); `sid.method: file`
reads a given map instead (`gti.sid.from_file`). Outputs and facts: docs/ARCHITECTURE.md.

What it does not know: how embeddings were made, tokenizers (the codec spells tokens only).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gti.train.ray_train import STORAGE_DIR
from gti.run.contract import StageContext, StageResult
from gti.common.devices import cpu_facts
from gti.common.errors import DataError
from gti.common.parquet_stream import iter_parquet
from gti.sid.codec import SidCodec
from gti.sid.collide import CodeScan, CodesWriter, Resolved, fixed_batches, iter_resolved, resolve_subset, scan_codes
from gti.sid.embeddings import AssignBatch, EmbeddingRows, LastResiduals, check_embeddings
from gti.sid.kmeans import fixed_threads, sq_dists
from gti.sid.mapfile import SortedMapHash, sid_map_hash_file, sid_strings
from gti.sid.quality import check_gates
from gti.sid.quantizer import CONFIG_NAME, WEIGHTS_NAME, build_quantizer, codebooks_tensor, save_quantizer
from gti.sid.resolve import LastCodes, sinkhorn_rounds
from gti.sid.rqvae import resolve_encode_dtype
from gti.common.timing import Timer
from gti.train.rqvae_task import train_rqvae


def track_sid(ctx: StageContext, history: list[dict], facts: dict) -> None:
    """TensorBoard (and MLflow) scalars of the stage: RQ-VAE training per epoch (train/*) and
    the final SID quality (sid/*: reconstruction, collisions, utilisation and perplexity per
    level), at step = epochs (0 for residual k-means)."""
    from gti.common.tracking import metric_tags, open_tracker

    with open_tracker(ctx) as tracker:
        for m in history:
            tracker.report({k: v for k, v in m.items() if k != "items"}, step=int(m["epoch"]))
        final = {k: facts[k] for k in ("recon_mse", "collision_rate_before", "collision_rate_after_sinkhorn",
                                       "collision_rate_after", "sinkhorn_rounds", "utilisation",
                                       "perplexity", "assign_items_per_s")}
        tracker.scalars(metric_tags(final, prefix="sid"), len(history))


def encode_dtype(s) -> str | None:
    """The assignment precision `sid.assign_dtype` resolves to on this machine (rqvae), or None
    (rqkmeans encodes in float32 always)."""
    if s.method != "rqvae":
        return None
    return resolve_encode_dtype(s.assign_dtype, "cuda" if s.use_gpu else "cpu")


# The balanced k-means algorithm (gti.sid.kmeans.balanced_kmeans) by version: a map fitted by
# an earlier one is not up to date for the same config (v2: Lloyd steps, then priced steps; v3:
# the balanced steps within `iters`, the priced assignment as one addmm; v4: the Lloyd steps'
# argmin before |x|^2 is added, so rounding ties can fall differently; v5: the Sinkhorn in the
# scaling domain, assignments in row chunks, the sample's product reused when it is every row:
# the same algorithm, other float32 rounding).
BALANCED_KMEANS_VERSION = "5"
# Collision spreading by version (v2: the Sinkhorn sample keyed by row, colliders scored in
# row windows of `chunk_rows`, so the driver holds no array over all colliders): a catalog with
# more colliders than one sample or window gets other codes than from v1.
SINKHORN_RESOLVE_VERSION = "2"
# k-means++ seeding (gti.sid.kmeans.kmeans_plus_plus) by version, in every method's fingerprint:
# it seeds each RQ-VAE codebook, plain RQ-KMeans, and balanced RQ-KMeans on fewer rows than
# codes (v3: one algorithm at every size, seeds from KPP_CANDIDATES_PER_CODE * k random
# candidate rows; v2 kept v1's every-row seeding for fits up to 2^20 row-code pairs): other
# seeds, other maps.
KMEANS_SEEDING_VERSION = "3"


def map_seed(cfg) -> int:
    """The seed of the SID map: `sid.seed`, or the run's `seed` where it is None (the maps made
    before `sid.seed` existed, bit for bit). A set `sid.seed` is in the sid section and so in
    the stage's fingerprint; None is left out of it (`gti.config.SidConfig.seed`)."""
    return cfg.seed if cfg.sid.seed is None else cfg.sid.seed


def input_fingerprints(cfg) -> dict[str, str]:
    """The resolved assignment precision: codes made in bf16 are never up to date for a config
    that would make them in float32 here (`auto` resolves per machine); the version of k-means++
    seeding; for balanced residual k-means, the version of its algorithm; with Sinkhorn
    spreading, the version of that."""
    s = cfg.sid
    if s.method == "file":  # the map file (and item.json) are the inputs; nothing is fitted
        from gti.run.manifest import file_fingerprint

        files = {k: Path(p).expanduser() for k, p in (("path", s.path), ("item_json", s.item_json)) if p is not None}
        for key, p in files.items():
            if not p.is_file():
                raise DataError(f"sid.{key} {p}: no such file")
        return {f"sid_{key}": file_fingerprint(p) for key, p in files.items()}
    out = {"kmeans_seeding": KMEANS_SEEDING_VERSION}
    if s.sinkhorn_last_level and s.sinkhorn_rounds > 0:
        out["sinkhorn_resolve"] = SINKHORN_RESOLVE_VERSION
    if s.method == "rqkmeans":
        return {**out, "balanced_kmeans": BALANCED_KMEANS_VERSION} if s.balanced else out
    dtype = encode_dtype(s)
    return out if dtype is None else {**out, "assign_dtype": dtype}


# The greedy codes, written during the assignment and deleted when the stage ends.
CODES_FILE = "codes.parquet"
# Rows per batch when the map is written (and the codes file read for it).
MAP_BATCH_ROWS = 65536


# --------------------------------------------------------------------------- assignment
def assign_all(ctx: StageContext, emb_path: Path, qdir: Path, n_items: int, out: Path) -> Path:
    """Greedy codes int32 [N, L] for every row of emb_path, in file order, written batch by
    batch to `out` (`gti.sid.collide.CodesWriter`; read back with `iter_codes`): the saved
    quantiser (`AssignBatch`) over batches of `sid.assign_batch_size` rows, on a Ray Data actor
    pool, or in this process for a catalog of at most `local_max_items` items. Returns out."""
    s = ctx.cfg.sid
    kwargs = {"weights": (qdir / WEIGHTS_NAME).read_bytes(), "meta": (qdir / CONFIG_NAME).read_text(),
              "device": "cuda" if s.use_gpu else "cpu"}
    if n_items <= ctx.cfg.local_max_items:
        # The pool's start-up is most of a small catalog's assignment (bench/small_catalog/RESULTS.md, "Small
        # catalogs without Ray Data"). One thread, as in a one-CPU actor: a near tie must not
        # depend on where the codes were computed.
        ctx.log(f"{n_items:,} items <= local_max_items ({ctx.cfg.local_max_items:,}): assigned in this process")
        assign = AssignBatch(**kwargs)
        batches = iter_parquet(emb_path, s.assign_batch_size, columns=["embedding"])
        with fixed_threads(1):
            return _write_codes(ctx, (assign(pa.Table.from_batches([b])) for b in batches), n_items, out)
    import ray

    ray.data.DataContext.get_current().execution_options.preserve_order = True
    ds = ray.data.read_parquet(str(emb_path), columns=["embedding"])
    pool = ds.map_batches(
        AssignBatch,
        fn_constructor_kwargs=kwargs,
        batch_size=s.assign_batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=s.assign_concurrency),
        num_gpus=1 if s.use_gpu else 0,
    )
    return _write_codes(ctx, pool.iter_batches(batch_size=None, batch_format="numpy"), n_items, out)


def _write_codes(ctx: StageContext, batches, n_items: int, out: Path) -> Path:
    """The `codes` of each batch ({"codes": int [B, L]}) appended to `out` in order (int32
    [n_items, L] in all); one batch in memory at a time."""
    from gti.common.progress import Progress

    t0 = time.time()
    with Progress(n_items, "assign", "items", log=ctx.log) as bar, CodesWriter(out) as writer:
        for b in batches:
            codes = np.asarray(b["codes"], dtype=np.int32)
            writer.write(codes)
            bar.update(len(codes))
    if writer.rows != n_items:
        raise RuntimeError(f"assignment returned {writer.rows} rows for {n_items} items")
    ctx.log(f"assigned {n_items} items in {time.time() - t0:.1f}s")
    return out


# --------------------------------------------------------------------------- stage
def _train(ctx: StageContext, emb_path: Path, rows_reader: EmbeddingRows, n_items: int, dim: int,
           timer: Timer | None = None):
    """The quantiser, trained (RQ-VAE on Ray Train) or fitted (residual k-means) from a seeded
    sample; returns (quantiser in eval mode, history, sample rows, sample, seconds). `timer`
    gets the phases sample_read, kmeans and rqvae_train."""
    cfg, s = ctx.cfg, ctx.cfg.sid
    timer = timer or Timer()
    seed = map_seed(cfg)
    rng = np.random.default_rng(seed)
    sample_rows = np.sort(rng.choice(n_items, size=min(n_items, s.kmeans_sample), replace=False))
    with timer.phase("sample_read"):
        sample = rows_reader.read(sample_rows)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    q = build_quantizer(s, dim)
    t0 = time.time()
    history: list[dict] = []
    # A fixed thread count: reductions (and so near-tie assignments, which k-means then
    # amplifies) depend on it, and the map must not depend on the machine's cores.
    with fixed_threads(s.fit_threads), timer.phase("kmeans"):
        if s.method == "rqvae":
            inert = q.init_codebooks(sample, iters=s.kmeans_iters, generator=gen)
            ctx.log(f"k-means init on {len(sample_rows)} items: inertia per level {[round(v, 5) for v in inert]}")
        else:
            q.fit(sample, iters=s.kmeans_iters, generator=gen, log=ctx.log)
    if s.method == "rqvae":
        with timer.phase("rqvae_train"):  # Ray Train start-up, epochs, reports and checkpoints
            q, history = train_rqvae(s, seed, emb_path, q, n_items, ctx.work_dir / STORAGE_DIR, ctx.log)
    train_s = time.time() - t0
    q.eval()
    if s.method == "rqvae":
        # Saved with the quantiser, so every later re-encoding uses the same precision; the same
        # value is in the fingerprint (input_fingerprints).
        q.cfg.encode_dtype = encode_dtype(s)
        ctx.log(f"assignment encoder precision: {q.cfg.encode_dtype}")
    return q, history, sample_rows, sample, train_s


def _resolve(ctx: StageContext, q, scan: CodeScan, rows_reader: EmbeddingRows,
             timer: Timer | None = None) -> tuple[Resolved, dict]:
    """Collisions out on the items that can collide (`scan`: the colliding prefix groups S,
    bucket by bucket): Sinkhorn on the last level, then `sid.dedup`; the quality gates.
    Returns (`Resolved`: codebook sizes [L'], the figures of all N items, each bucket's final
    codes left in `scan.buckets`; facts about it)."""
    cfg, s = ctx.cfg, ctx.cfg.sid
    timer = timer or Timer()  # `timer` gets the phase sinkhorn
    last_cb = q.level_codebooks()[-1].float()
    # Global rows (resolution asks only for items of S); the cache is keyed by row, so it
    # costs nothing per item of the catalog or of S beyond what it caches.
    last_residuals = LastResiduals(q, rows_reader, cache_mb=s.resolve_cache_mb)

    def last_cost(rows: torch.Tensor) -> torch.Tensor:
        return sq_dists(last_residuals(rows.numpy()), last_cb)

    def spread(store: LastCodes, cost) -> int:
        from gti.common.progress import Progress

        # Rounds stop early when they stop helping, so the ETA is an upper bound.
        with timer.phase("sinkhorn"), Progress(s.sinkhorn_rounds, "sinkhorn", "rounds", log=ctx.log,
                                                every_n=1) as rounds:
            out = sinkhorn_rounds(
                store, cost, s.sinkhorn_epsilon, s.sinkhorn_iters, s.sinkhorn_rounds,
                sample_rows=s.sinkhorn_sample_rows, seed=map_seed(cfg), min_gain=s.sinkhorn_min_gain,
                log=lambda msg: rounds.update(1, msg))
        ctx.log(f"last residuals: {last_residuals.encoded:,} encodes, {last_residuals.used:,} items cached "
                f"(sid.resolve_cache_mb={s.resolve_cache_mb:g})")
        return out

    use_sinkhorn = s.sinkhorn_last_level and s.sinkhorn_rounds > 0
    r = resolve_subset(scan, list(q.codebook_sizes), last_cost, s.dedup, spread if use_sinkhorn else None)
    ctx.log(
        f"collision rate {r.before:.4f} -> {r.after_sinkhorn:.4f} after Sinkhorn ({r.sinkhorn_rounds} rounds) -> "
        f"{r.after:.4f} after {s.dedup}; utilisation {[round(u, 3) for u in r.util]}; at most "
        f"{scan.buckets.peak_rows:,} of the {scan.size:,} items in colliding prefix groups held at once"
    )
    stats = {"collision_rate_before": round(r.before, 6), "collision_rate_after_sinkhorn": round(r.after_sinkhorn, 6),
             "perplexity": [round(p, 2) for p in r.perp_q]}
    check_gates(r.util_q, r.after, s.gates.min_utilisation, s.gates.max_collision_rate, stats)
    facts = {
        "code_dim": int(last_cb.shape[1]),
        "utilisation": [round(u, 6) for u in r.util],
        "perplexity": [round(p, 4) for p in r.perp],
        "collision_rate_before": r.before,
        "collision_rate_after_sinkhorn": r.after_sinkhorn,
        "collision_rate_after": r.after,
        "sinkhorn_rounds": r.sinkhorn_rounds,
    }
    return r, facts


MAP_SCHEMA = pa.schema([("item_id", pa.string()), ("codes", pa.list_(pa.int32())), ("sid", pa.string())])


def _write_map(ctx: StageContext, emb_path: Path, codes_path: Path, scan: CodeScan, res: Resolved,
               codec: SidCodec) -> str:
    """sid_map.parquet (item_id, codes list<int32>, sid; rows in embeddings order), written
    `MAP_BATCH_ROWS` rows at a time: the codes file's codes with S's rows resolved (merged
    from the scan's buckets), beside the embeddings' ids. Returns the map's `sid_map_hash`."""
    path, bs = ctx.work_dir / "sid_map.parquet", MAP_BATCH_ROWS
    id_batches = iter_parquet(emb_path, bs, columns=["item_id"])
    ids_iter = fixed_batches((b.column(0) for b in id_batches), bs)
    hasher = SortedMapHash()
    with pq.ParquetWriter(str(path), MAP_SCHEMA) as writer:
        for ids, codes in zip(ids_iter, iter_resolved(codes_path, scan.buckets, len(res.sizes), bs), strict=True):
            ids = ids.cast(pa.string())
            sids = sid_strings(codec, torch.from_numpy(codes))
            flat = pa.FixedSizeListArray.from_arrays(pa.array(codes.reshape(-1)), codes.shape[1])
            writer.write_table(pa.table({"item_id": ids, "codes": flat.cast(pa.list_(pa.int32())), "sid": sids},
                                        schema=MAP_SCHEMA))
            hasher.update(ids, sids)
    if hasher.in_order:
        return hasher.hexdigest()
    # Ids not in code-point order (ingest keeps the catalog's order; numeric ids put "10"
    # before "9"): the hash sorts them, so it is taken from the finished file by sorted runs.
    return sid_map_hash_file(path, ctx.work_dir / "hash_runs")


def run(ctx: StageContext) -> StageResult:
    from safetensors.torch import save_file

    from gti.ray_start import ensure_ray

    cfg, s = ctx.cfg, ctx.cfg.sid
    timer = Timer(memory=True)  # the driver's peak per phase: bench/scale_memory reads it
    emb_path = ctx.input("embed", "embeddings")
    with timer.phase("check"):
        n_items, dim = check_embeddings(emb_path)
    ctx.log(f"{n_items} items, dim {dim}, method {s.method}, {s.levels} levels x {s.codebook_size} codes")
    if n_items < 2:
        raise DataError(f"{emb_path}: sid needs at least 2 items, got {n_items}")
    if s.method == "file":
        return _file_map(ctx, emb_path)
    with timer.phase("ray_start"):  # a no-op after an earlier stage of the same `gti run` started it
        ensure_ray(cfg)

    # Embeddings are read by row group; ids and codes stream from their files.
    rows_reader = EmbeddingRows(emb_path)
    q, history, sample_rows, sample, train_s = _train(ctx, emb_path, rows_reader, n_items, dim, timer)
    qdir = ctx.work_dir
    with timer.phase("write"):
        save_quantizer(q, qdir)
        save_file(codebooks_tensor(q), str(ctx.work_dir / "codebooks.safetensors"))

    codes_path = ctx.work_dir / CODES_FILE
    scan: CodeScan | None = None
    try:
        with timer.phase("assign"):
            assign_all(ctx, emb_path, qdir, n_items, codes_path)
        with timer.phase("scan"):
            scan = scan_codes(codes_path, list(q.codebook_sizes), ctx.work_dir / "codes_buckets",
                              bucket_rows=s.resolve_bucket_rows, pick=sample_rows)
            ctx.log(f"{scan.size:,} items in colliding prefix groups ({scan.parts} bucket(s))")
        with torch.no_grad():
            recon = float(((q.decode_codes(torch.from_numpy(scan.picked).long()) - sample) ** 2).mean())
        del sample
        with timer.phase("resolve"):
            res, resolved = _resolve(ctx, q, scan, rows_reader, timer)
        codec = SidCodec(len(res.sizes), res.sizes, s.token_format)
        with timer.phase("write"):
            map_hash = _write_map(ctx, emb_path, codes_path, scan, res, codec)
    finally:
        if scan is not None:
            scan.close()  # the buckets' folder (S and its final codes)
        codes_path.unlink(missing_ok=True)
    facts = _facts(s, q, res, codec, resolved, history, timer, train_s=train_s, recon=recon, map_hash=map_hash,
                   n_items=n_items, dim=dim)
    track_sid(ctx, history, facts)
    return StageResult(
        outputs={
            "sid_map": "sid_map.parquet",
            "codebooks": "codebooks.safetensors",
            "quantizer": WEIGHTS_NAME,
            "quantizer_config": CONFIG_NAME,
        },
        facts=facts,
    )


def _file_map(ctx: StageContext, emb_path: Path) -> StageResult:
    """`sid.method: file`: the map read and checked, written as a built one (`gti.sid.file_map`)."""
    from gti.run.manifest import ManifestError
    from gti.sid.file_map import make_file_map

    try:  # quarantined items must be in no interaction
        interactions = ctx.input("ingest", "interactions")
    except ManifestError:
        interactions = None
    outputs, facts = make_file_map(ctx.cfg.sid, emb_path, ctx.work_dir, ctx.log, interactions)
    return StageResult(outputs=outputs, facts=facts)


def _facts(s, q, res: Resolved, codec: SidCodec, resolved: dict, history: list[dict], timer: Timer, *,
           train_s: float, recon: float, map_hash: str, n_items: int, dim: int) -> dict:
    """The stage's manifest facts."""
    assign_s = timer.seconds["assign"]
    return {
        "method": s.method,
        "levels": len(res.sizes),
        "quantizer_levels": q.levels,
        "dedup_level_added": bool(len(res.sizes) > q.levels),
        "codebook_sizes": res.sizes,
        "code_dim": resolved["code_dim"],
        "token_format": s.token_format,
        "new_tokens": codec.tokens(),
        **{k: v for k, v in resolved.items() if k != "code_dim"},
        "recon_mse": recon,
        "sid_map_hash": map_hash,
        "n_items": n_items,
        "dim": dim,
        "train_s": round(train_s, 3),
        "assign_s": round(assign_s, 3),
        "assign_items_per_s": round(n_items / max(assign_s, 1e-9), 1),
        "encode_dtype": getattr(q.cfg, "encode_dtype", "float32"),
        # Where the map was made: another ISA can round (and so assign near ties) differently.
        "machine": {**cpu_facts(), "torch_threads": torch.get_num_threads(), "fit_threads": s.fit_threads},
        "train_history": history,
        "timing": timer.facts(),
        "driver_peak_mb": timer.memory_facts(),
    }
