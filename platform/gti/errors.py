"""User-facing errors.

Anything derived from `GtiError` is a mistake the user can fix (a bad key, file, row or
argument). The CLI prints its message as one line and exits non-zero, without a traceback.
Everything else is a bug and keeps its traceback.
"""


class GtiError(Exception):
    """Base class of user-facing errors; the message must name the bad key, file or row."""


class DataError(GtiError):
    """Input data cannot be used (unreadable file, missing column, nothing valid left)."""


class GateError(GtiError):
    """A quality gate failed (e.g. SID utilisation or collisions); the message has the stats."""
