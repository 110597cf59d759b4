"""The best checkpoint by a validation metric, and the stop rule, for the shared training loop.

What it is for: a task whose hooks name `keep_best` (RL after SFT: `val_mrr`) hands back the
trainable tensors of its best validation instead of its last step's, where the validation
before the first step (the start model) counts too, so a run that only got worse exports its
start model; with a `stop_margin` it stops once the metric falls that far below its start
value. `BestKeeper.observe` is called with every validation (the same all-reduced values on
every rank, so every rank decides alike and takes the collective snapshot together);
`record`/`restore` carry it through a checkpoint (the tensors travel in `BEST_FILE`).

What it does not know: what the metric means, how tensors are gathered (the snapshot callable
does that), DeepSpeed, or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

BEST_FILE = "best.safetensors"


@dataclass
class BestKeeper:
    """metric: higher is better. stop_margin: stop when metric < start - stop_margin (None:
    never). keep: this rank holds the tensors (rank 0); the others only follow the decisions."""

    metric: str
    stop_margin: float | None = None
    keep: bool = True
    start: float | None = None  # the metric before the first step
    value: float | None = None  # the best value so far
    step: int | None = None  # the step that reached it (0: the start model)
    state: dict[str, torch.Tensor] | None = None  # its trainable tensors (full fp32, CPU), rank 0 only

    def observe(self, step: int, val: dict[str, float], snapshot: Callable[[], dict[str, torch.Tensor]]) -> bool:
        """Record the validation of `step`; snapshot() (called on every rank when the value is a
        new best, as it may be collective) gives the tensors. Returns True to stop training."""
        if self.metric not in val:
            raise KeyError(f"validation gave no '{self.metric}' (the metric that picks the best checkpoint); "
                           f"got {sorted(val)}")
        v = float(val[self.metric])
        if self.start is None:
            self.start = v
        if self.value is None or v > self.value:
            sd = snapshot()
            self.value, self.step, self.state = v, int(step), (sd if self.keep else None)
        return self.stop_margin is not None and v < self.start - self.stop_margin

    def record(self) -> dict[str, Any]:
        """What a checkpoint's state keeps (JSON)."""
        return {"metric": self.metric, "start": self.start, "value": self.value, "step": self.step}

    def restore(self, record: dict[str, Any], state: dict[str, torch.Tensor] | None) -> None:
        """Back to a checkpoint's `record` and (rank 0) its best tensors."""
        self.start, self.value, self.step = record.get("start"), record.get("value"), record.get("step")
        self.state = state if self.keep else None
