"""The training loop shared by grounding, SFT and RL (DeepSpeed, on Ray Train workers).

What it is for: `train_loop_per_worker(config)` is what each Ray Train worker runs (started by
`fit` through `gti.train.ray_train.run_trainer`). It builds the model through the task's hooks
(`gti.train.task.TaskHooks`), wraps it in the DeepSpeed engine (`gti.train.engine`), streams
micro-batches from the worker's shard (`gti.train.shards`), steps, validates, reports,
checkpoints and resumes so that a resumed run equals an uninterrupted one. `config` is one
`gti.train.worker_config.WorkerConfig`; no task-specific code lives here (the hooks carry it).

What it does NOT know: how rows are made, which task or stage called it, where outputs go (the
caller reads `trainable.safetensors` from the final checkpoint), or Ray's API (only
`gti.train.ray_train` calls it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from gti import config as C
from gti.config.train import TrainConfig
from gti.common.errors import ConfigError
from gti.common.devices import resolve_precision, use_cpu_threads
from gti.train import faults, nonfinite, ray_train, safe_checkpoint
from gti.train.best import BEST_FILE, BestKeeper
from gti.train.shards import PadCollate, ShardStream
from gti.train.deepspeed_config import micro_batch
from gti.train.engine import make_engine
from gti.train.loss import make_forward, set_training_attention, training_autocast
from gti.train.task import TaskHooks
from gti.train.worker_config import WorkerConfig, from_loop_dict

CKPT_TAG = "ckpt"
DS_DIR = "ds"
STATE_FILE = "gti_state.json"
TRAINABLE_FILE = "trainable.safetensors"


# --------------------------------------------------------------------------- helpers
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


def _run_validation(hooks: TaskHooks, engine, config: WorkerConfig, rank: int, world: int) -> dict[str, float]:
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


@dataclass
class _Worker:
    """What one worker set up: its engine and everything the step loop reads."""

    rank: int
    world: int
    hooks: TaskHooks
    tc: TrainConfig
    engine: Any
    scheduler: Any
    forward: Callable
    trainable: list
    precision: str
    keeper: BestKeeper | None = None  # hooks.keep_best: the best validation's tensors and the stop rule



def _setup(config: WorkerConfig) -> tuple[_Worker, C.RunConfig]:
    """Model through the task's hooks, attention and precision, the DeepSpeed engine."""
    rank, world = ray_train.worker_rank_world()
    task, hooks = config.task, config.hooks
    cfg = C.validate(config.run_config, f"<{task} worker config>")
    tc: TrainConfig = getattr(cfg, task)
    torch.manual_seed(cfg.seed)
    if not tc.use_gpu:
        use_cpu_threads(tc.cpu_threads)
    model = hooks.build_model(config, cfg)
    set_training_attention(model, tc.attn_implementation, tc.use_gpu)
    precision = resolve_precision(tc.precision, tc.use_gpu)
    forward = make_forward(model, precision, "cuda" if tc.use_gpu else "cpu")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ConfigError(f"{task}: the model has no trainable parameters")
    engine, scheduler = make_engine(model, trainable, tc, world, use_gpu=tc.use_gpu,
                                    bf16_weights=cfg.model.dtype == "bfloat16")
    keeper = (BestKeeper(hooks.keep_best, getattr(tc, "stop_margin", None), keep=rank == 0)
              if hooks.keep_best else None)
    return _Worker(rank, world, hooks, tc, engine, scheduler, forward, trainable, precision, keeper), cfg


def _resume(w: _Worker) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(loop state, None) from the latest checkpoint (a fresh state without one); (_, the
    finished result) when that checkpoint is the final one (nothing left to resume)."""
    state: dict[str, Any] = {
        "step": 0, "epoch": 0, "offset": 0,
        "history": {"loss": [], "val": {}, "tokens_per_s": []},
    }
    with ray_train.latest_checkpoint() as d:
        if d is None:
            return state, None
        saved = json.loads((d / STATE_FILE).read_text())
        if int(saved["step"]) >= w.tc.steps or "stopped_at" in saved["history"]:
            # The final checkpoint holds the trained tensors, not the DeepSpeed state:
            # training is over, so there is nothing to resume.
            return saved, {"step": int(saved["step"]), "history": saved["history"],
                           "timing": saved.get("timing"), "precision": saved.get("precision")}
        # Tensors only (weights_only=True + DeepSpeed's allow-list): never a pickle from run_dir.
        path, _ = safe_checkpoint.load_checkpoint(
            w.engine, os.path.join(d, DS_DIR), CKPT_TAG, load_module_strict=False,
            load_optimizer_states=True, load_lr_scheduler_states=True,
        )
        if path is None:
            raise RuntimeError(f"checkpoint {d} has no DeepSpeed state under {DS_DIR}/")
        if w.keeper is not None and "best" in saved["history"]:
            best = d / BEST_FILE
            from safetensors.torch import load_file

            w.keeper.restore(saved["history"]["best"], load_file(str(best)) if w.keeper.keep and best.exists() else None)
        return saved, None


def _train_step(w: _Worker, batches, timing: dict[str, float], config: WorkerConfig,
                step: int) -> tuple[float, float, float | None, float, float, dict[str, float]]:
    """Optimizer step `step + 1` (grad_accum micro-steps): (lr, loss sum, grad norm, tokens,
    seconds, the task's step statistics averaged over the micro-steps)."""
    tc, engine = w.tc, w.engine
    t0 = time.perf_counter()
    lr = float(w.scheduler.get_last_lr()[0])
    loss_sum, tokens, manual_gn, data_s, stats = 0.0, 0, None, 0.0, {}
    for i in range(tc.grad_accum):
        td = time.perf_counter()
        b = {k: v.to(engine.device) for k, v in next(batches).items()}
        data_s += time.perf_counter() - td
        if w.hooks.step_loss is None:
            loss = w.forward(engine, b)
        else:
            with training_autocast(w.precision, "cuda" if tc.use_gpu else "cpu"):
                loss, got = w.hooks.step_loss(engine, b, config, w.rank, step * tc.grad_accum + i)
            for k, v in got.items():
                stats[k] = stats.get(k, 0.0) + float(v) / tc.grad_accum
        engine.backward(loss)
        if tc.zero_stage == 0 and engine.is_gradient_accumulation_boundary():
            manual_gn = _manual_grad_norm(w.trainable)
        engine.step()
        loss_sum += float(loss.detach())
        tokens += int(b["attention_mask"].sum())
    # Time in forward/backward/optimizer vs in fetching data; the rest of a stage's wall
    # time (reports, validation, checkpoints, start-up) is overhead (bench/train_throughput/train_throughput.py).
    timing["data_s"] += data_s
    timing["compute_s"] += time.perf_counter() - t0 - data_s
    gn = engine.get_global_grad_norm()
    gn = manual_gn if gn is None else float(gn)
    return lr, loss_sum, gn, float(tokens), time.perf_counter() - t0, stats


# Checkpoints (every `checkpoint_every` steps and at the last): `ds/` (DeepSpeed's state with
# `exclude_frozen_parameters=True`, read back with `weights_only=True` by
# `gti.train.safe_checkpoint`; not in the final one, after which nothing resumes),
# `gti_state.json` (step, data position, history, timing; rank 0), the best tensors so far
# (`keep_best` tasks) and, in the final one, `trainable.safetensors`. Ray merges the ranks' dirs.
# A resumed run re-iterates the saved epoch's seeded order and skips the consumed micro-batches,
# so it equals an uninterrupted one; a group restarted after the final checkpoint returns at once.
def _checkpoint(w: _Worker, state: dict[str, Any], metrics: dict[str, Any], final: bool) -> None:
    """Report `metrics` with a checkpoint: DeepSpeed state (not in the final one, after which
    nothing resumes), the loop state (rank 0) and, in the final one, the trainable tensors."""
    with tempfile.TemporaryDirectory(prefix="gti-ckpt-") as d:
        if not final:
            # The final one needs no optimizer state (nothing resumes after it): for
            # full SFT of a 135M model that skips writing ~1.6 GB.
            w.engine.save_checkpoint(
                os.path.join(d, DS_DIR), tag=CKPT_TAG, client_state={"step": state["step"]},
                exclude_frozen_parameters=True,
            )
        from safetensors.torch import save_file

        if final:
            # The best validation's tensors where the task keeps them (decided alike on every
            # rank), else the last step's (every rank: the snapshot may gather).
            sd = w.keeper.state if w.keeper is not None else w.hooks.trainable_state(w.engine.module)
            if w.rank == 0:
                save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(d, TRAINABLE_FILE))
        elif w.keeper is not None and w.keeper.state is not None:
            save_file({k: v.contiguous() for k, v in w.keeper.state.items()}, os.path.join(d, BEST_FILE))
        if w.rank == 0:
            Path(d, STATE_FILE).write_text(json.dumps(state))
        ray_train.report(metrics, checkpoint_dir=d)


def _validate(w: _Worker, config: WorkerConfig, step: int, history: dict[str, Any],
              timing: dict[str, float]) -> dict[str, float]:
    """The task's validation at `step`, timed and appended to the history."""
    tv = time.perf_counter()
    val = _run_validation(w.hooks, w.engine, config, w.rank, w.world)
    timing["val_s"] = timing.get("val_s", 0.0) + time.perf_counter() - tv
    for k, v in val.items():
        history["val"].setdefault(k, []).append([step, v])
    return val


def _mean_over_ranks(stats: dict[str, float], world: int, device: torch.device) -> dict[str, float]:
    names = sorted(stats)  # the same task hook on every rank: the same names
    return dict(zip(names, (v / world for v in _all_reduce_sum([stats[n] for n in names], device)))) if names else {}


# --------------------------------------------------------------------------- the loop
# Reported metrics (every `log_every` steps and at every checkpoint; `ray.train.report` is a
# barrier, so every rank reports equally often): step, epoch, loss (mean over ranks and
# micro-steps), lr, tokens_per_s, the grad norm before clipping under `hooks.grad_norm_key`, the
# task's step statistics, and the latest validation metrics, carried forward so every report
# after the first validation has them (Tune's schedulers need the metric in each result). A
# non-finite loss or grad norm stops every rank at the same step (`gti.train.nonfinite`).
def train_loop_per_worker(config: WorkerConfig | dict) -> dict[str, Any]:
    """Ray Train worker entry point; `config` is a WorkerConfig or the dict `run_trainer` made
    of one (what it reports: the comment above).

    Returns (rank 0's value becomes `Result.return_value`): {"step", "history"} with history
    {"loss": [[step, loss]], "val": {metric: [[step, value]]}, "tokens_per_s": [[step, v]]}.
    """
    config = from_loop_dict(config)
    nonfinite.raise_if_marked(config)
    w, cfg = _setup(config)
    tc, engine = w.tc, w.engine
    state, done = _resume(w)
    if done is not None:
        return done
    stream = ShardStream(
        ray_train.dataset_shard("train"), micro_batch(tc, w.world), PadCollate(config.pad_id), cfg.seed,
        epoch=state["epoch"], offset=state["offset"], group_by_length=tc.group_by_length,
    )
    batches = iter(stream)
    history = state["history"]
    last_val = {k: v[-1][1] for k, v in history["val"].items() if v}
    progress = Path(config.progress_file) if w.rank == 0 and config.progress_file else None
    step = int(state["step"])
    engine.train()
    loop_t0 = time.perf_counter()
    timing = state.setdefault("timing", {"compute_s": 0.0, "data_s": 0.0, "loop_s": 0.0})
    snapshot = lambda: w.hooks.trainable_state(engine.module)  # noqa: E731 (every rank: may gather)
    if w.keeper is not None and step == 0:  # the start model's validation: the value to beat
        last_val = _validate(w, config, 0, history, timing)
        w.keeper.observe(0, last_val, snapshot)
    stopped = False
    while step < tc.steps and not stopped:
        lr, loss_sum, gn, tokens, dt, stats = _train_step(w, batches, timing, config, step)
        step += 1
        # All-reduced, so every rank sees the same values and stops at the same step.
        gn_bad = 0.0 if gn is None or math.isfinite(gn) else 1.0
        loss_all, tok_all, bad_ranks = _all_reduce_sum([loss_sum / tc.grad_accum, tokens, gn_bad], engine.device)
        nonfinite.check_step(config, w.rank, step, loss_all / w.world, gn, bad_ranks)
        metrics: dict[str, Any] = {
            "step": step, "epoch": stream.epoch, "loss": loss_all / w.world, "lr": lr,
            "tokens_per_s": tok_all / max(dt, 1e-9),
            w.hooks.grad_norm_key: float(gn if gn is not None else math.nan),
            **_mean_over_ranks(stats, w.world, engine.device),
        }
        history["loss"].append([step, metrics["loss"]])
        history["tokens_per_s"].append([step, metrics["tokens_per_s"]])
        for k in sorted(stats):
            history.setdefault("stats", {}).setdefault(k, []).append([step, metrics[k]])
        if w.hooks.validate is not None and (step % tc.val_every == 0 or step == tc.steps):
            last_val = _validate(w, config, step, history, timing)
            stopped = w.keeper is not None and w.keeper.observe(step, last_val, snapshot)
        metrics.update(last_val)
        if progress is not None:
            with progress.open("a") as fh:
                # wall_time: when the step ended, for the driver's rate and ETA.
                fh.write(json.dumps({**metrics, "wall_time": time.time()}) + "\n")
        final = step == tc.steps or stopped
        if step % tc.checkpoint_every == 0 or final:
            timing["loop_s"] = timing.get("loop_s", 0.0) + time.perf_counter() - loop_t0
            loop_t0 = time.perf_counter()
            if w.keeper is not None:
                history["best"] = w.keeper.record()
            if stopped:
                history["stopped_at"] = step
            state = {"step": step, "epoch": stream.epoch, "offset": stream.offset, "history": history,
                     "timing": timing, "precision": w.precision}
            tc0 = time.perf_counter()
            _checkpoint(w, state, metrics, final)
            timing["checkpoint_s"] = timing.get("checkpoint_s", 0.0) + time.perf_counter() - tc0
        elif step % tc.log_every == 0:
            tr = time.perf_counter()
            ray_train.report(metrics)
            timing["report_s"] = timing.get("report_s", 0.0) + time.perf_counter() - tr
        if config.fault is not None and config.fault.fail_at_step == step:
            faults.maybe_fail(config, w.rank, step // tc.checkpoint_every * tc.checkpoint_every)
    return {"step": step, "history": history, "timing": timing, "precision": w.precision}


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


class _ProgressTail:
    """Driver side of training progress: every step's metrics (from rank 0's progress file,
    followed by `gti.train.ray_train.run_trainer`) drawn with rate and ETA (`gti.common.progress.Progress`:
    a bar on a TTY, else a line every `every` steps through `log`) and handed to `on_metrics`
    (the stage's tracker)."""

    def __init__(self, log: Callable[[str], None], every: int, total: int,
                 on_metrics: Callable[[dict], None] | None = None) -> None:
        from gti.common.progress import Progress

        self.bar = Progress(total, "training", "steps", log=log, every_n=max(1, every))
        self.on_metrics = on_metrics

    def record(self, m: dict) -> None:
        if self.on_metrics is not None:
            self.on_metrics(m)
        extra = "".join(f" {k} {m[k]:.3f}" for k in sorted(m) if k.startswith("val_") or k == "reward_mean")
        self.bar.set(int(m.get("step", 0)), f"loss {m['loss']:.4f} lr {m['lr']:.2e} "
                                            f"tokens/s {m['tokens_per_s']:.0f}{extra}", at=m.get("wall_time"))

    def __enter__(self) -> "_ProgressTail":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


def _read_final(d: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return json.loads((d / STATE_FILE).read_text()), load_file(str(d / TRAINABLE_FILE))


def fit(
    config: WorkerConfig,
    train_ds: Any,
    train_cfg: TrainConfig,
    *,
    storage_path: str | Path,
    name: str,
    log: Callable[[str], None] = print,
    progress_every: int = 10,
    callbacks: list | None = None,
    on_metrics: Callable[[dict], None] | None = None,
) -> FitResult:
    """Run `train_loop_per_worker(config)` on `train_cfg.num_workers` Ray Train workers (through
    `gti.train.ray_train.run_trainer`) and return the final trainable tensors. `train_ds` is a Ray
    Dataset of rows {"input_ids": list[int], "labels": list[int]}, in the order to train.

    Resume: a run re-created with the same `storage_path` and `name` starts from its latest
    checkpoint, so `name` must be deterministic and `storage_path` must survive a killed driver
    (the stage's work dir does). Worker failures are retried `train_cfg.max_failures` times
    from the latest checkpoint. A `GtiError` raised in a worker is re-raised here as is.
    `callbacks` go to the Train RunConfig (`gti tune` passes `TuneReportCallback`).
    `on_metrics(metrics)` is called on the driver with every step's reported metrics, read from
    rank 0's progress file (the stage writes them to its tracker).
    """
    # Same env in every worker: DeepSpeed must not probe for CUDA on CPU-only workers.
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if not train_cfg.use_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    spec = ray_train.TrainerSpec(
        name=name, storage_path=Path(storage_path), num_workers=train_cfg.num_workers,
        use_gpu=train_cfg.use_gpu,
        # e.g. {CPU: 1, gti_worker: 1} puts one worker on each node (cluster/local_cluster.sh).
        resources_per_worker=train_cfg.resources_per_worker,
        max_failures=train_cfg.max_failures, env=env,
        # preserve_order makes the shard contents deterministic, so resume == uninterrupted.
        preserve_order=True, callbacks=list(callbacks or []),
    )
    # One id per fit call: restarted worker groups of this call see a NaN stop of an earlier
    # attempt (`gti.train.nonfinite.raise_if_marked`); a later call trains afresh.
    config = dataclasses.replace(config, fit_id=uuid.uuid4().hex)
    tail = _ProgressTail(log, progress_every, train_cfg.steps, on_metrics)
    with tail:
        (st, sd), metrics, path = ray_train.run_trainer(
            train_loop_per_worker, config, {"train": train_ds}, spec, _read_final, progress=tail.record,
        )
    if int(st["step"]) != train_cfg.steps and "stopped_at" not in st["history"]:
        raise RuntimeError(f"latest checkpoint of {name} is at step {st['step']}, expected {train_cfg.steps}")
    return FitResult(
        state_dict=sd, history=st["history"], steps_done=int(st["step"]), metrics=metrics, path=path,
        timing=st.get("timing"), precision=st.get("precision"),
    )
