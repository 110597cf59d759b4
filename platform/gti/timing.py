"""Where a stage's wall time goes: the `timing` facts of the stages that do not train.

What it is for: `Timer`, named phases timed with `with timer.phase("read"): ...` (a phase
entered twice adds up), seconds measured elsewhere added with `timer.add(name, seconds)` (e.g.
summed over Ray actors, which run in parallel, so those may exceed the wall time), and
`timer.facts()` -> {"read_s": 1.234, ..., "total_s": wall seconds since the timer started} for
the stage's manifest (`facts.timing`, as the training stages' `gti.train.loop` timing). Rates
(items per second of a phase) are `rate(n, seconds)`. Costs a `perf_counter` call per phase.

What it does not know: stages, Ray, what the phases mean (each stage's docstring says).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class Timer:
    """Named wall-time phases of one stage run, in seconds."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + float(seconds)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:  # a phase that raised still counts (the facts are not written then anyway)
            self.add(name, time.perf_counter() - start)

    def facts(self) -> dict[str, float]:
        out = {f"{k}_s": round(v, 3) for k, v in self.seconds.items()}
        out["total_s"] = round(time.perf_counter() - self.t0, 3)
        return out


def rate(n: int, seconds: float) -> float:
    """n / seconds, rounded for a manifest (0 for an unmeasured phase)."""
    return round(n / seconds, 1) if seconds > 0 else 0.0
