"""The Ray Train worker loop shared by grounding and SFT.

What it is for: `train_loop_per_worker(config)` is the function a `ray.train.torch.TorchTrainer`
runs in each worker. It builds the model through a task's hooks, wraps it in the DeepSpeed
engine (ZeRO stage, precision, AdamW and batch arithmetic from `gti.train.deepspeed_config`;
torch.distributed is already initialised by Ray Train with gloo on CPU / nccl on GPU, and
`deepspeed.initialize` wraps that process group instead of creating a new one), streams
micro-batches from `ray.train.get_dataset_shard("train")`, steps to `steps`, reports per-step
metrics, checkpoints through `ray.train.report`, resumes from `ray.train.get_checkpoint()`, and
every `val_every` steps runs the task's validation.

`config` (one dict, Ray examples style; everything in it must pickle):
- "task": "ground" | "sft"; "section": config section with the TrainConfig (default = task);
- "run_config": `RunConfig.model_dump(mode="json")` of the run (validated again in the worker);
- "pad_id": int, the token used to right-pad batches (masked out of attention and loss);
- "hooks": optional `TaskHooks`; default `DEFAULT_HOOKS[task]`;
- "progress_file": optional path; rank 0 appends one JSON line of metrics per step to it;
- task-specific keys read by the hooks ("ground": {...}, "val": {...} for grounding).

Dataset rows: {"input_ids": list[int], "labels": list[int]} (labels -100 outside the answer),
padded per micro-batch to the longest row ([B, T] input_ids / labels / attention_mask).

Reported metrics (every `log_every` steps and at every checkpoint; `ray.train.report` is a
barrier, so every rank reports the same number of times): step, epoch, loss (mean over ranks
and accumulation micro-steps), lr (the lr the step used), tokens_per_s (non-pad tokens of all
ranks / step wall time), the grad norm before clipping under `hooks.grad_norm_key`
(`grad_norm_new_rows` for grounding: only the new rows are trainable), and the latest
validation metrics (e.g. `val_exact_match`), carried forward between validations so that every
report after the first validation has them (Tune's schedulers need the metric in each result).

Checkpoints (every `checkpoint_every` steps and at the last step): a temp dir holding `ds/`
(DeepSpeed `save_checkpoint` with `exclude_frozen_parameters=True`: trainable weights, the
ZeRO-partitioned optimizer state of each rank, the lr scheduler; not in the last one, after
which nothing resumes), `gti_state.json` (step, data position, metric history, timing; rank 0)
and, in the last one, `trainable.safetensors` (the task's trainable tensors, full fp32, from
`hooks.trainable_state`). A worker group restarted after the last checkpoint returns at once. Each rank reports its own dir; Ray
merges them into one checkpoint. On restart the latest one is loaded and training continues at
the saved step with the same data position: the shard is re-iterated from the start of the
saved epoch (same seeded order) and the already-consumed micro-batches are skipped. The data
order is deterministic (the driver passes a seeded, order-preserving dataset; the per-epoch
local shuffle is seeded by seed + epoch), which is what makes a resumed run equal an
uninterrupted one.

What it does NOT know: how pairs or SFT examples are made, which stage called it, where outputs
go (the stage reads `trainable.safetensors` from the final checkpoint).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from gti import config as C
from gti.errors import DataError
from gti.devices import resolve_precision, use_cpu_threads
from gti.train.deepspeed_config import build_ds_config, micro_batch
from gti.train.schedule import LrMultiplier

CKPT_TAG = "ckpt"
DS_DIR = "ds"
STATE_FILE = "gti_state.json"
TRAINABLE_FILE = "trainable.safetensors"
IGNORE_INDEX = -100


# --------------------------------------------------------------------------- task hooks
@dataclass(frozen=True)
class TaskHooks:
    """What differs between tasks. All callables must be module-level (they are pickled).

    build_model(config, run_cfg) -> nn.Module with requires_grad True exactly on the trainables.
    trainable_state(module) -> {name: CPU float32 tensor}; called on EVERY rank (it may gather
        ZeRO-3 partitions); rank 0's result is written to `trainable.safetensors`.
    validate(module, config, rank, world) -> {metric: (numerator, denominator)}; called on every
        rank with the module in eval mode under no_grad, each rank on its share (equal number
        of forward passes per rank, which ZeRO-3 needs); the loop sums both over ranks.
    """

    build_model: Callable[[dict, C.RunConfig], torch.nn.Module]
    trainable_state: Callable[[torch.nn.Module], dict[str, torch.Tensor]]
    validate: Callable[[torch.nn.Module, dict, int, int], dict[str, tuple[float, float]]] | None = None
    grad_norm_key: str = "grad_norm"


# --------------------------------------------------------------------------- batches
class PadCollate:
    """collate_fn for `iter_torch_batches`: {"input_ids": [B] lists, "labels": [B] lists} ->
    LongTensors input_ids / labels / attention_mask [B, T], right-padded to the longest row."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = int(pad_id)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        ids = [np.asarray(x, dtype=np.int64) for x in batch["input_ids"]]
        labels = [np.asarray(x, dtype=np.int64) for x in batch["labels"]]
        t = max(len(x) for x in ids)
        b = len(ids)
        out_ids = np.full((b, t), self.pad_id, dtype=np.int64)
        out_lab = np.full((b, t), IGNORE_INDEX, dtype=np.int64)
        mask = np.zeros((b, t), dtype=np.int64)
        for i, (x, y) in enumerate(zip(ids, labels)):
            if len(x) != len(y):
                raise DataError(f"training row {i} of a batch: input_ids and labels differ in length")
            out_ids[i, : len(x)] = x
            out_lab[i, : len(y)] = y
            mask[i, : len(x)] = 1
        return {
            "input_ids": torch.from_numpy(out_ids),
            "labels": torch.from_numpy(out_lab),
            "attention_mask": torch.from_numpy(mask),
        }


class ShardStream:
    """Endless iterator of micro-batches over a Ray Data shard, epoch after epoch, that knows
    its position (epoch, micro-batches consumed in it) and can start from one.

    Every epoch is the same seeded order, so skipping `offset` batches reproduces the
    position exactly. With `group_by_length` the shard is read in chunks of `window` micro-
    batches' worth of rows and each chunk is cut into micro-batches of similar length
    (`gti.train.batching.length_grouped_batches`, seeded by seed, epoch and chunk), so padding
    costs little; each row appears exactly once per epoch and the epoch's last micro-batch may
    be short. Without it, a seeded local shuffle buffer and full micro-batches only.
    Raises DataError if an epoch has no micro-batch.
    """

    WINDOW = 32  # micro-batches per length-grouping chunk

    def __init__(self, shard: Any, micro: int, collate: PadCollate, seed: int,
                 epoch: int = 0, offset: int = 0, group_by_length: bool = False) -> None:
        self.shard, self.micro, self.collate, self.seed = shard, micro, collate, seed
        self.epoch, self.offset = epoch, offset
        self.group_by_length = group_by_length
        # A few batches of local shuffle give each epoch a different order at no memory cost.
        self.buffer = max(64, 8 * micro)

    def _epoch_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        if not self.group_by_length:
            yield from self.shard.iter_torch_batches(
                batch_size=self.micro,
                collate_fn=self.collate,
                drop_last=True,
                local_shuffle_buffer_size=self.buffer,
                local_shuffle_seed=self.seed + self.epoch,
                prefetch_batches=1,
            )
            return
        from gti.train.batching import length_grouped_batches

        chunks = self.shard.iter_batches(
            batch_size=self.micro * self.WINDOW, batch_format="numpy", prefetch_batches=1,
        )
        for c, chunk in enumerate(chunks):
            ids, labels = chunk["input_ids"], chunk["labels"]
            lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
            seed = int(np.random.SeedSequence([self.seed, self.epoch, c]).generate_state(1)[0])
            for idx in length_grouped_batches(lengths, self.micro, seed, window=self.WINDOW):
                yield self.collate({"input_ids": [ids[i] for i in idx], "labels": [labels[i] for i in idx]})

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            n = 0
            for i, batch in enumerate(self._epoch_batches()):
                n += 1
                if i < self.offset:
                    continue
                self.offset = i + 1
                yield batch
            if n == 0:
                raise DataError(
                    f"a training worker's data shard has no full micro-batch of {self.micro} rows"
                )
            self.epoch, self.offset = self.epoch + 1, 0


# --------------------------------------------------------------------------- helpers
class _SchedulerFactory:
    """deepspeed.initialize(lr_scheduler=callable): optimizer -> LambdaLR (picklable)."""

    def __init__(self, schedule: str, warmup: int, total: int) -> None:
        self.mult = LrMultiplier(schedule, warmup, total)

    def __call__(self, optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.mult)


def _manual_grad_norm(params: list[torch.nn.Parameter]) -> float:
    """L2 norm of the gradients of `params` (ZeRO stage 0 does not record one)."""
    sq = [p.grad.detach().float().pow(2).sum() for p in params if p.grad is not None]
    return float(torch.stack(sq).sum().sqrt()) if sq else 0.0


def _all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu().tolist()


def _run_validation(hooks: TaskHooks, engine, config: dict, rank: int, world: int) -> dict[str, float]:
    module = engine.module
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            raw = hooks.validate(module, config, rank, world) if hooks.validate else {}
    finally:
        module.train(was_training)
    names = sorted(raw)
    if not names:
        return {}
    flat = _all_reduce_sum([float(v) for n in names for v in raw[n]], engine.device)
    return {n: (flat[2 * i] / flat[2 * i + 1] if flat[2 * i + 1] > 0 else 0.0) for i, n in enumerate(names)}


def _hooks(config: dict) -> TaskHooks:
    hooks = config.get("hooks")
    if hooks is not None:
        return hooks
    task = config["task"]
    if task not in DEFAULT_HOOKS:
        raise C.ConfigError(f"unknown training task '{task}' (known: {sorted(DEFAULT_HOOKS)})")
    return DEFAULT_HOOKS[task]


# --------------------------------------------------------------------------- the loop
def train_loop_per_worker(config: dict) -> dict[str, Any]:
    """Ray Train worker entry point; see the module docstring for `config`.

    Returns (rank 0's value becomes `Result.return_value`): {"step", "history"} with history
    {"loss": [[step, loss]], "val": {metric: [[step, value]]}, "tokens_per_s": [[step, v]]}.
    """
    import deepspeed
    import ray.train
    from ray.train import Checkpoint

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    task = config["task"]
    hooks = _hooks(config)
    cfg = C.validate(config["run_config"], f"<{task} worker config>")
    tc: C.TrainConfig = getattr(cfg, config.get("section", task))
    torch.manual_seed(cfg.seed)

    if not tc.use_gpu:
        use_cpu_threads(tc.cpu_threads)
    model = hooks.build_model(config, cfg)
    set_training_attention(model, tc.attn_implementation, tc.use_gpu)
    precision = resolve_precision(tc.precision, tc.use_gpu)
    forward = make_forward(model, precision, "cuda" if tc.use_gpu else "cpu")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise C.ConfigError(f"{task}: the model has no trainable parameters")
    ds_cfg = build_ds_config(tc, world, use_gpu=tc.use_gpu, bf16_weights=cfg.model.dtype == "bfloat16")
    engine, _, _, scheduler = deepspeed.initialize(
        model=model,
        model_parameters=trainable,
        config=ds_cfg,
        lr_scheduler=_SchedulerFactory(tc.schedule, tc.warmup_steps, tc.steps),
    )

    state: dict[str, Any] = {
        "step": 0, "epoch": 0, "offset": 0,
        "history": {"loss": [], "val": {}, "tokens_per_s": []},
    }
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            saved = json.loads((Path(d) / STATE_FILE).read_text())
            if int(saved["step"]) >= tc.steps:
                # The final checkpoint holds the trained tensors, not the DeepSpeed state:
                # training is over, so there is nothing to resume.
                return {"step": int(saved["step"]), "history": saved["history"],
                        "timing": saved.get("timing"), "precision": saved.get("precision")}
            path, _ = engine.load_checkpoint(
                os.path.join(d, DS_DIR), tag=CKPT_TAG, load_module_strict=False,
                load_optimizer_states=True, load_lr_scheduler_states=True,
            )
            if path is None:
                raise RuntimeError(f"checkpoint {d} has no DeepSpeed state under {DS_DIR}/")
            state = json.loads((Path(d) / STATE_FILE).read_text())

    micro = micro_batch(tc, world)
    stream = ShardStream(
        ray.train.get_dataset_shard("train"), micro, PadCollate(config["pad_id"]), cfg.seed,
        epoch=state["epoch"], offset=state["offset"], group_by_length=tc.group_by_length,
    )
    batches = iter(stream)
    history = state["history"]
    last_val = {k: v[-1][1] for k, v in history["val"].items() if v}
    progress = Path(config["progress_file"]) if rank == 0 and config.get("progress_file") else None
    step = int(state["step"])
    engine.train()
    loop_t0 = time.perf_counter()

    timing = state.setdefault("timing", {"compute_s": 0.0, "data_s": 0.0, "loop_s": 0.0})
    while step < tc.steps:
        t0 = time.perf_counter()
        lr = float(scheduler.get_last_lr()[0])
        loss_sum, tokens, manual_gn, data_s = 0.0, 0, None, 0.0
        for _ in range(tc.grad_accum):
            td = time.perf_counter()
            b = {k: v.to(engine.device) for k, v in next(batches).items()}
            data_s += time.perf_counter() - td
            loss = forward(engine, b)
            engine.backward(loss)
            if tc.zero_stage == 0 and engine.is_gradient_accumulation_boundary():
                manual_gn = _manual_grad_norm(trainable)
            engine.step()
            loss_sum += float(loss.detach())
            tokens += int(b["attention_mask"].sum())
        step += 1
        # Time in forward/backward/optimizer vs in fetching data; the rest of a stage's wall
        # time (reports, validation, checkpoints, start-up) is overhead (bench/train_throughput).
        timing["data_s"] += data_s
        timing["compute_s"] += time.perf_counter() - t0 - data_s
        gn = engine.get_global_grad_norm()
        gn = manual_gn if gn is None else float(gn)
        dt = time.perf_counter() - t0
        loss_all, tok_all = _all_reduce_sum([loss_sum / tc.grad_accum, float(tokens)], engine.device)
        metrics: dict[str, Any] = {
            "step": step,
            "epoch": stream.epoch,
            "loss": loss_all / world,
            "lr": lr,
            "tokens_per_s": tok_all / max(dt, 1e-9),
            hooks.grad_norm_key: float(gn if gn is not None else math.nan),
        }
        history["loss"].append([step, metrics["loss"]])
        history["tokens_per_s"].append([step, metrics["tokens_per_s"]])
        if hooks.validate is not None and (step % tc.val_every == 0 or step == tc.steps):
            tv = time.perf_counter()
            last_val = _run_validation(hooks, engine, config, rank, world)
            timing["val_s"] = timing.get("val_s", 0.0) + time.perf_counter() - tv
            for k, v in last_val.items():
                history["val"].setdefault(k, []).append([step, v])
        metrics.update(last_val)
        if progress is not None:
            with progress.open("a") as fh:
                # wall_time: when the step ended, for the driver's rate and ETA.
                fh.write(json.dumps({**metrics, "wall_time": time.time()}) + "\n")

        final = step == tc.steps
        if step % tc.checkpoint_every == 0 or final:
            timing["loop_s"] = timing.get("loop_s", 0.0) + time.perf_counter() - loop_t0
            loop_t0 = time.perf_counter()
            state = {"step": step, "epoch": stream.epoch, "offset": stream.offset, "history": history,
                     "timing": timing, "precision": precision}
            tc0 = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="gti-ckpt-") as d:
                if not final:
                    # The final one needs no optimizer state (nothing resumes after it): for
                    # full SFT of a 135M model that skips writing ~1.6 GB.
                    engine.save_checkpoint(
                        os.path.join(d, DS_DIR), tag=CKPT_TAG, client_state={"step": step},
                        exclude_frozen_parameters=True,
                    )
                if final:
                    sd = hooks.trainable_state(engine.module)  # every rank: may gather
                    if rank == 0:
                        from safetensors.torch import save_file

                        save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(d, TRAINABLE_FILE))
                if rank == 0:
                    Path(d, STATE_FILE).write_text(json.dumps(state))
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d))
            timing["checkpoint_s"] = timing.get("checkpoint_s", 0.0) + time.perf_counter() - tc0
        elif step % tc.log_every == 0:
            tr = time.perf_counter()
            ray.train.report(metrics)
            timing["report_s"] = timing.get("report_s", 0.0) + time.perf_counter() - tr
        if config.get("fail_at_step") == step:
            _maybe_fail(config, rank)

    return {"step": step, "history": history, "timing": timing, "precision": precision}


def set_training_attention(model: torch.nn.Module, setting: str, use_gpu: bool) -> str | None:
    """Apply `attn_implementation` ("auto": eager on CPU, unchanged on GPU) to the HF model
    inside `model` (a peft wrapper's base model too). Returns what was set, None if nothing."""
    from gti.train.loss import _causal_lm

    impl = ("eager" if not use_gpu else None) if setting == "auto" else setting
    lm = _causal_lm(model)
    if impl is None or not callable(getattr(lm, "set_attn_implementation", None)):
        return None
    lm.set_attn_implementation(impl)
    return impl


def make_forward(model: torch.nn.Module, precision: str, device_type: str) -> Callable:
    """(engine, batch) -> scalar loss for this model and resolved precision.

    The loss is computed only at labelled positions (`gti.train.loss.labelled_loss`: last
    hidden states gathered where the next label is not -100, then projected), which equals
    the HF forward with `labels=`; models the shortcut cannot serve exactly fall back to the
    HF forward. "bf16" runs the forward under bf16 autocast: weights, gradients and optimizer
    state stay in their own dtype (fp32 unless model.dtype says otherwise).
    """
    from gti.train.loss import labelled_loss, supports_labelled_loss

    fast = supports_labelled_loss(model)
    autocast = precision == "bf16"

    def forward(engine, b: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            if fast:
                return labelled_loss(engine, b["input_ids"], b["attention_mask"], b["labels"])
            return engine(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss

    return forward


def _maybe_fail(config: dict, rank: int) -> None:
    """Fault injection for the reliability tests: rank `fail_rank` kills its own process once
    (guarded by the marker file `fail_marker`, created just before dying)."""
    if rank != config.get("fail_rank", 0):
        return
    marker = Path(config["fail_marker"])
    if marker.exists():
        return
    marker.write_text(str(os.getpid()))
    os._exit(1)


# --------------------------------------------------------------------------- driver side
@dataclass
class FitResult:
    """What a finished Ray Train run left: the task's trainable tensors (from the final
    checkpoint), the metric history, the last reported metrics and the run's storage path."""

    state_dict: dict[str, torch.Tensor]
    history: dict[str, Any]
    steps_done: int
    metrics: dict[str, Any]
    path: str
    # Rank 0's seconds in forward/backward/optimizer ("compute_s"), fetching batches
    # ("data_s"), validation ("val_s"), checkpoints incl. their report ("checkpoint_s"), plain
    # metric reports ("report_s") and the whole step loop ("loop_s"), summed over attempts.
    timing: dict[str, float] | None = None
    precision: str | None = None  # the resolved precision the workers trained in


def train_dataset_from_parquet(path: str | Path, seed: int, split: str = "train"):
    """Ray Dataset of the `split` rows of a pairs-style parquet file: columns input_ids,
    labels; globally shuffled once with `seed` (the same order every epoch and every run) and
    materialised, so later epochs replay it from the object store instead of re-running the
    read and the all-to-all shuffle (seconds per epoch otherwise)."""
    import pyarrow.compute as pc
    import ray

    def keep(t):
        return t.filter(pc.equal(t["split"], split)).select(["input_ids", "labels"])

    ds = ray.data.read_parquet(str(path), columns=["split", "input_ids", "labels"])
    return ds.map_batches(keep, batch_format="pyarrow").random_shuffle(seed=seed).materialize()


class _ProgressTail:
    """Driver side of training progress: follows rank 0's progress file (one JSON line of
    reported metrics per step, `gti.progress.JsonlFollower`), draws the steps with rate and ETA
    (`gti.progress.Progress`: a bar on a TTY, else a line every `every` steps through `log`)
    and hands every step's metrics to `on_metrics` (the stage's tracker)."""

    def __init__(self, path: Path, log: Callable[[str], None], every: int, total: int,
                 on_metrics: Callable[[dict], None] | None = None) -> None:
        from gti.progress import JsonlFollower, Progress

        self.bar = Progress(total, "training", "steps", log=log, every_n=max(1, every))
        self.on_metrics = on_metrics
        self.follower = JsonlFollower(path, self._record, poll_s=2.0)

    def _record(self, m: dict) -> None:
        if self.on_metrics is not None:
            self.on_metrics(m)
        extra = "".join(f" {k} {m[k]:.3f}" for k in sorted(m) if k.startswith("val_"))
        self.bar.set(int(m.get("step", 0)), f"loss {m['loss']:.4f} lr {m['lr']:.2e} "
                                            f"tokens/s {m['tokens_per_s']:.0f}{extra}", at=m.get("wall_time"))

    def __enter__(self) -> "_ProgressTail":
        self.follower.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.follower.__exit__(*exc)
        self.bar.close()


def fit(
    loop_config: dict,
    train_ds: Any,
    train_cfg: C.TrainConfig,
    *,
    storage_path: str | Path,
    name: str,
    log: Callable[[str], None] = print,
    progress_every: int = 10,
    callbacks: list | None = None,
    on_metrics: Callable[[dict], None] | None = None,
) -> FitResult:
    """Run `train_loop_per_worker` on `train_cfg.num_workers` Ray Train workers and return the
    final trainable tensors.

    Resume (Ray Train V2 has no `Trainer.restore`): a run re-created with the same
    `storage_path` and `name` starts from its latest checkpoint, so `name` must be
    deterministic and `storage_path` must survive a killed driver (the stage's work dir does).
    Worker failures are retried `train_cfg.max_failures` times from the latest checkpoint.
    A `GtiError` raised in a worker is re-raised here as is (one line for the CLI).
    `callbacks` go to the Train RunConfig (`gti tune` passes `TuneReportCallback`).
    `on_metrics(metrics)` is called on the driver with every step's reported metrics, read from
    rank 0's progress file (the stage writes them to its tracker).
    """
    import ray.train
    from ray.data import ExecutionOptions
    from ray.train.torch import TorchTrainer

    storage_path = Path(storage_path)
    storage_path.mkdir(parents=True, exist_ok=True)
    progress = storage_path / f"{name}.progress.jsonl"
    loop_config = {**loop_config, "progress_file": str(progress)}
    # Same env in every worker: DeepSpeed must not probe for CUDA on CPU-only workers.
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if not train_cfg.use_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config,
        scaling_config=ray.train.ScalingConfig(
            num_workers=train_cfg.num_workers,
            use_gpu=train_cfg.use_gpu,
            # e.g. {CPU: 1, gti_worker: 1} puts one worker on each node (cluster/local_cluster.sh).
            resources_per_worker=train_cfg.resources_per_worker,
        ),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=str(storage_path),
            failure_config=ray.train.FailureConfig(max_failures=train_cfg.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
            worker_runtime_env={"env_vars": env},
            callbacks=list(callbacks or []),
        ),
        datasets={"train": train_ds},
        # preserve_order makes the shard contents deterministic, so resume == uninterrupted.
        dataset_config=ray.train.DataConfig(execution_options=ExecutionOptions(preserve_order=True)),
    )
    try:
        with _ProgressTail(progress, log, progress_every, train_cfg.steps, on_metrics):
            result = trainer.fit()
    except Exception as err:  # noqa: BLE001 - re-raise user errors as themselves
        from gti.errors import user_error

        user = user_error(err)
        if user is not None:
            raise user from None
        raise
    if result.checkpoint is None:
        raise RuntimeError(f"training run {name} finished without a checkpoint")
    from safetensors.torch import load_file

    with result.checkpoint.as_directory() as d:
        st = json.loads((Path(d) / STATE_FILE).read_text())
        if int(st["step"]) != train_cfg.steps:
            raise RuntimeError(
                f"latest checkpoint of {name} is at step {st['step']}, expected {train_cfg.steps}"
            )
        sd = load_file(str(Path(d) / TRAINABLE_FILE))
    return FitResult(
        state_dict=sd, history=st["history"], steps_done=int(st["step"]),
        metrics=dict(result.metrics or {}), path=str(result.path),
        timing=st.get("timing"), precision=st.get("precision"),
    )


# --------------------------------------------------------------------------- grounding hooks
def load_base_model(cfg: C.RunConfig):
    """The pretrained model before vocabulary extension, identical in every process (safetensors
    weights, or the tiny model, which `gti.lm.models` always builds with the same seed)."""
    from gti.lm import models

    model, _ = models.load_model_and_tokenizer(cfg.model)
    return model


def build_ground_model(config: dict, cfg: C.RunConfig) -> torch.nn.Module:
    """Base model + new rows [first_new_id, first_new_id + n_new) initialised from
    config["ground"]["init_path"] (safetensors: e_new [V_new, d], head_new for untied heads);
    backbone and old rows frozen, only the new rows trainable."""
    from safetensors.torch import load_file

    from gti.lm import vocab

    g = config["ground"]
    model = load_base_model(cfg)
    init = load_file(g["init_path"])
    vocab.attach_new_rows(model, int(g["first_new_id"]), int(g["n_new"]), init["e_new"], init.get("head_new"))
    vocab.freeze_backbone(model)
    return model


def full_fp32_cpu(p: torch.nn.Parameter) -> torch.Tensor:
    """Full fp32 CPU copy of a parameter: DeepSpeed's fp32 master copy where one exists
    (ZeRO 1-3, bf16 training), else the parameter itself, gathered under ZeRO-3. Collective
    under ZeRO-3, so every rank must call it."""
    from deepspeed.utils import safe_get_full_fp32_param

    from gti.lm import vocab

    full = safe_get_full_fp32_param(p)
    if full is None:
        with vocab.gathered([p]):
            full = p.detach().clone()
    return full.detach().to("cpu", torch.float32).clone()


def ground_trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{"e_new": [V_new, d]} (+ "head_new" untied), full fp32 (see `full_fp32_cpu`)."""
    from gti.lm import vocab

    params = vocab.new_rows_parameters(module)
    return {name: full_fp32_cpu(p) for name, p in zip(["e_new", "head_new"], params)}


def rank_share(n: int, rank: int, world: int) -> tuple[list[int], torch.Tensor]:
    """Rows of an n-row validation table for `rank`: ceil(n/world) rows each, the last ranks
    wrapping around, so every rank runs the same number of forward passes (ZeRO-3 needs that).
    Returns (row indices, BoolTensor[per] marking the rows that count)."""
    per = math.ceil(n / world)
    idx = [rank * per + i for i in range(per)]
    return [i % n for i in idx], torch.tensor([i < n for i in idx])


@lru_cache(maxsize=4)
def load_trie(path: str, new_start: int, new_end: int):
    from safetensors.torch import load_file

    from gti.sid.trie import SidTrie

    return SidTrie(load_file(path)["sid_token_ids"], new_start, new_end)


def validate_ground(module: torch.nn.Module, config: dict, rank: int, world: int) -> dict[str, tuple[float, float]]:
    """Exact match of greedy text->SID generation constrained to catalog SIDs.

    config["val"]: {"path": parquet with `prompt` list<int> (chat prompt + any forced answer
    prefix such as <sid_start>) and `target` list<int> (the L SID token ids), "sids_path":
    safetensors `sid_token_ids` [N_items, L], "new_start", "new_end", "levels", "pad_id"}.
    Rank r takes rows r*ceil(n/world) ... (wrapping, padded rows not counted), so every rank
    runs the same number of forward passes.
    """
    v = config.get("val")
    if not v:
        return {}
    import pyarrow.parquet as pq

    from gti.eval.decode import constrained_beam_search

    table = pq.read_table(v["path"])
    n = table.num_rows
    if n == 0:
        return {}
    rows, valid = rank_share(n, rank, world)
    prompts_all = table.column("prompt").to_pylist()
    targets_all = table.column("target").to_pylist()
    trie = load_trie(v["sids_path"], int(v["new_start"]), int(v["new_end"]))
    res = constrained_beam_search(
        module, [prompts_all[i] for i in rows], trie,
        beam_width=1, k=1, levels=int(v["levels"]), pad_id=int(v["pad_id"]), batch_users=16,
    )
    target = torch.tensor([targets_all[i] for i in rows], dtype=torch.long)
    hit = (res.sid_ids[:, 0, :].cpu() == target).all(dim=1) & valid
    return {"val_exact_match": (float(hit.sum()), float(valid.sum()))}


GROUND_HOOKS = TaskHooks(
    build_model=build_ground_model,
    trainable_state=ground_trainable_state,
    validate=validate_ground,
    grad_norm_key="grad_norm_new_rows",
)

# Task name -> default hooks. Only grounding has one; the SFT stage passes its hooks in the
# worker config ("hooks").
DEFAULT_HOOKS: dict[str, TaskHooks] = {"ground": GROUND_HOOKS}
