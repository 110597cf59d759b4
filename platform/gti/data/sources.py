"""Where the rows of a configured data path live, and how those files are opened.

What it is for: finding the files behind a configured path (local file, glob, directory, or any
URI pyarrow/fsspec understands; `data.<source>.storage_options` for private buckets, through
`filesystem`), telling each file's concrete format from the configured one and its extension,
cutting the files into read tasks (a large parquet file into row-group ranges), and opening a
file as a byte stream (gz/bz2/zstd decompressed) or as a parquet file. A file that cannot be
opened raises `UnreadableFileError` naming it; `READ_ERRORS` and `error_reason` are how every
reader catches and words a damaged read.

What it does not know: column names, what a row means or when it is valid (`gti.data.readers`,
`gti.data.catalog`), Ray, or where outputs go.
"""

from __future__ import annotations

import glob as globlib
import os
from dataclasses import dataclass, field
from typing import Mapping

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from gti.data import bundled
from gti.common.errors import DataError, UnreadableFileError

_EXT_FORMAT = {
    ".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "csv",
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json",
}


# --------------------------------------------------------------------------- files
def _is_uri(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _strip_file_scheme(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def _data_file(name: str) -> bool:
    base = os.path.basename(name)
    return not base.startswith((".", "_"))


def _options(storage_options: Mapping[str, str] | None) -> dict[str, str]:
    from gti.common.redact import REDACTED

    return {k: v for k, v in (storage_options or {}).items() if v != REDACTED}


def filesystem(path: str, storage_options: Mapping[str, str] | None = None) -> tuple[pafs.FileSystem, str]:
    """(file system, path inside it) for a local path or URI. With `storage_options`, a URI gets
    fsspec's file system for its scheme built with them (credentials, endpoint, ...) and wrapped
    for pyarrow; without, pyarrow's own file system for the URI. The options (e.g. {key, secret}
    for s3://, {account_name, account_key} for abfs://) come from `data.<source>.storage_options`
    and travel inside `ReadTask.storage_options` to the read tasks; values shown as
    `***redacted***` (a config read back from a run folder) are dropped. Local paths ignore them."""
    if not _is_uri(path):
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(_strip_file_scheme(path)))
    opts = _options(storage_options)
    if not opts:
        return pafs.FileSystem.from_uri(path)
    import fsspec

    fs = fsspec.filesystem(path.split("://", 1)[0], **opts)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), fs._strip_protocol(path)


def expand_paths(path: str, kind: str, storage_options: Mapping[str, str] | None = None) -> list[str]:
    """Configured path -> sorted list of files (local paths or URIs). DataError if none.
    `storage_options`: the source's file-system options for a URI (see `filesystem`)."""
    path = bundled.resolve(path, kind)
    if _is_uri(path):
        from gti.common.redact import redact_text

        try:
            files = _expand_uri(path, storage_options)
        except (*READ_ERRORS, ValueError, ImportError, TypeError) as err:  # unknown scheme, no access, ...
            raise DataError(redact_text(f"data.{kind}.path: cannot list {path}: {error_reason(err)}")) from None
        if not files:
            raise DataError(f"data.{kind}.path: no data files match {redact_text(path)}")
        return files
    path = os.path.expanduser(_strip_file_scheme(path))
    if any(ch in path for ch in "*?["):
        files = sorted(f for f in globlib.glob(path, recursive=True) if os.path.isfile(f))
    elif os.path.isdir(path):
        files = sorted(
            os.path.join(root, f)
            for root, dirs, names in os.walk(path)
            for f in names
            if _data_file(f) and not any(d.startswith((".", "_")) for d in os.path.relpath(root, path).split(os.sep) if d != ".")
        )
    elif os.path.isfile(path):
        files = [path]
    else:
        raise DataError(f"data.{kind}.path: no such file or directory: {path}")
    if not files:
        raise DataError(f"data.{kind}.path: no data files match {path}")
    return files


def _expand_uri(uri: str, storage_options: Mapping[str, str] | None = None) -> list[str]:
    scheme = uri.split("://", 1)[0]
    if any(ch in uri for ch in "*?["):
        import fsspec

        fs = fsspec.filesystem(scheme, **_options(storage_options))
        return sorted(f"{scheme}://{p}" if "://" not in p else p for p in fs.glob(uri))
    fs, p = filesystem(uri, storage_options)
    info = fs.get_file_info(p)
    if info.type == pafs.FileType.NotFound:
        from gti.common.redact import redact_text

        raise DataError(f"no such file or directory: {redact_text(uri)}")
    if info.type == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(p, recursive=True))
        return sorted(
            f"{scheme}://{i.path}" for i in infos if i.type == pafs.FileType.File and _data_file(i.path)
        )
    return [uri]


def _open(path: str, storage_options: Mapping[str, str] | None = None):
    """Binary input stream for a local path or URI; gz/bz2/zstd decompressed by extension."""
    try:
        if _is_uri(path):
            fs, p = filesystem(path, storage_options)
        else:
            fs, p = pafs.LocalFileSystem(), os.path.abspath(path)
        return fs.open_input_stream(p, compression="detect")
    except (OSError, pa.ArrowException) as err:
        raise UnreadableFileError(path, f"cannot open: {error_reason(err)}") from None


def _parquet_file(path: str, storage_options: Mapping[str, str] | None = None) -> pq.ParquetFile:
    try:
        if _is_uri(path):
            fs, p = filesystem(path, storage_options)
            return pq.ParquetFile(fs.open_input_file(p))
        return pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as err:
        raise UnreadableFileError(path, f"not a readable parquet file: {error_reason(err)}") from None


# What reading a damaged or truncated file raises (pyarrow: OSError / ArrowInvalid; EOFError
# from Python's own decompressors behind fsspec).
READ_ERRORS = (OSError, EOFError, pa.ArrowException)


def error_reason(err: BaseException) -> str:
    """The first non-empty line of a reader's error (pyarrow's run over several lines), with
    control characters escaped: a damaged page's error can quote the garbage bytes it met."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    text = lines[0] if lines else type(err).__name__
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def detect_format(path: str, fmt: str) -> str:
    """Concrete reader for one file: parquet, csv, tsv, jsonl, json, amazon, movielens."""
    base = os.path.basename(path).lower()
    for ext in (".gz", ".bz2", ".zst"):
        base = base.removesuffix(ext)
    if fmt == "movielens" or (fmt == "auto" and base in ("u.item", "u.data")):
        return "movielens"
    if fmt in ("amazon", "amazon2023"):
        return fmt
    if fmt == "csv" and base.endswith(".tsv"):
        return "tsv"
    if fmt != "auto":
        return fmt
    ext = os.path.splitext(base)[1]
    if ext not in _EXT_FORMAT:
        raise DataError(f"{path}: cannot tell the format from the extension; set data.<source>.format")
    return "tsv" if ext == ".tsv" else _EXT_FORMAT[ext]


# --------------------------------------------------------------------------- tasks
@dataclass
class ReadTask:
    """One unit of parallel reading: a file, or a range of a parquet file's row groups."""

    file: str
    fmt: str
    row_groups: list[int] | None = None
    first_row: int = 0
    rows: int | None = None  # known for parquet
    # data.<source>.storage_options for a URI (credentials: never logged or written; see
    # the module docstring)
    storage_options: dict[str, str] = field(default_factory=dict, repr=False)


def plan_tasks(files: list[str], fmt: str, rows_per_task: int = 200_000,
               storage_options: Mapping[str, str] | None = None) -> list[ReadTask]:
    """Cut files into read tasks, in file order. Parquet files with many row groups are split
    so a single large file still reads in parallel; other formats are one task per file."""
    tasks: list[ReadTask] = []
    opts = dict(storage_options or {})
    for f in files:
        concrete = detect_format(f, fmt)
        if concrete != "parquet":
            tasks.append(ReadTask(f, concrete, storage_options=opts))
            continue
        md = _parquet_file(f, opts).metadata
        groups, rows, first = [], 0, 0
        for rg in range(md.num_row_groups):
            groups.append(rg)
            rows += md.row_group(rg).num_rows
            if rows >= rows_per_task:
                tasks.append(ReadTask(f, "parquet", groups, first, rows, storage_options=opts))
                first += rows
                groups, rows = [], 0
        if groups or md.num_row_groups == 0:
            tasks.append(ReadTask(f, "parquet", groups, first, rows, storage_options=opts))
    return tasks
