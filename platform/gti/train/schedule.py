"""Learning-rate schedules as picklable multipliers for `torch.optim.lr_scheduler.LambdaLR`.

What it is for: one definition of warmup + constant / linear / cosine decay (`LrMultiplier`),
shared by the training tasks. The scheduler is built in torch rather than with DeepSpeed's
`WarmupLR` family because DeepSpeed's versions clamp `warmup_num_steps` to at least 2 (so "no
warmup" still starts at a reduced lr) and spread their options over three classes; a `LambdaLR`
passed to `deepspeed.initialize(lr_scheduler=...)` is stepped by the engine once per optimizer
step and saved and restored with the engine checkpoint.

What it does not know: optimizers, DeepSpeed, Ray. Pure Python.
"""

from __future__ import annotations

import math


class LrMultiplier:
    """Callable `s -> multiplier` for `LambdaLR`; its settings live in `__dict__`, which
    `LambdaLR.state_dict` stores, so a checkpoint restores them.

    `s` is the 0-based index of the optimizer step about to be taken (the number of scheduler
    steps already made); the lr used by step `s` is `base_lr * LrMultiplier(s)`:
    - warmup (s < W): (s + 1) / W, so the first step already moves (never lr 0);
    - after warmup, with progress p = (s - W) / (T - W) in [0, 1):
      constant -> 1; linear -> 1 - p; cosine -> (1 + cos(pi p)) / 2.
    """

    def __init__(self, schedule: str, warmup_steps: int, total_steps: int) -> None:
        if schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown schedule {schedule!r}")
        if warmup_steps < 0 or total_steps < 0:
            raise ValueError("warmup_steps and total_steps must be >= 0")
        self.schedule = schedule
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)

    def __call__(self, s: int) -> float:
        w, t = self.warmup_steps, self.total_steps
        if s < w:
            return (s + 1) / w
        if self.schedule == "constant":
            return 1.0
        p = min(1.0, (s - w) / max(1, t - w))
        if self.schedule == "linear":
            return 1.0 - p
        return 0.5 * (1.0 + math.cos(math.pi * p))
