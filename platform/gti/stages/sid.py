"""Stage `sid`: semantic IDs for every catalog item (quantiser training, assignment, de-dup).

What it is for: turning `embed`'s embeddings.parquet (item_id, embedding[dim]) into one unique
SID per item and the artefacts later stages need:
1. Checks: every embedding finite (DataError names the first bad item ids).
2. Codebook initialisation on the driver: k-means on real residuals of a seeded sample of
   `sid.kmeans_sample` items, so every worker starts from the same codebooks.
3. Training. `rqvae`: Ray Train TorchTrainer with `sid.num_workers` workers (DDP, gloo on CPU,
   nccl on GPU), fed by Ray Data through `get_dataset_shard`; per epoch the workers all-reduce
   code usage, re-seed dead codes (rank 0's choice is broadcast), report metrics and a
   checkpoint (`ray.train.report`) into Ray Train storage under the stage's work dir, so a rerun
   after a killed driver resumes from the last epoch. `rqkmeans`: residual k-means on the
   sample, on the driver (no gradient training to distribute).
4. Assignment: Ray Data batch inference (`map_batches` with a callable class, an actor pool of
   `sid.assign_concurrency`) over the whole catalog, streaming; only the int codes come back.
5. Collisions (needs all codes at once; ints only, so millions fit): Sinkhorn spreading on the
   last level for colliding items (`sid.sinkhorn_last_level`), then `sid.dedup` (extra level or
   reassignment). Quality gates (`sid.gates`) fail the stage with one message and the stats.

Outputs: sid_map.parquet (item_id, codes list<int32>, sid str; rows in embeddings order),
codebooks.safetensors (level_l: [K, code_dim]), quantizer.safetensors + quantizer.json.

What it does not know: how embeddings were made, tokenizers (the codec spells tokens only).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gti.errors import DataError, user_error
from gti.contract import StageContext, StageResult
from gti.sid.codec import SidCodec
from gti.sid.kmeans import sq_dists
from gti.sid.quality import check_gates, level_usage
from gti.sid.quantizer import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    build_quantizer,
    codebooks_tensor,
    load_quantizer,
    save_quantizer,
)
from gti.sid.resolve import collision_rate, dedup_extra_level, dedup_reassign, sinkhorn_resolve
from gti.sid.rqvae import resolve_encode_dtype

STATE_FILE = "train_state.json"
OPTIM_FILE = "optimizer.safetensors"


# --------------------------------------------------------------------------- reading
def embedding_matrix(col: pa.ChunkedArray | pa.Array, path: str) -> np.ndarray:
    """fixed_size_list<float32>[dim] (or list<float>) column -> float32 [N, dim] (no copy
    for a single fixed-size chunk)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_fixed_size_list(col.type):
        dim = col.type.list_size
        flat = col.flatten()
        if col.null_count:
            raise DataError(f"{path}: column 'embedding' has {col.null_count} null rows")
        return flat.to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(-1, dim)
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        rows = col.to_pylist()
        lens = {len(r) if r is not None else -1 for r in rows}
        if len(lens) != 1 or -1 in lens:
            raise DataError(f"{path}: column 'embedding' rows differ in length or are null")
        return np.asarray(rows, dtype=np.float32)
    raise DataError(f"{path}: column 'embedding' has type {col.type}, expected a list of floats")


def check_embeddings(path: str | Path, batch_rows: int = 65536) -> tuple[int, int]:
    """Stream the file once: (n_items, dim); DataError naming item ids of non-finite rows."""
    pf = pq.ParquetFile(str(path))
    names = pf.schema_arrow.names
    for col in ("item_id", "embedding"):
        if col not in names:
            raise DataError(f"{path}: missing column '{col}' (has {names})")
    n, dim, bad = 0, None, []
    for batch in pf.iter_batches(batch_size=batch_rows, columns=["item_id", "embedding"]):
        x = embedding_matrix(batch.column("embedding"), str(path))
        if dim is None:
            dim = x.shape[1]
        ok = np.isfinite(x).all(axis=1)
        if not ok.all():
            ids = batch.column("item_id").to_pylist()
            bad.extend(ids[i] for i in np.flatnonzero(~ok)[:5])
        n += x.shape[0]
    if bad:
        raise DataError(
            f"{path}: non-finite (NaN/inf) embedding for item_id(s) {', '.join(map(str, bad[:5]))}"
            + (" and more" if len(bad) > 5 else "")
        )
    if n == 0 or dim is None:
        raise DataError(f"{path}: no embeddings")
    return n, dim


class EmbeddingRows:
    """Random access to rows of embeddings.parquet with one row group in memory at a time.

    Why not `pq.read_table(...).column("embedding").take(rows)`: that decodes the whole column
    (N x dim x 4 bytes) and `take` first joins its chunks into a second full copy; at 5M items
    x 256 dims that is 10 GB on the driver (measured, bench/RESULTS.md "Scale").
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.pf = pq.ParquetFile(self.path)
        md = self.pf.metadata
        self.starts = np.cumsum([0] + [md.row_group(i).num_rows for i in range(md.num_row_groups)])
        self.n = int(self.starts[-1])

    def read(self, rows: np.ndarray) -> torch.Tensor:
        """Embeddings of row indices `rows` [m] (any order, repeats allowed): float32 [m, dim]."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.n):
            raise IndexError(f"{self.path}: row index out of range 0..{self.n - 1}")
        group = np.searchsorted(self.starts, rows, side="right") - 1
        out: np.ndarray | None = None
        for g in np.unique(group):
            sel = np.nonzero(group == g)[0]
            col = self.pf.read_row_group(int(g), columns=["embedding"]).column(0)
            m = embedding_matrix(col.take(pa.array(rows[sel] - self.starts[g])), self.path)
            if out is None:
                out = np.empty((rows.size, m.shape[1]), dtype=np.float32)
            out[sel] = m
        if out is None:  # no rows asked for
            return torch.zeros(0, self.pf.schema_arrow.field("embedding").type.list_size)
        return torch.from_numpy(out)


class LastResiduals:
    """What the quantiser's last level sees, per item: residuals [m, code_dim] for given rows.

    Collision resolution re-scores the last level of colliding items in every round; the
    residual depends only on the item and its first L-1 codes, which resolution never changes.
    So the first `cache_mb` MB of residuals are kept, and an item in the cache is read and
    encoded once. Items past the cache are recomputed on each call. Where millions of items
    collide (2M of 5M in the scale bench, 1 KB each at dim 256), a round re-reads the uncached
    ones instead of holding GBs on the driver. Each call reads and encodes in chunks of
    `chunk` rows. Bounding the size of its output is the caller's job.
    """

    def __init__(self, q, rows_reader: EmbeddingRows, chunk: int = 65536, cache_mb: float = 1024) -> None:
        self.q, self.reader, self.chunk = q, rows_reader, chunk
        self.cache_bytes = int(cache_mb * 2**20)
        self.slot = np.full(rows_reader.n, -1, dtype=np.int64)
        self.res: torch.Tensor | None = None  # [capacity, code_dim]; rows 0..used-1 filled
        self.used = 0
        self.encoded = 0  # rows read and encoded so far (cache misses), for tests and logs

    def __call__(self, rows: np.ndarray) -> torch.Tensor:
        rows = np.asarray(rows, dtype=np.int64)
        slots = self.slot[rows]
        miss = np.nonzero(slots < 0)[0]
        uniq, inv = np.unique(rows[miss], return_inverse=True)
        fresh = [self.q.last_residual(self.reader.read(uniq[s : s + self.chunk])).float()
                 for s in range(0, uniq.size, self.chunk)]
        self.encoded += uniq.size
        if fresh:
            fresh_t = torch.cat(fresh)
            self._keep(uniq, fresh_t)
        if self.res is None and not fresh:
            raise ValueError("no residuals computed")
        dim = self.res.shape[1] if self.res is not None else fresh_t.shape[1]
        out = torch.empty(rows.size, dim)
        hit = np.nonzero(slots >= 0)[0]
        if hit.size:
            out[torch.from_numpy(hit)] = self.res[torch.from_numpy(slots[hit])]
        if miss.size:
            out[torch.from_numpy(miss)] = fresh_t[torch.from_numpy(inv.reshape(-1))]
        return out

    def _keep(self, rows: np.ndarray, res: torch.Tensor) -> None:
        """Cache as many of these residuals as the budget still allows."""
        limit = max(self.cache_bytes // (res.shape[1] * 4), 0)
        take = min(rows.size, limit - self.used)
        if take <= 0:
            return
        cap = 0 if self.res is None else self.res.shape[0]
        if self.used + take > cap:
            # Capacity doubles (up to the budget), so caching round after round copies O(total)
            # rows, not O(total^2) as concatenating every chunk would.
            bigger = torch.empty(min(max(self.used + take, 2 * cap, self.chunk), limit), res.shape[1])
            if self.res is not None:
                bigger[: self.used] = self.res[: self.used]
            self.res = bigger
        self.res[self.used : self.used + take] = res[:take]
        self.slot[rows[:take]] = np.arange(self.used, self.used + take)
        self.used += take


# --------------------------------------------------------------------------- training
def _save_optimizer(opt: torch.optim.Optimizer, path: Path) -> None:
    from safetensors.torch import save_file

    flat = {}
    for idx, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            flat[f"{idx}.{k}"] = torch.as_tensor(v).detach().cpu().contiguous()
    save_file(flat, str(path))


def _load_optimizer(opt: torch.optim.Optimizer, path: Path) -> None:
    from safetensors.torch import load_file

    flat = load_file(str(path))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in flat.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    sd = opt.state_dict()
    sd["state"] = state
    opt.load_state_dict(sd)


def sid_train_loop(config: dict) -> None:
    """Ray Train worker loop for the RQ-VAE (one call per worker).

    config: model (RQVAEConfig dict), init_state (state dict with k-means codebooks), epochs,
    batch_size (per worker), lr, weight_decay, dead_code_threshold, seed, shuffle_buffer.
    """
    import ray.train
    import ray.train.torch
    import torch.distributed as dist
    from ray.train import Checkpoint

    from gti.sid.rqvae import RQVAE, RQVAEConfig

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(config["seed"] * 1000 + rank)  # dropout differs per worker, as in DDP
    model = RQVAE(RQVAEConfig(**config["model"]))
    model.load_state_dict(config["init_state"])
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=config["weight_decay"])
    start_epoch, history = 0, []
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            model.load_state_dict(load_quantizer(d).state_dict())
            _load_optimizer(opt, Path(d) / OPTIM_FILE)
            st = json.loads((Path(d) / STATE_FILE).read_text())
            start_epoch, history = int(st["epoch"]), list(st["history"])
    device = ray.train.torch.get_device()
    ddp = ray.train.torch.prepare_model(model)
    core = model  # prepare_model wraps in DDP but keeps (and moves) this module
    levels, k = model.cfg.levels, model.cfg.codebook_size
    shard = ray.train.get_dataset_shard("train")
    every, step = int(config.get("revive_every_steps", 0)), 0
    # Usage since the last revival when reviving every `every` steps (spans epochs).
    window = torch.zeros(levels, k, dtype=torch.float64, device=device)
    for epoch in range(start_epoch, config["epochs"]):
        t0 = time.time()
        core.train()
        counts = torch.zeros(levels, k, dtype=torch.float64, device=device)
        sums = torch.zeros(5, dtype=torch.float64, device=device)  # loss, recon, quant, div, n
        last_res = None
        revived = [0] * levels
        for batch in shard.iter_torch_batches(
            batch_size=config["batch_size"],
            local_shuffle_buffer_size=config["shuffle_buffer"],
            local_shuffle_seed=config["seed"] * 100003 + epoch,
            device=device,
        ):
            x = batch["embedding"].float()
            out = ddp(x)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            opt.step()
            n = x.shape[0]
            used = torch.stack(
                [torch.bincount(out.codes[:, lv], minlength=k) for lv in range(levels)]
            ).to(counts.dtype)
            counts += used
            step += 1
            if every > 0:
                window += used
                if step % every == 0:
                    # Every worker has run the same number of steps (equal shards), so all
                    # reach this collective together.
                    got = _revive(core, window, out.residuals, config, step, world, opt)
                    revived = [a + b for a, b in zip(revived, got)]
                    window.zero_()
            sums += torch.tensor(
                [out.loss.item() * n, out.recon_loss.item() * n, out.quant_loss.item() * n,
                 out.diversity_loss.item() * n, n], dtype=torch.float64, device=device)
            last_res = out.residuals
        if world > 1:
            dist.all_reduce(counts)
            dist.all_reduce(sums)
        if every == 0 and epoch < config["epochs"] - 1 and last_res is not None:
            revived = _revive(core, counts, last_res, config, epoch, world, opt, reduced=True)
        n = max(sums[4].item(), 1.0)
        util = ((counts > 0).sum(1).double() / k).tolist()
        metrics = {
            "epoch": epoch + 1,
            "loss": sums[0].item() / n,
            "recon_loss": sums[1].item() / n,
            "quant_loss": sums[2].item() / n,
            "diversity_loss": sums[3].item() / n,
            "utilisation": [round(u, 4) for u in util],
            "revived": revived,
            "items": int(n),
            "epoch_s": round(time.time() - t0, 3),
        }
        history.append(metrics)
        if rank == 0:
            if config.get("progress_file"):
                # The driver follows this file for the epoch progress line (gti.progress).
                with open(config["progress_file"], "a") as fh:
                    fh.write(json.dumps({**metrics, "wall_time": time.time()}) + "\n")
            with tempfile.TemporaryDirectory() as d:
                save_quantizer(core.cpu() if device.type != "cpu" else core, d)
                core.to(device)
                _save_optimizer(opt, Path(d) / OPTIM_FILE)
                (Path(d) / STATE_FILE).write_text(json.dumps({"epoch": epoch + 1, "history": history}))
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d))
        else:
            ray.train.report(metrics)


def _revive(core, counts, residuals, config, salt, world, opt, reduced=False) -> list[int]:
    """Dead-code revival shared by the per-epoch and per-window paths. `counts` [L, K] are
    summed over workers first (unless `reduced`), so every rank picks the same dead codes;
    each re-seeds them from its own batch, then rank 0's vectors are broadcast so the
    replicas stay identical."""
    import torch.distributed as dist

    if world > 1 and not reduced:
        counts = counts.clone()
        dist.all_reduce(counts)
    gen = torch.Generator().manual_seed(config["seed"] * 7919 + salt)
    got = core.revive_dead_codes(counts, residuals, config["dead_code_threshold"], gen, opt)
    if world > 1:
        dist.broadcast(core.codebooks.data, src=0)
    return got


# Ray Train's failure -> the GtiError a worker raised: the one unwrapping every stage uses.
_unwrap_user_error = user_error


def train_rqvae(ctx: StageContext, emb_path: Path, init_model, n_items: int):
    """Distributed RQ-VAE training; returns (trained model, epoch history)."""
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    s = ctx.cfg.sid
    ds = ray.data.read_parquet(str(emb_path), columns=["embedding"])
    per_worker = max(1, s.batch_size // s.num_workers)
    storage = ctx.work_dir / "ray_train"
    storage.mkdir(parents=True, exist_ok=True)
    progress = storage / "rqvae.progress.jsonl"
    config = {
        "progress_file": str(progress),
        "model": init_model.cfg.to_dict(),
        "init_state": {k: v.detach().cpu() for k, v in init_model.state_dict().items()},
        "epochs": s.epochs,
        "batch_size": per_worker,
        "lr": s.lr,
        "weight_decay": s.weight_decay,
        "dead_code_threshold": s.dead_code_threshold,
        "revive_every_steps": s.revive_every_steps,
        "seed": ctx.cfg.seed,
        "shuffle_buffer": min(max(4 * per_worker, 1024), max(n_items, 1)),
    }
    trainer = TorchTrainer(
        sid_train_loop,
        train_loop_config=config,
        torch_config=TorchConfig(backend="nccl" if s.use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=s.num_workers, use_gpu=s.use_gpu),
        run_config=ray.train.RunConfig(
            # Deterministic name: a rerun with the same storage resumes (Train V2 has no restore).
            name="rqvae",
            storage_path=str(storage),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
        ),
        datasets={"train": ds},
    )
    try:
        with _epoch_progress(ctx, progress, s.epochs):
            result = trainer.fit()
    except Exception as err:  # noqa: BLE001 - user errors keep their one-line message
        user = _unwrap_user_error(err)
        if user is not None:
            raise user from None
        raise
    if result.checkpoint is None:
        raise RuntimeError("RQ-VAE training finished without a checkpoint")
    with result.checkpoint.as_directory() as d:
        model = load_quantizer(d)
        history = json.loads((Path(d) / STATE_FILE).read_text())["history"]
    if not history or history[-1]["epoch"] != s.epochs:
        raise RuntimeError(f"RQ-VAE checkpoint is at epoch {history[-1]['epoch'] if history else 0}, expected {s.epochs}")
    return model, history


@contextmanager
def _epoch_progress(ctx: StageContext, path: Path, epochs: int):
    """Epoch progress with ETA on the driver, from the lines rank 0 appends to `path`."""
    from gti.progress import JsonlFollower, Progress

    bar = Progress(epochs, "rqvae", "epochs", log=ctx.log, every_n=1)

    def on_epoch(m: dict) -> None:
        bar.set(int(m["epoch"]), f"loss {m['loss']:.5g} recon {m['recon_loss']:.5g} quant "
                                 f"{m['quant_loss']:.5g} util {[round(u, 2) for u in m['utilisation']]} "
                                 f"revived {sum(m['revived'])}", at=m.get("wall_time"))

    with bar, JsonlFollower(path, on_epoch, poll_s=2.0):
        yield


def track_sid(ctx: StageContext, history: list[dict], facts: dict) -> None:
    """TensorBoard (and MLflow) scalars of the stage: RQ-VAE training per epoch (train/*) and
    the final SID quality (sid/*: reconstruction, collisions, utilisation and perplexity per
    level), at step = epochs (0 for residual k-means)."""
    from gti.tracking import metric_tags, open_tracker

    with open_tracker(ctx) as tracker:
        for m in history:
            tracker.report({k: v for k, v in m.items() if k != "items"}, step=int(m["epoch"]))
        final = {k: facts[k] for k in ("recon_mse", "collision_rate_before", "collision_rate_after_sinkhorn",
                                       "collision_rate_after", "sinkhorn_rounds", "utilisation",
                                       "perplexity", "assign_items_per_s")}
        tracker.scalars(metric_tags(final, prefix="sid"), len(history))


# --------------------------------------------------------------------------- assignment
class AssignBatch:
    """Callable class for `map_batches`: loads the quantiser once per actor (from bytes, so
    it works on any node), then maps a batch of embeddings to greedy codes."""

    def __init__(self, weights: bytes, meta: str, device: str = "cpu") -> None:
        d = Path(tempfile.mkdtemp(prefix="gti_sid_q_"))
        (d / WEIGHTS_NAME).write_bytes(weights)
        (d / CONFIG_NAME).write_text(meta)
        self.q = load_quantizer(d).to(device)
        self.device = device

    def __call__(self, batch: pa.Table) -> dict:
        with warnings.catch_warnings():
            # Arrow's buffer is read-only; encode never writes to its input, so no copy.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            x = torch.from_numpy(embedding_matrix(batch.column("embedding"), "embeddings")).to(self.device)
        with torch.inference_mode():
            codes = self.q.encode(x)
        return {"codes": codes.to(torch.int32).cpu().numpy()}


def assign_all(ctx: StageContext, emb_path: Path, qdir: Path, n_items: int) -> np.ndarray:
    """Greedy codes int32 [N, L] for every row of emb_path, in file order."""
    import ray

    s = ctx.cfg.sid
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    ds = ray.data.read_parquet(str(emb_path), columns=["embedding"])
    out = ds.map_batches(
        AssignBatch,
        fn_constructor_kwargs={
            "weights": (qdir / WEIGHTS_NAME).read_bytes(),
            "meta": (qdir / CONFIG_NAME).read_text(),
            "device": "cuda" if s.use_gpu else "cpu",
        },
        batch_size=s.assign_batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=s.assign_concurrency),
        num_gpus=1 if s.use_gpu else 0,
    )
    from gti.progress import Progress

    parts, t0 = [], time.time()
    with Progress(n_items, "assign", "items", log=ctx.log) as bar:
        for b in out.iter_batches(batch_size=None, batch_format="numpy"):
            parts.append(np.asarray(b["codes"], dtype=np.int32))
            bar.update(len(parts[-1]))
    codes = np.concatenate(parts) if parts else np.zeros((0, 0), np.int32)
    if codes.shape[0] != n_items:
        raise RuntimeError(f"assignment returned {codes.shape[0]} rows for {n_items} items")
    ctx.log(f"assigned {n_items} items in {time.time() - t0:.1f}s")
    return codes


# --------------------------------------------------------------------------- stage
def sid_map_hash(item_ids, sids, chunk: int = 65536) -> str:
    """sha256 (16 hex) of the item -> SID mapping, independent of row order: the lines
    "item_id\tsid\n" in item_id order (code-point order, as Python sorts str). Takes lists
    or Arrow string arrays; hashes `chunk` lines at a time."""
    import pyarrow.compute as pc

    ids = pa.array(item_ids, pa.string()) if not isinstance(item_ids, pa.Array) else item_ids
    sid_arr = pa.array(sids, pa.string()) if not isinstance(sids, pa.Array) else sids
    order = pc.sort_indices(ids)  # UTF-8 byte order == code-point order
    h = hashlib.sha256()
    for s in range(0, len(order), chunk):
        idx = order.slice(s, chunk)
        lines = pc.binary_join_element_wise(ids.take(idx), sid_arr.take(idx), "\t")
        h.update(("\n".join(lines.to_pylist()) + "\n").encode())
    return h.hexdigest()[:16]


def sid_strings(codec: SidCodec, codes: torch.Tensor) -> pa.Array:
    """SID strings for codes [N, L] as one Arrow string array, built column-wise (no Python
    object per item: at millions of items a list of str and of code lists costs GBs)."""
    import pyarrow.compute as pc

    cols = []
    for lv in range(codes.shape[1]):
        c = codes[:, lv]
        if c.numel() and (int(c.min()) < 0 or int(c.max()) >= codec.codebook_sizes[lv]):
            raise ValueError(f"level {lv} code out of range 0..{codec.codebook_sizes[lv] - 1}")
        table = pa.array([codec.token(lv, k) for k in range(codec.codebook_sizes[lv])], pa.string())
        cols.append(table.take(pa.array(c.numpy())))
    return pc.binary_join_element_wise(*cols, "")


def run(ctx: StageContext) -> StageResult:
    from gti.stages._ray import ensure_ray

    cfg, s = ctx.cfg, ctx.cfg.sid
    emb_path = ctx.input("embed", "embeddings")
    n_items, dim = check_embeddings(emb_path)
    ctx.log(f"{n_items} items, dim {dim}, method {s.method}, {s.levels} levels x {s.codebook_size} codes")
    if n_items < 2:
        raise DataError(f"{emb_path}: sid needs at least 2 items, got {n_items}")
    ensure_ray(cfg)

    # Only the ids are read whole (tens of bytes per item); embeddings are read by row group.
    item_ids = pq.read_table(str(emb_path), columns=["item_id"]).column("item_id").combine_chunks().cast(pa.string())
    rows_reader = EmbeddingRows(emb_path)
    rng = np.random.default_rng(cfg.seed)
    sample_rows = np.sort(rng.choice(n_items, size=min(n_items, s.kmeans_sample), replace=False))
    sample = rows_reader.read(sample_rows)
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    q = build_quantizer(s, dim)
    t0 = time.time()
    history: list[dict] = []
    if s.method == "rqvae":
        inert = q.init_codebooks(sample, iters=s.kmeans_iters, generator=gen)
        ctx.log(f"k-means init on {len(sample_rows)} items: inertia per level {[round(v, 5) for v in inert]}")
        q, history = train_rqvae(ctx, emb_path, q, n_items)
    else:
        q.fit(sample, iters=s.kmeans_iters, generator=gen, log=ctx.log)
    train_s = time.time() - t0
    q.eval()
    if s.method == "rqvae":
        # Saved with the quantiser, so every later re-encoding uses the same precision.
        q.cfg.encode_dtype = resolve_encode_dtype(s.assign_dtype, "cuda" if s.use_gpu else "cpu")
        ctx.log(f"assignment encoder precision: {q.cfg.encode_dtype}")
    qdir = ctx.work_dir
    save_quantizer(q, qdir)
    from safetensors.torch import save_file

    save_file(codebooks_tensor(q), str(ctx.work_dir / "codebooks.safetensors"))

    t1 = time.time()
    codes = torch.from_numpy(assign_all(ctx, emb_path, qdir, n_items)).long()
    assign_s = time.time() - t1
    with torch.no_grad():
        recon = float(((q.decode_codes(codes[sample_rows]) - sample) ** 2).mean())
    before = collision_rate(codes)
    last_cb = q.level_codebooks()[-1].float()

    last_residuals = LastResiduals(q, rows_reader, cache_mb=s.resolve_cache_mb)

    def last_cost(rows: torch.Tensor) -> torch.Tensor:
        return sq_dists(last_residuals(rows.numpy()), last_cb)

    after_sk, sk_rounds = before, 0
    if s.sinkhorn_last_level and before > 0 and s.sinkhorn_rounds > 0:
        from gti.progress import Progress

        # Rounds stop early when they stop helping, so the ETA is an upper bound.
        with Progress(s.sinkhorn_rounds, "sinkhorn", "rounds", log=ctx.log, every_n=1) as rounds:
            codes, sk_rounds = sinkhorn_resolve(
                codes, last_cost, s.sinkhorn_epsilon, s.sinkhorn_iters, s.sinkhorn_rounds,
                sample_rows=s.sinkhorn_sample_rows, seed=cfg.seed, min_gain=s.sinkhorn_min_gain,
                log=lambda msg: rounds.update(1, msg))
        after_sk = collision_rate(codes)
        ctx.log(f"last residuals: {last_residuals.encoded:,} encodes, {last_residuals.used:,} items cached "
                f"(sid.resolve_cache_mb={s.resolve_cache_mb:g})")
    util_q, perp_q = level_usage(codes, q.codebook_sizes)
    final = dedup_extra_level(codes) if s.dedup == "extra_level" else dedup_reassign(codes, last_cost)
    sizes = list(q.codebook_sizes)
    if final.shape[1] > len(sizes):
        sizes.append(int(final[:, -1].max()) + 1)
    after = collision_rate(final)
    util, perp = level_usage(final, sizes)
    ctx.log(
        f"collision rate {before:.4f} -> {after_sk:.4f} after Sinkhorn ({sk_rounds} rounds) -> "
        f"{after:.4f} after {s.dedup}; utilisation {[round(u, 3) for u in util]}"
    )
    stats = {"collision_rate_before": round(before, 6), "collision_rate_after_sinkhorn": round(after_sk, 6),
             "perplexity": [round(p, 2) for p in perp_q]}
    check_gates(util_q, after, s.gates.min_utilisation, s.gates.max_collision_rate, stats)

    del last_residuals, sample
    codec = SidCodec(final.shape[1], sizes, s.token_format)
    sids = sid_strings(codec, final)
    codes_arr = pa.FixedSizeListArray.from_arrays(pa.array(final.to(torch.int32).flatten().numpy()), final.shape[1])
    out_tbl = pa.table({
        "item_id": item_ids,
        "codes": codes_arr.cast(pa.list_(pa.int32())),
        "sid": sids,
    })
    pq.write_table(out_tbl, str(ctx.work_dir / "sid_map.parquet"))
    del out_tbl, codes_arr
    facts = {
        "method": s.method,
        "levels": int(final.shape[1]),
        "quantizer_levels": q.levels,
        "dedup_level_added": bool(final.shape[1] > q.levels),
        "codebook_sizes": sizes,
        "code_dim": int(last_cb.shape[1]),
        "token_format": s.token_format,
        "new_tokens": codec.tokens(),
        "utilisation": [round(u, 6) for u in util],
        "perplexity": [round(p, 4) for p in perp],
        "collision_rate_before": before,
        "collision_rate_after_sinkhorn": after_sk,
        "collision_rate_after": after,
        "sinkhorn_rounds": sk_rounds,
        "recon_mse": recon,
        "sid_map_hash": sid_map_hash(item_ids, sids),
        "n_items": n_items,
        "dim": dim,
        "train_s": round(train_s, 3),
        "assign_s": round(assign_s, 3),
        "assign_items_per_s": round(n_items / max(assign_s, 1e-9), 1),
        "encode_dtype": getattr(q.cfg, "encode_dtype", "float32"),
        "train_history": history,
    }
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
