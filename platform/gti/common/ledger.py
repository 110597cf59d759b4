"""An append-only record of the expensive things a command starts: Ray Train runs and Ray
instances.

What it is for: when `$GTI_RUN_LEDGER` names a file, `note(kind, name)` appends one JSON line
`{"kind", "name", "pid", "t"}` to it; `read(path)` gives those lines back. `run_trainer` notes
every Train run ("train") and a local Ray start notes "ray". Subprocesses and Ray workers
inherit the variable, so one file counts everything a command (or the whole test session)
started. The test suite holds a budget on these counts (tests/conftest.py); a user can set it
to see what a job started. Unset, it does nothing.

What it does not know: Ray, or what a budget is. One short `open(..., "a")` per line, which is
atomic enough for lines far under the pipe buffer size written by concurrent processes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

ENV = "GTI_RUN_LEDGER"
KINDS = ("train", "ray")


def note(kind: str, name: str) -> None:
    """Append one line for a started `kind` ("train" or "ray") named `name`, if $GTI_RUN_LEDGER
    is set. Never raises for an unwritable ledger: a record must not fail a run."""
    if kind not in KINDS:
        raise ValueError(f"ledger kind {kind!r}: expected one of {KINDS}")
    path = os.environ.get(ENV)
    if not path:
        return
    line = json.dumps({"kind": kind, "name": name, "pid": os.getpid(), "t": round(time.time(), 3)})
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError:
        pass


def read(path: str | Path) -> list[dict]:
    """Every complete line of the ledger at `path` ([] when it does not exist)."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for raw in p.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue  # a line cut by a killed writer
    return out


def counts(entries: list[dict]) -> dict[str, int]:
    """{"train": n, "ray": m} from `read`'s lines."""
    c = {k: 0 for k in KINDS}
    for e in entries:
        if e.get("kind") in c:
            c[e["kind"]] += 1
    return c
