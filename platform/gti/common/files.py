"""Atomic file writes and folder swaps: readers see the old one or the new one, never half of it.

What it is for: every artefact gti writes in place (manifests, configs, metrics, reports), and
every folder gti replaces whole (an exported model, a stage folder): `atomic_write_bytes` /
`atomic_write_json` (a temp file renamed over the target), `replace_dir(new, dst)` (a finished
folder put at `dst`, the old one removed only after), and `check_replaceable_dir(dst, ...)`
(before any work, refuse a `dst` that gti must not delete).

What it does not know: what the bytes are, or the run-directory layout (that is `manifest`).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

from gti.common.errors import GtiError


class UnsafeReplaceError(GtiError):
    """gti was asked to replace a folder it must not delete; the message names it and why."""


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the new one, never half.

    Errors (disk full, permission denied) propagate as OSError naming the path, and the
    previous file is left untouched because only a temp file was written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


# --------------------------------------------------------------------------- folders
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_NO_EXCHANGE = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths `a` and `b` in one step (Linux renameat2 RENAME_EXCHANGE). False where the
    platform or the file system cannot (the caller falls back to two renames)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(b))


def remove_path(p: Path) -> None:
    """Remove `p` whatever it is (a symlink or file is unlinked, never followed)."""
    if p.is_symlink() or p.is_file():
        p.unlink(missing_ok=True)
    elif p.exists():
        shutil.rmtree(p, ignore_errors=True)


def replace_dir(new: str | Path, dst: str | Path) -> None:
    """Put the finished folder `new` at `dst` (same file system), then remove the old `dst`.

    Where the kernel can exchange two paths, `dst` is always a complete folder: the old one
    until the exchange, the new one after. Elsewhere the old one is renamed aside first (put
    back if the second rename fails). Check first with `check_replaceable_dir` that `dst` may
    be deleted at all. On Linux the exchange is one `renameat2(RENAME_EXCHANGE)`; elsewhere a
    crash between the two renames leaves the old folder beside `dst`, never deleted."""
    new, dst = Path(new), Path(dst)
    if not dst.exists() and not dst.is_symlink():
        os.rename(new, dst)
        return
    if _exchange(new, dst):
        remove_path(new)  # holds the old folder now
        return
    aside = dst.with_name(f".{dst.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(dst, aside)
    try:
        os.rename(new, dst)
    except BaseException:
        os.rename(aside, dst)
        raise
    remove_path(aside)


def _resolved(p: str | Path) -> Path:
    return Path(p).expanduser().resolve()


def default_protected() -> dict[str, Path]:
    """Folders no gti output may replace: the current directory and the home directory (and
    so every folder above them, `/` included)."""
    return {"the current directory": Path.cwd(), "your home directory": Path.home()}


def check_replaceable_dir(dst: str | Path, *, is_ours: Callable[[Path], bool], force: bool = False,
                          protected: Mapping[str, str | Path | None] | None = None,
                          what: str = "output folder", ours: str = "a gti output",
                          force_hint: str = "--force") -> None:
    """Raise UnsafeReplaceError unless `dst` may be replaced whole.

    Refused always: `dst` equal to or above any `protected` path (label -> path; the current
    and home directories are always protected), and a `dst` that exists but is not a folder.
    Refused unless `force`: a non-empty folder for which `is_ours(dst)` is False. A missing or
    empty folder, or one of ours, may be replaced."""
    dst = Path(dst).expanduser()
    target = _resolved(dst)
    guards = {**default_protected(), **{k: v for k, v in (protected or {}).items() if v is not None}}
    for label, p in guards.items():
        pr = _resolved(p)
        if target == pr or target in pr.parents:
            rel = "is" if target == pr else "contains"
            raise UnsafeReplaceError(f"{what} {dst} {rel} {label} ({pr}); gti replaces its {what} whole, "
                                     f"so choose a new folder")
    if not dst.exists() and not dst.is_symlink():
        return
    if not dst.is_dir():
        raise UnsafeReplaceError(f"{what} {dst} exists and is not a folder; remove it or choose another path")
    if not any(dst.iterdir()) or is_ours(dst):
        return
    if force:
        return
    raise UnsafeReplaceError(f"{what} {dst} is a non-empty folder that is not {ours}; gti would replace it "
                             f"whole: choose a new or empty folder, or pass {force_hint} to replace it")
