"""The DeepSpeed engine a training worker steps: `make_engine(model, trainable, tc, world, ...)`.

What it is for: one place that turns a model and its trainable parameters into the engine and
LR scheduler of `deepspeed.initialize`, with gti's settings (the config dict of
`gti.train.deepspeed_config`, the schedule of `gti.train.schedule`), and that drops work one
rank does not need. At ZeRO stage 0 DeepSpeed all-reduces every gradient after backward even
in a group of one: it flattens the gradients into buckets, all-reduces them over the single
rank, divides by 1 and copies them back, so they come back bit for bit the same; on CPU that
copy is a large share of a small model's step (bench/train_throughput/RESULTS.md, "One-rank
training step without DeepSpeed's all-reduce"). A one-rank ZeRO-0 engine here skips it; any other world size or ZeRO stage keeps DeepSpeed's reduction.

What it does NOT know: Ray, tasks, rows, where the model came from.
"""

from __future__ import annotations

from typing import Any

import torch

from gti.config.train import TrainConfig
from gti.train.deepspeed_config import build_ds_config
from gti.train.schedule import LrMultiplier


class SchedulerFactory:
    """deepspeed.initialize(lr_scheduler=callable): optimizer -> LambdaLR (picklable)."""

    def __init__(self, schedule: str, warmup: int, total: int) -> None:
        self.mult = LrMultiplier(schedule, warmup, total)

    def __call__(self, optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.mult)


def skips_gradient_allreduce(world: int, zero_stage: int) -> bool:
    """True where the all-reduce after backward is a no-op copy: one rank, ZeRO stage 0 (stages
    1-3 reduce inside their own optimizer, which needs its buffers filled)."""
    return world == 1 and zero_stage == 0


def make_engine(model: torch.nn.Module, trainable: list[torch.nn.Parameter], tc: TrainConfig, world: int,
                *, use_gpu: bool, bf16_weights: bool) -> tuple[Any, Any]:
    """(DeepSpeed engine, its LambdaLR scheduler) for `model` training `trainable` under `tc`,
    data-parallel over `world` ranks (torch.distributed already initialised)."""
    import deepspeed

    engine, _, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=trainable,
        config=build_ds_config(tc, world, use_gpu=use_gpu, bf16_weights=bf16_weights),
        lr_scheduler=SchedulerFactory(tc.schedule, tc.warmup_steps, tc.steps),
    )
    if skips_gradient_allreduce(world, tc.zero_stage):
        # DeepSpeed's own switch (set False by the engine itself when it has no dist backend):
        # backward then leaves the gradients where autograd put them.
        engine.enable_backward_allreduce = False
    return engine, scheduler
