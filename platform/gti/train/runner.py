"""What every training-task runner shares: the typed result, the Train run, the history facts.

What it is for: a task runner (`gti.train.ground_run`, `gti.train.sft_run`, `gti.train.rl_run`)
has one shape: typed inputs in (the task's inputs dataclass, then the Train run's `storage_path`
and `name`, the caller's `start_ray`, `log` and optional `tracker`), a `TrainResult` out. `train`
is the part they all do the same way (the caller starts Ray: `gti.train` sits below the stages,
which own Ray's start); resume is `fit`'s: a second call with the same storage path, run name,
worker config and rows continues from the latest checkpoint. `loss_ends` and `curve` read the
history the way every caller's facts spell it.

What it does not know: the task (the runner chose the worker config and the dataset), where
the caller exports, Ray's API (`gti.train.ray_train` reads the data, `gti.train.loop` trains).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

from gti.train.worker_config import WorkerConfig


@dataclass
class TrainResult:
    """What a runner hands its caller."""

    state_dict: dict[str, torch.Tensor]  # the task's trained tensors (the final checkpoint's), full fp32
    history: dict[str, Any]  # {"loss": [[step, v]], "val": {metric: [[step, v]]}, "tokens_per_s": [[step, v]]}
    facts: dict[str, Any]  # the run's facts, keyed as the callers' manifests record them


def train(
    config: WorkerConfig,
    dataset: Callable[[], Any],
    train_cfg: Any,
    *,
    storage_path: str | Path,
    name: str,
    start_ray: Callable[[], None],
    log: Callable[[str], None],
    progress_every: int,
    callbacks: list | None = None,
    tracker: Callable[[], ContextManager] | None = None,
):
    """`start_ray()`, `dataset()` (a Ray Dataset of {"input_ids", "labels"} rows, in training
    order), then `gti.train.loop.fit` on `train_cfg` (the task's TrainConfig) inside
    `tracker()` (a context manager whose value's `.report(metrics)` gets every step's metrics;
    opened only once Ray and the data are ready, so a refused run leaves no tracker run).
    Returns fit's `FitResult`."""
    from gti.train import loop  # looked up at call time: tests replace loop.fit

    start_ray()
    ds = dataset()
    with (tracker() if tracker is not None else nullcontext(None)) as t:
        return loop.fit(
            config, ds, train_cfg, storage_path=storage_path, name=name, log=log,
            progress_every=progress_every, callbacks=callbacks,
            on_metrics=t.report if t is not None else None,
        )


def loss_ends(history: dict[str, Any]) -> dict[str, float | None]:
    """{"first_loss", "final_loss"}: the loss of the first and last step (None: no step)."""
    loss = history.get("loss", [])
    return {"first_loss": loss[0][1] if loss else None, "final_loss": loss[-1][1] if loss else None}


def curve(history: dict[str, Any], metric: str) -> list[dict[str, float]]:
    """A validation metric's history as [{"step": int, "value": float}] (empty: never validated)."""
    return [{"step": int(s), "value": float(v)} for s, v in history.get("val", {}).get(metric, [])]
