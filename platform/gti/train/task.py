"""The contract between the shared training loop and a task (grounding, SFT, RL), and what the
tasks' hooks share.

What it is for: `TaskHooks` (build the model, hand back its trainable tensors, validate), which
each task `name` of `TASKS` defines and registers in its own module `gti.train.<name>_task`;
`hooks_for(name)` looks them up, importing that module by name on the first lookup, so
`WorkerConfig.build` puts them into the worker config without importing any task module. And
the helpers the tasks' hooks share: `full_fp32_cpu`, `rank_share` and `load_trie`.

What it does not know: how the loop steps, or any task's data; it imports no task module.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class TaskHooks:
    """What differs between tasks. All callables must be module-level (they are pickled).

    build_model(config, run_cfg) -> nn.Module with requires_grad True exactly on the trainables
        (config: the `WorkerConfig`; run_cfg: the RunConfig the worker validated).
    trainable_state(module) -> {name: CPU float32 tensor}; called on EVERY rank (it may gather
        ZeRO-3 partitions); rank 0's result is written to `trainable.safetensors`.
    validate(module, config, rank, world) -> {metric: (numerator, denominator)}; called on every
        rank with the module in eval mode under no_grad, each rank on its share (equal number
        of forward passes per rank, which ZeRO-3 needs); the loop sums both over ranks.
    step_loss(engine, batch, config, rank, step) -> (scalar loss, {stat: float}): replaces the
        loop's teacher-forced loss on a micro-batch (RL: rollouts, rewards, the GRPO objective);
        `step` is the optimizer step being taken (1-based); the loop averages the stats over
        micro-batches and ranks and reports them with the step's metrics. None: the labelled loss.
    keep_best: a validation metric (higher is better): the loop also validates before the first
        step, keeps the trainable tensors of the best validation (the start model's when no
        step beats it) and hands those back; with the task config's `stop_margin` set it stops
        once the metric falls that far below its start value. None: the last step's tensors.
    """

    build_model: Callable[[Any, Any], torch.nn.Module]
    trainable_state: Callable[[torch.nn.Module], dict[str, torch.Tensor]]
    validate: Callable[[torch.nn.Module, Any, int, int], dict[str, tuple[float, float]]] | None = None
    grad_norm_key: str = "grad_norm"
    step_loss: Callable[[Any, dict[str, torch.Tensor], Any, int, int], tuple[torch.Tensor, dict[str, float]]] | None = None
    keep_best: str | None = None


TASKS = ("ground", "sft", "rl")  # the training tasks; task `name`'s hooks live in gti.train.<name>_task
_HOOKS: dict[str, TaskHooks] = {}  # filled by the task modules as they are imported


def register(name: str, hooks: TaskHooks) -> TaskHooks:
    """Record `hooks` as task `name`'s (its module calls this once, at import) and return them."""
    if name not in TASKS:
        raise ValueError(f"unknown training task '{name}' (one of {', '.join(TASKS)})")
    _HOOKS[name] = hooks
    return hooks


def hooks_for(name: str) -> TaskHooks:
    """Task `name`'s hooks, importing `gti.train.<name>_task` (which registers them) the first
    time; ValueError for a name not in `TASKS`."""
    if name not in TASKS:
        raise ValueError(f"unknown training task '{name}' (one of {', '.join(TASKS)})")
    if name not in _HOOKS:
        importlib.import_module(f"gti.train.{name}_task")
    return _HOOKS[name]


def full_fp32_cpu(p: torch.nn.Parameter) -> torch.Tensor:
    """Full fp32 CPU copy of a parameter: DeepSpeed's fp32 master copy where one exists
    (ZeRO 1-3, bf16 training), else the parameter itself, gathered under ZeRO-3. Collective
    under ZeRO-3, so every rank must call it."""
    from deepspeed.utils import safe_get_full_fp32_param

    from gti.lm import new_rows

    full = safe_get_full_fp32_param(p)
    if full is None:
        with new_rows.gathered([p]):
            full = p.detach().clone()
    return full.detach().to("cpu", torch.float32).clone()


def rank_share(n: int, rank: int, world: int) -> tuple[list[int], torch.Tensor]:
    """Rows of an n-row validation table for `rank`: ceil(n/world) rows each, the last ranks
    wrapping around, so every rank runs the same number of forward passes (ZeRO-3 needs that).
    Returns (row indices, BoolTensor[per] marking the rows that count)."""
    per = math.ceil(n / world)
    idx = [rank * per + i for i in range(per)]
    return [i % n for i in idx], torch.tensor([i < n for i in idx])


@lru_cache(maxsize=4)
def load_trie(path: str, new_start: int, new_end: int):
    """The catalog's SID trie from `path` (its `sid_token_ids`), cached per worker."""
    from safetensors.torch import load_file

    from gti.sid.trie import SidTrie

    return SidTrie(load_file(path)["sid_token_ids"], new_start, new_end)
