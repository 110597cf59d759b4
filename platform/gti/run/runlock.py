"""One writer per run folder: an exclusive, non-blocking lock on `<folder>/.gti.lock`.

What it is for: every command that writes a run folder (`gti run`, `stage`, `refresh`, `tune`,
`compare`, `vocab ground`) holds `RunLock(folder)` while it writes; a second writer is refused
at once with one line naming the holder (`RunLockedError`). Readers (`gti recommend`, `serve`,
`infer`, `report-only`) never take it and never wait on it: stage folders and refresh versions
are swapped into place whole (`gti.common.files.replace_dir`).

What it does not know: what is in the folder. `flock` is advisory and local to one kernel: two
machines writing one folder on shared storage are not stopped by it (on a cluster only the
driver writes the run folder; workers write into their own checkpoint paths).
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path

from gti.common.errors import GtiError

LOCK_FILE = ".gti.lock"

# folder (resolved) -> [open file, count]: this process's held locks
_HELD: dict[str, list] = {}


class RunLockedError(GtiError):
    """Another live process holds the folder's lock; the message names it."""


def holder(folder: str | Path, name: str = LOCK_FILE) -> dict | None:
    """What the lock file of `folder` says about its last holder (None: never locked). The
    holder may be gone: only `RunLock` knows whether the lock is held."""
    try:
        return json.loads((Path(folder) / name).read_text() or "null")
    except (OSError, ValueError):
        return None


class RunLock:
    """`with RunLock(folder, what="gti run"):` ... : the folder's exclusive writer lock.

    Creates `folder` if needed. Raises RunLockedError at once when another process holds it,
    naming its pid, command and start time (instead of deleting the first writer's
    `.<stage>.partial` or publishing over its refresh version). The lock is `flock(2)` on an open
    file: the kernel drops it when the holder dies however it dies, so a killed holder's lock is
    taken over by the next writer with nothing to clean up. The same process may take the same
    folder's lock again (a Tune sweep runs the base run's stages inside its own lock): the lock
    is counted per process and released with the last holder."""

    def __init__(self, folder: str | Path, what: str | None = None, name: str = LOCK_FILE) -> None:
        self.folder = Path(folder).expanduser().resolve()
        self.name = name  # another lock file name: several outputs sharing one parent folder
        self.what = what or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])

    def __enter__(self) -> "RunLock":
        key = str(self.folder / self.name)
        if key in _HELD:
            _HELD[key][1] += 1
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / self.name
        f = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open while the lock is held
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            h = holder(self.folder, self.name) or {}
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["t"])) if h.get("t") else "?"
            raise RunLockedError(
                f"{self.folder} is in use by another gti process (pid {h.get('pid', '?')}, "
                f"'{h.get('command', '?')}', since {since}); wait for it to end or stop it, then run this "
                f"again") from None
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "command": self.what, "t": round(time.time(), 1)}))
        f.flush()
        _HELD[key] = [f, 1]
        return self

    def __exit__(self, *exc) -> None:
        key = str(self.folder / self.name)
        entry = _HELD.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _HELD[key]
            try:
                fcntl.flock(entry[0].fileno(), fcntl.LOCK_UN)
            finally:
                entry[0].close()


def held_here(folder: str | Path, name: str = LOCK_FILE) -> bool:
    """Whether this process holds the lock of `folder`."""
    return str(Path(folder).expanduser().resolve() / name) in _HELD
