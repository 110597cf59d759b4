"""Where a stage's wall time goes: the `timing` facts of the stages that do not train.

What it is for: `Timer`, named phases timed with `with timer.phase("read"): ...` (a phase entered
twice adds up), seconds measured elsewhere added with `timer.add(name, seconds)` (e.g. summed over
Ray actors, so those may exceed the wall time), and `timer.facts()` -> {"read_s": 1.234, ...,
"total_s": ...} for the stage's manifest (`facts.timing`). Rates are `rate(n, seconds)`.
`Timer(memory=True)` also keeps each phase's peak resident memory (`memory_facts()`; Linux
only), so a manifest says which phase holds its memory peak (bench/scale_memory).

What it does not know: stages, Ray, what the phases mean (each stage's docstring says).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def peak_rss_mb() -> float | None:
    """This process's peak resident set (VmHWM) in MB since start or `reset_peak_rss`; None
    where /proc does not say (not Linux)."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Start VmHWM again from the current resident set (Linux's clear_refs "5"); False where
    that is not allowed."""
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


class Timer:
    """Named wall-time phases of one stage run, in seconds; with `memory`, each phase's peak
    resident memory in MB. Phases may nest: an inner phase's peak counts from the start of the
    outermost phase it is in (the peak is reset only when an outermost phase starts)."""

    def __init__(self, memory: bool = False) -> None:
        self.t0 = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.memory = memory
        self.peak_mb: dict[str, float] = {}
        self._depth = 0

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + float(seconds)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.memory and self._depth == 0:
            reset_peak_rss()
        self._depth += 1
        start = time.perf_counter()
        try:
            yield
        finally:  # a phase that raised still counts (the facts are not written then anyway)
            self.add(name, time.perf_counter() - start)
            self._depth -= 1
            peak = peak_rss_mb() if self.memory else None
            if peak is not None:  # a phase entered twice keeps its larger peak
                self.peak_mb[name] = max(self.peak_mb.get(name, 0.0), peak)

    def facts(self) -> dict[str, float]:
        out = {f"{k}_s": round(v, 3) for k, v in self.seconds.items()}
        out["total_s"] = round(time.perf_counter() - self.t0, 3)
        return out

    def memory_facts(self) -> dict[str, float]:
        """{"<phase>_peak_mb": peak resident MB of this process in that phase} (empty without
        `memory`, or where /proc does not say)."""
        return {f"{k}_peak_mb": round(v, 1) for k, v in self.peak_mb.items()}


def rate(n: int, seconds: float) -> float:
    """n / seconds, rounded for a manifest (0 for an unmeasured phase)."""
    return round(n / seconds, 1) if seconds > 0 else 0.0
