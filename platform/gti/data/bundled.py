"""Data sets shipped inside the package, addressed as `bundled:<name>` in config.

What it is for: turning `data.items.path: "bundled:amazon-scientific"` (and the same for
interactions) into the absolute path of the parquet file that ships in
`gti/data/bundled/<name>/`, found through `importlib.resources`, so the product never reads
anything outside its own installation (in particular never `../shared`).

What it does not know: how the files are read or validated (that is `adapters`/`catalog`).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from gti.common.errors import DataError

PREFIX = "bundled:"
# Which file of a bundled folder answers which kind of source.
_FILES = {"items": "items.parquet", "interactions": "interactions.parquet"}


def is_bundled(path: str) -> bool:
    return path.startswith(PREFIX)


def root() -> Path:
    """Folder holding the bundled data sets (inside the installed package)."""
    return Path(str(resources.files("gti.data").joinpath("bundled")))


def available() -> list[str]:
    r = root()
    return sorted(p.name for p in r.iterdir() if p.is_dir()) if r.is_dir() else []


def resolve(path: str, kind: str) -> str:
    """`bundled:<name>` -> absolute path of its `<kind>` file; any other path is returned as is.

    kind: "items" or "interactions". Raises DataError naming the data set when it is unknown.
    """
    if not is_bundled(path):
        return path
    if kind not in _FILES:
        raise ValueError(f"kind must be one of {sorted(_FILES)}, got {kind!r}")
    name = path[len(PREFIX):].strip()
    folder = root() / name
    target = folder / _FILES[kind]
    if not name or not target.is_file():
        raise DataError(
            f"unknown bundled data set '{path}' (available: {', '.join(available()) or 'none'})"
        )
    return str(target)
