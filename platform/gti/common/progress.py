"""One progress helper for all long work: a bar with rate and ETA on a terminal, a plain
periodic line otherwise (CI logs, files, `ray job` output).

What it is for: `Progress(total, desc, unit)` counts done units (`update(n)` adds, `set(done)`
sets) and shows them: a tqdm bar on a TTY, else one line through `log` at most every
`interval_s` seconds (and always for the last unit), such as
`embed: 2,048/4,385 items (46.7%) 312.4 items/s ETA 7s`. `JsonlFollower` is the other half of
driver-side progress for Ray Train runs: it follows the JSON-lines file a worker appends to and
hands every new record to a callback (progress, tracking events).

What it does not know: what is being counted, Ray, or where `log` writes. No torch, no Ray.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, TextIO


def format_duration(seconds: float) -> str:
    """Seconds -> '7s', '2m05s', '1h02m'; '?' when unknown (inf/NaN)."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _count(n: float) -> str:
    return f"{int(n):,}" if float(n).is_integer() else f"{n:,.1f}"


class Progress:
    """Progress of `total` units (None: unknown total, no ETA).

    tty: None = decide from `stream.isatty()`; True forces the bar, False the plain lines.
    log: where plain lines go (default: `stream`, with `desc: ` in front of each line).
    interval_s: the least time between two plain lines (the first and last always print).
    every_n: print a plain line each time the count reaches a multiple of `every_n` instead
        (training steps: every `log_every`-th step), whatever the time.
    clock: time source (wall time, so that `set(..., at=)` can pass a worker's time.time()).
    """

    def __init__(
        self,
        total: float | None,
        desc: str,
        unit: str = "it",
        *,
        log: Callable[[str], None] | None = None,
        interval_s: float = 10.0,
        every_n: int | None = None,
        tty: bool | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.time,
        initial: float = 0,
    ) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self.log = log if log is not None else (lambda m: print(f"{desc}: {m}", file=self.stream, flush=True))
        self.interval_s, self.every_n, self.clock = interval_s, every_n, clock
        self.done = initial
        # Rate counts only units done while we watched (a resumed run starts at `initial`).
        self._start_done, self._t0 = initial, clock()
        self._last_line: float | None = None
        self._emitted_done: float | None = None
        self._anchor: tuple[float, float] | None = None  # (time, done) at the first update
        self._last_t: float | None = None  # time of the last update
        self._postfix = ""
        self._closed = False
        self._bar = None
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, initial=initial, file=self.stream,
                             dynamic_ncols=True, leave=True)

    # ----------------------------------------------------------------- counting
    def update(self, n: float = 1, postfix: str | None = None) -> None:
        self.set(self.done + n, postfix)

    def set(self, done: float, postfix: str | None = None, at: float | None = None) -> None:
        """Set the count of done units (never backwards: a replayed record is ignored).
        `at`: when they were done (a worker's wall time from its report); the driver reads
        reports in bursts, so its own clock would give bursts of impossible rates."""
        if postfix is not None:
            self._postfix = postfix
        if done < self.done:
            return
        delta, self.done = done - self.done, done
        self._last_t = self.clock() if at is None else float(at)
        if at is not None and at < self._t0:
            # Done before this Progress started (a resumed run's progress file replayed from
            # its start): counted, but no part of the rate, or the hours between the killed
            # attempt and this one would make it crawl.
            self._start_done = done
        elif self._anchor is None:
            self._anchor = (self._last_t, done)
        if self._bar is not None:
            if postfix is not None:
                self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(delta)
            return
        now = self.clock()
        finished = self.total is not None and self.done >= self.total
        if self.every_n:
            due = self._emitted_done is None or self.done // self.every_n > self._emitted_done // self.every_n
        else:
            due = self._last_line is None or now - self._last_line >= self.interval_s
        if due or finished:
            self._emit(now)

    def rate(self, now: float | None = None) -> float:
        """Units per second: from the first update on once there are two (start-up, e.g. Ray
        Train's worker group or an actor pool, is not work and would inflate the ETA), since
        this Progress started before that."""
        now = self.clock() if now is None else now
        end = self._last_t if self._last_t is not None else now  # up to the last unit done
        if self._anchor is not None and self.done > self._anchor[1] and end > self._anchor[0]:
            return (self.done - self._anchor[1]) / (end - self._anchor[0])
        dt = now - self._t0
        return (self.done - self._start_done) / dt if dt > 0 else 0.0

    def eta_s(self, now: float | None = None) -> float:
        if self.total is None:
            return math.inf
        r = self.rate(now)
        left = max(self.total - self.done, 0)
        return 0.0 if left == 0 else (left / r if r > 0 else math.inf)

    def line(self, now: float | None = None, final: bool = False) -> str:
        """The plain progress line for the current state (`final`: elapsed time, no ETA)."""
        now = self.clock() if now is None else now
        if self.total:
            head = f"{_count(self.done)}/{_count(self.total)} {self.unit} ({100 * self.done / self.total:.1f}%)"
        else:
            head = f"{_count(self.done)} {self.unit}"
        r = self.rate(now)
        # Slow work reads better as seconds per unit ("4.0 s/round") than as 0.2 rounds/s.
        one = self.unit[:-1] if self.unit.endswith("s") and len(self.unit) > 2 else self.unit
        rate = f"{r:,.1f} {self.unit}/s" if r >= 1 or r == 0 else f"{1 / r:,.1f} s/{one}"
        if final or self.total is None or self.done >= self.total:
            tail = f" in {format_duration(now - self._t0)}"
        else:
            tail = f" ETA {format_duration(self.eta_s(now))}"
        post = f" {self._postfix}" if self._postfix else ""
        return f"{head} {rate}{tail}{post}"

    def _emit(self, now: float, final: bool = False) -> None:
        self._last_line, self._emitted_done = now, self.done
        self.log(self.line(now, final))

    def close(self) -> None:
        """Finish: closes the bar, or prints the last state if it was not printed yet."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self._emitted_done != self.done or (self.total is not None and self.done < self.total):
            # Also when it stopped short of the total (e.g. Sinkhorn rounds that stopped
            # helping): the last line then says how long it took, not an ETA.
            self._emit(self.clock(), final=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class JsonlFollower:
    """Thread that follows `path` (a JSON-lines file another process appends to) and calls
    `on_record(dict)` for every complete line, in order, from the start of the file.

    Lines still being written (no newline yet) are read on the next poll; lines that do not
    parse are skipped. On exit the file is drained once more, so no record is missed.
    """

    def __init__(self, path: str | Path, on_record: Callable[[dict[str, Any]], None], poll_s: float = 1.0) -> None:
        self.path, self.on_record, self.poll_s = Path(path), on_record, poll_s
        self._pos = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "JsonlFollower":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.drain()

    def drain(self) -> None:
        with self._lock:
            if not self.path.is_file():
                return
            with self.path.open("rb") as fh:
                fh.seek(self._pos)
                for line in fh:
                    if not line.endswith(b"\n"):
                        break  # a line being written; read it next time
                    self._pos += len(line)
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(rec, dict):
                        self.on_record(rec)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.drain()
            except Exception as err:  # noqa: BLE001 - progress must never end a training run
                print(f"gti: warning: progress from {self.path}: {err}", file=sys.stderr, flush=True)
