"""User-facing errors, and the one place that finds them inside Ray's exception wrappers.

Anything derived from `GtiError` is a mistake the user can fix (a bad key, file, row or
argument). The CLI prints its message as one line and exits non-zero, without a traceback.
Everything else is a bug and keeps its traceback.

`user_error(err)` digs the `GtiError` out of whatever Ray raised around it (a task error, a
Ray Data `UserCodeException`, a Ray Train failure with per-worker errors), so that every stage
and the CLI unwrap the same way. It duck-types Ray's attributes (`.cause`, `.worker_failures`)
and does not import Ray.

What it does not know: which stage failed or how to recover.
"""

from __future__ import annotations

import re


class GtiError(Exception):
    """Base class of user-facing errors; the message must name the bad key, file or row."""


class DataError(GtiError):
    """Input data cannot be used (unreadable file, missing column, nothing valid left)."""


class UnreadableFileError(DataError):
    """One input file cannot be read at all or past some point (damaged, truncated, not the
    format it claims). Unlike a column mismatch, `data.on_unreadable_file: skip` may skip it;
    `file` is the path or URI, the message starts with it."""

    def __init__(self, file: str, what: str) -> None:
        super().__init__(f"{file}: {what}")
        self.file = file
        self.what = what

    def __reduce__(self):  # picklable across Ray processes with both fields
        return (type(self), (self.file, self.what))


class ConfigError(GtiError):
    """A user mistake in a config file or override; the message is one line, ready to print."""


class GateError(GtiError):
    """A quality gate failed (e.g. SID utilisation or collisions); the message has the stats."""


class NonFiniteError(GtiError):
    """Training produced a NaN or infinite loss or gradient norm; the message names the step.
    Raised in every worker at the same step (the check is on all-reduced values), before that
    step's checkpoint, so no NaN rows are ever exported."""


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# A chained worker exception survives a Ray Data task only as traceback text, e.g.
# "gti.common.errors.DataError: x.parquet: ..." or "gti.common.errors.ConfigError: ...".
_TRACEBACK_LINE = re.compile(r"^\s*(gti(?:\.\w+)+)\.(\w+): (.+)$", re.MULTILINE)


def one_line(text: str) -> str:
    """First non-empty line of `text` without ANSI colour codes (Ray colours its proctitles)."""
    for line in _ANSI.sub("", text).splitlines():
        if line.strip():
            return line.strip()
    return ""


def user_error(err: BaseException) -> GtiError | None:
    """The GtiError that `err` carries, or None when it carries none (a bug: keep the traceback).

    Looks at `err` itself, then breadth-first at what Ray attaches: `.cause` (RayTaskError),
    `.worker_failures` (Ray Train) and `__cause__` (`raise ... from`). When the original object is
    lost (Ray Data re-raises a UDF failure as a `UserCodeException` whose cause does not survive
    pickling), the last `gti.<module>.<Name>Error: <message>` line of the traceback text is
    turned back into a `DataError` (for DataError and its subclasses) or a `GtiError`.
    """
    seen: set[int] = set()
    todo: list[BaseException] = [err]
    texts: list[str] = []
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        cause = getattr(e, "cause", None)
        # Ray's `RayTaskError(DataError)` is itself a DataError, but its str() is Ray's whole
        # traceback report: return the cause it carries, whose str() is our one line.
        if isinstance(cause, GtiError):
            return cause
        if isinstance(e, GtiError):
            return e
        texts.append(str(e))
        failures = getattr(e, "worker_failures", None)
        if isinstance(failures, dict):
            todo.extend(failures.values())
        elif isinstance(failures, (list, tuple)):
            todo.extend(failures)
        # Not __context__: a bug raised while handling a user error must keep its traceback.
        todo += [cause, e.__cause__]
    for text in texts:
        found = _TRACEBACK_LINE.findall(_ANSI.sub("", text))
        if found:
            _module, name, message = found[-1]
            cls = DataError if name in ("DataError", "UnreadableFileError") else GtiError
            return cls(message.strip())
    return None
