"""The RQ-VAE training task: the worker loop that trains the `sid` stage's quantiser.

What it is for: `train_rqvae(sid_cfg, seed, emb_path, init_model, n_items, storage, log)` trains
the RQ-VAE on `sid.num_workers` Ray Train workers through the one driver
(`gti.train.ray_train.run_trainer`) and returns (trained model, epoch history); a rerun after a
killed driver resumes from the last checkpointed epoch. `sid_train_loop` is the worker: DDP over
shards of the embeddings, dead-code revival, checkpoints. Every worker starts from the same
k-means codebooks (fitted on the driver) and the shuffle is seeded, so a run is deterministic
for a seed.

What it does not know: how embeddings were made, how codes are assigned or de-duplicated (the
`sid` stage), or Ray's API (only `gti.train.ray_train` calls it).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from gti.sid.quantizer import load_quantizer, save_quantizer
from gti.train import ray_train

STATE_FILE = "train_state.json"
OPTIM_FILE = "optimizer.safetensors"
RUN_NAME = "rqvae"
CACHE_READ_BATCH = 4096  # rows per Ray Data batch when a worker reads its shard into the cache
CACHE_ITEMSIZE = 4  # bytes per cached value: the loop trains on float32 whatever the file holds


# --------------------------------------------------------------------------- epoch cache (pure)
def epoch_cache_fits(rows: int, dim: int, cache_mb: float, itemsize: int = CACHE_ITEMSIZE) -> bool:
    """Whether a worker's shard of `rows` x `dim` values (`itemsize` bytes each) fits in
    `cache_mb` MB (MiB). 0 MB never fits: the streaming path."""
    return cache_mb > 0 and rows * dim * itemsize <= cache_mb * 2**20


def epoch_cache_seed(seed: int, epoch: int, rank: int) -> int:
    """The permutation seed of one worker's epoch: a function of (run seed, epoch, rank) only,
    never of Ray's scheduling, so a resumed run cuts the same batches as an uninterrupted one."""
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])


def cached_epoch_batches(x: torch.Tensor, batch_size: int, seed: int, epoch: int,
                         rank: int) -> Iterator[torch.Tensor]:
    """One epoch over the cached rows `x` [N, D]: a full shuffle (seeded by `epoch_cache_seed`)
    cut into `batch_size` rows a batch, the last one short when N is not a multiple, as the
    streaming path's `iter_torch_batches` (drop_last off) does: ceil(N / batch_size) batches,
    every row exactly once."""
    gen = torch.Generator().manual_seed(epoch_cache_seed(seed, epoch, rank))
    perm = torch.randperm(x.shape[0], generator=gen).to(x.device)
    for i in range(0, x.shape[0], batch_size):
        yield x[perm[i:i + batch_size]]


# --------------------------------------------------------------------------- checkpoints
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


def _restore(model, opt) -> tuple[int, list[dict]]:
    """(start epoch, history) from the latest checkpoint, loading model and optimizer state."""
    with ray_train.latest_checkpoint() as d:
        if d is None:
            return 0, []
        model.load_state_dict(load_quantizer(d).state_dict())
        _load_optimizer(opt, d / OPTIM_FILE)
        st = json.loads((d / STATE_FILE).read_text())
        return int(st["epoch"]), list(st["history"])


def checkpoint_due(epoch: int, epochs: int, since_last_s: float, every_s: float) -> bool:
    """Whether the worker checkpoints after `epoch` (0-based) of `epochs`: always after the last
    one (the driver reads the model from it), otherwise once `every_s` seconds have passed since
    the last checkpoint (0: every epoch). On a small catalog an epoch takes well under a second
    and a checkpoint (write + Ray Train's registration) longer than that (bench/quality/RESULTS.md,
    "Stage overhead: the RQ-VAE's epochs"); a resumed run redoes at most `every_s` seconds of epochs."""
    return epoch == epochs - 1 or since_last_s >= every_s


def _save(core, opt, device, epoch: int, history: list[dict], metrics: dict, config: dict,
          checkpoint: bool = True) -> None:
    """Rank 0: the epoch's progress line and, when `checkpoint`, its checkpoint (quantiser,
    optimizer, history); otherwise only the metrics are reported."""
    if config.get("progress_file"):
        # The driver follows this file for the epoch progress line (gti.common.progress).
        with open(config["progress_file"], "a") as fh:
            fh.write(json.dumps({**metrics, "wall_time": time.time()}) + "\n")
    if not checkpoint:
        ray_train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as d:
        save_quantizer(core.cpu() if device.type != "cpu" else core, d)
        core.to(device)
        _save_optimizer(opt, Path(d) / OPTIM_FILE)
        (Path(d) / STATE_FILE).write_text(json.dumps({"epoch": epoch + 1, "history": history}))
        ray_train.report(metrics, checkpoint_dir=d)


# --------------------------------------------------------------------------- the worker loop
def _read_shard(shard, device) -> torch.Tensor:
    """This worker's whole shard as one float32 tensor [rows, dim] on `device`, in the shard's
    order (order-preserving, so the same rows in the same order on every run and restart)."""
    parts = [b["embedding"].float()
             for b in shard.iter_torch_batches(batch_size=CACHE_READ_BATCH, device=device)]
    return torch.cat(parts) if parts else torch.empty((0, 0), device=device)


def _epoch_batches(shard, cached, config, epoch, rank, device) -> Iterator[torch.Tensor]:
    """The epoch's input batches: from the in-memory `cached` rows, or (None) streamed from the
    Ray Data shard with the seeded local shuffle. The driver chooses (`sid.epoch_cache_mb`): a
    worker whose shard fits reads it once (`_read_shard`), because re-reading a small shard
    through Ray Data each epoch costs far more than the epoch's compute. Either way an epoch is
    ceil(shard rows / batch_size) steps, and Ray Train's shards are equal-sized, so every DDP
    worker runs the same number of steps (the collectives in `_revive` rely on it)."""
    if cached is not None:
        return cached_epoch_batches(cached, config["batch_size"], config["seed"], epoch, rank)
    return (batch["embedding"].float() for batch in shard.iter_torch_batches(
        batch_size=config["batch_size"],
        local_shuffle_buffer_size=config["shuffle_buffer"],
        local_shuffle_seed=config["seed"] * 100003 + epoch,
        device=device,
    ))


def _run_epoch(ddp, core, opt, batches, config, world, device, window, step):
    """One pass over the epoch's `batches`: (code counts [L, K], loss sums [5], last residuals,
    revived per level, step)."""
    levels, k = core.cfg.levels, core.cfg.codebook_size
    every = int(config.get("revive_every_steps", 0))
    counts = torch.zeros(levels, k, dtype=torch.float64, device=device)
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # loss, recon, quant, div, n
    last_res = None
    revived = [0] * levels
    for x in batches:
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
    return counts, sums, last_res, revived, step


def sid_train_loop(config: dict) -> None:
    """Ray Train worker loop for the RQ-VAE (one call per worker).

    DDP (gloo on CPU, nccl on GPU) over shards of the embeddings; per epoch the workers
    all-reduce code usage, re-seed dead codes (rank 0's choice is broadcast) and report metrics;
    a checkpoint (the quantiser, its AdamW state and the epoch history) follows the last epoch
    and, before it, every `sid.checkpoint_every_s` seconds (`checkpoint_due`).

    config: model (RQVAEConfig dict), init_state (state dict with k-means codebooks), epochs,
    batch_size (per worker), lr, weight_decay, dead_code_threshold, seed, shuffle_buffer,
    revive_every_steps, revive_final (re-seed what greedy codes leave unused after the last epoch),
    epoch_cache (read the shard once and shuffle it in memory),
    checkpoint_every_s (`checkpoint_due`), progress_file.
    """
    import torch.distributed as dist

    from gti.sid.rqvae import RQVAE, RQVAEConfig

    rank, world = ray_train.worker_rank_world()
    torch.manual_seed(config["seed"] * 1000 + rank)  # dropout differs per worker, as in DDP
    model = RQVAE(RQVAEConfig(**config["model"]))
    model.load_state_dict(config["init_state"])
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=config["weight_decay"])
    start_epoch, history = _restore(model, opt)
    device = ray_train.torch_device()
    ddp = ray_train.prepare_ddp(model)
    core = model  # prepare_model wraps in DDP but keeps (and moves) this module
    levels, k = model.cfg.levels, model.cfg.codebook_size
    shard = ray_train.dataset_shard("train")
    every, step = int(config.get("revive_every_steps", 0)), 0
    # Usage since the last revival when reviving every `every` steps (spans epochs).
    window = torch.zeros(levels, k, dtype=torch.float64, device=device)
    cached = None  # the shard in memory; rebuilt from the shard by a restarted (resumed) worker
    last_ckpt = time.time()
    for epoch in range(start_epoch, config["epochs"]):
        t0 = time.time()
        core.train()
        if config.get("epoch_cache") and cached is None:
            cached = _read_shard(shard, device)
        batches = _epoch_batches(shard, cached, config, epoch, rank, device)
        counts, sums, last_res, revived, step = _run_epoch(
            ddp, core, opt, batches, config, world, device, window, step)
        if world > 1:
            dist.all_reduce(counts)
            dist.all_reduce(sums)
        if every == 0 and epoch < config["epochs"] - 1 and last_res is not None:
            revived = _revive(core, counts, last_res, config, epoch, world, opt, reduced=True)
        if epoch == config["epochs"] - 1 and config.get("revive_final"):
            got = _revive_unused(core, _epoch_batches(shard, cached, config, epoch, rank, device), config,
                                 epoch, world, opt)
            revived = [a + b for a, b in zip(revived, got)]
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
            due = checkpoint_due(epoch, config["epochs"], time.time() - last_ckpt, config.get("checkpoint_every_s", 0))
            _save(core, opt, device, epoch, history, metrics, config, checkpoint=due)
            last_ckpt = time.time() if due else last_ckpt
        else:
            ray_train.report(metrics)


def _revive_unused(core, batches, config, salt, world, opt) -> list[int]:
    """After the last epoch (sid.revive_after_training): the codes the final greedy assignment
    would leave unused on every worker's shard (counts summed over workers) re-seeded at
    residuals of this worker's first batch (rank 0's broadcast), as `_revive` does."""
    import torch.distributed as dist

    core.eval()
    counts, residuals = core.greedy_usage(batches)
    core.train()
    if world > 1:
        dist.all_reduce(counts)
    if residuals is None:  # an empty shard: nothing to seed from, and nothing to broadcast from rank 0 alone
        residuals = torch.zeros(core.levels, 1, core.cfg.code_dim, device=counts.device)
    return _revive(core, counts, residuals, config, salt + 1, world, opt, reduced=True)


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


# --------------------------------------------------------------------------- driver side
def _read_final(d: Path) -> tuple[Any, list[dict]]:
    return load_quantizer(d), json.loads((d / STATE_FILE).read_text())["history"]


def train_rqvae(s, seed: int, emb_path: Path, init_model, n_items: int, storage: Path,
                log: Callable[[str], None]):
    """Distributed RQ-VAE training (`s` = the `sid` config section); returns (trained model,
    epoch history). A rerun with the same `storage` resumes from the last epoch."""
    from gti.common.progress import Progress

    ds = ray_train.read_parquet_dataset(emb_path, ["embedding"])
    per_worker = max(1, s.batch_size // s.num_workers)
    config = {
        "model": init_model.cfg.to_dict(),
        "init_state": {k: v.detach().cpu() for k, v in init_model.state_dict().items()},
        "epochs": s.epochs,
        "batch_size": per_worker,
        "lr": s.lr,
        "weight_decay": s.weight_decay,
        "dead_code_threshold": s.dead_code_threshold,
        "revive_every_steps": s.revive_every_steps,
        "revive_final": s.revive_after_training,
        "seed": seed,
        "shuffle_buffer": min(max(4 * per_worker, 1024), max(n_items, 1)),
        "checkpoint_every_s": s.checkpoint_every_s,
        # Decided here, once for all workers: Ray Train splits the data into equal shards (at
        # most ceil(n / workers) rows each), so every worker takes the same path.
        "epoch_cache": epoch_cache_fits(-(-n_items // s.num_workers), init_model.cfg.in_dim, s.epoch_cache_mb),
    }
    if config["epoch_cache"]:
        log(f"rqvae: each worker reads its shard once into memory (sid.epoch_cache_mb={s.epoch_cache_mb})")
    # Deterministic name: a rerun with the same storage resumes (Train V2 has no restore).
    # preserve_order: each worker's shard holds the same rows in the same order on every run,
    # so the seeded local shuffle (and so the trained codebooks) is a function of data + seed.
    spec = ray_train.TrainerSpec(name=RUN_NAME, storage_path=storage, num_workers=s.num_workers,
                                 use_gpu=s.use_gpu, backend="nccl" if s.use_gpu else "gloo",
                                 preserve_order=True)
    bar = Progress(s.epochs, "rqvae", "epochs", log=log, every_n=1)

    def on_epoch(m: dict) -> None:
        bar.set(int(m["epoch"]), f"loss {m['loss']:.5g} recon {m['recon_loss']:.5g} quant "
                                 f"{m['quant_loss']:.5g} util {[round(u, 2) for u in m['utilisation']]} "
                                 f"revived {sum(m['revived'])}", at=m.get("wall_time"))

    with bar:
        (model, history), _, _ = ray_train.run_trainer(sid_train_loop, config, {"train": ds}, spec,
                                                       _read_final, progress=on_epoch)
    if not history or history[-1]["epoch"] != s.epochs:
        raise RuntimeError(f"RQ-VAE checkpoint is at epoch {history[-1]['epoch'] if history else 0}, expected {s.epochs}")
    return model, history
