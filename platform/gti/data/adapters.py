"""Readers that turn user files into raw batches with our column names.

What it is for: finding the files behind a configured path (local file, glob, directory, or any
URI pyarrow/fsspec understands), cutting them into read tasks, and streaming each task as
batches of Python values under canonical names (`item_id, title, description, category`,
attribute columns; or `user_id, item_id, ts`). Formats: parquet, CSV/TSV, JSONL/JSON, plus two
public layouts people already have:
- `amazon`: Amazon-reviews item metadata (JSON lines, or the 2014 Python-literal lines) with
  `asin`, `title`, `description` (string or list of strings), `categories` (nested lists; the
  first path is used, joined with " > ") or `category` (a list), `brand`.
- `amazon2023`: the Amazon Reviews 2023 metadata / reviews JSON lines (`parent_asin`, list-valued
  `description` and `features`, `categories`, `details`); see `gti.data.amazon2023`.
- `movielens`: ml-100k `u.item` (pipe-separated, latin-1, 19 genre flags -> category) and
  `u.data` (tab-separated user, item, rating, timestamp). The normalised CSV form
  (items.csv / interactions.csv) is plain `csv`.

Values are handed over untyped on purpose: strings from CSV and JSON stay strings, invalid
UTF-8 stays bytes, numbers stay numbers, so that `gti.data.catalog` decides what is valid and
why. A reader-level problem with one row (a JSON line that does not parse, a line that is not
UTF-8) comes through as that row's `_read_error`, to be quarantined; a problem with a whole file
(missing required column, unreadable file) raises `DataError` naming the file and column.
A file that cannot be read, or not past some point (damaged page, truncated compressed
stream, ragged CSV row), raises `UnreadableFileError`: one line naming the file and, where it is
known, the row group, data row or line; every read of every format and path (local, URI, driver
header checks, read tasks) goes through that.

What it does not know: validation rules, Ray, or where outputs go.
"""

from __future__ import annotations

import ast
import glob as globlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from gti.data import bundled
from gti.data.catalog import INVALID_UTF8, MALFORMED_RECORD, READ_ERROR
from gti.errors import DataError, UnreadableFileError

_EXT_FORMAT = {
    ".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "csv",
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json",
}
MOVIELENS_GENRES = [
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary",
    "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi",
    "Thriller", "War", "Western",
]

RawBatch = dict[str, list[Any]]


# --------------------------------------------------------------------------- files
def _is_uri(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _strip_file_scheme(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def _data_file(name: str) -> bool:
    base = os.path.basename(name)
    return not base.startswith((".", "_"))


def expand_paths(path: str, kind: str) -> list[str]:
    """Configured path -> sorted list of files (local paths or URIs). DataError if none."""
    path = bundled.resolve(path, kind)
    if _is_uri(path):
        try:
            files = _expand_uri(path)
        except (*READ_ERRORS, ValueError, ImportError) as err:  # unknown scheme, no access, ...
            raise DataError(f"data.{kind}.path: cannot list {path}: {_reason(err)}") from None
        if not files:
            raise DataError(f"data.{kind}.path: no data files match {path}")
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


def _expand_uri(uri: str) -> list[str]:
    scheme = uri.split("://", 1)[0]
    if any(ch in uri for ch in "*?["):
        import fsspec

        fs = fsspec.filesystem(scheme)
        return sorted(f"{scheme}://{p}" if "://" not in p else p for p in fs.glob(uri))
    fs, p = pafs.FileSystem.from_uri(uri)
    info = fs.get_file_info(p)
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"no such file or directory: {uri}")
    if info.type == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(p, recursive=True))
        return sorted(
            f"{scheme}://{i.path}" for i in infos if i.type == pafs.FileType.File and _data_file(i.path)
        )
    return [uri]


def _open(path: str):
    """Binary input stream for a local path or URI; gz/bz2/zstd decompressed by extension."""
    if _is_uri(path):
        fs, p = pafs.FileSystem.from_uri(path)
    else:
        fs, p = pafs.LocalFileSystem(), os.path.abspath(path)
    try:
        return fs.open_input_stream(p, compression="detect")
    except (OSError, pa.ArrowException) as err:
        raise UnreadableFileError(path, f"cannot open: {_reason(err)}") from None


def _parquet_file(path: str) -> pq.ParquetFile:
    try:
        if _is_uri(path):
            fs, p = pafs.FileSystem.from_uri(path)
            return pq.ParquetFile(fs.open_input_file(p))
        return pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as err:
        raise UnreadableFileError(path, f"not a readable parquet file: {_reason(err)}") from None


# What reading a damaged or truncated file raises (pyarrow: OSError / ArrowInvalid; EOFError
# from Python's own decompressors behind fsspec).
READ_ERRORS = (OSError, EOFError, pa.ArrowException)


def _reason(err: BaseException) -> str:
    """The first non-empty line of a reader's error (pyarrow's run over several lines), with
    control characters escaped: a damaged page's error can quote the garbage bytes it met."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    text = lines[0] if lines else type(err).__name__
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


error_reason = _reason  # the public name, for callers outside this module (gti.data.sources, ingest)


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


def plan_tasks(files: list[str], fmt: str, rows_per_task: int = 200_000) -> list[ReadTask]:
    """Cut files into read tasks, in file order. Parquet files with many row groups are split
    so a single large file still reads in parallel; other formats are one task per file."""
    tasks: list[ReadTask] = []
    for f in files:
        concrete = detect_format(f, fmt)
        if concrete != "parquet":
            tasks.append(ReadTask(f, concrete))
            continue
        md = _parquet_file(f).metadata
        groups, rows, first = [], 0, 0
        for rg in range(md.num_row_groups):
            groups.append(rg)
            rows += md.row_group(rg).num_rows
            if rows >= rows_per_task:
                tasks.append(ReadTask(f, "parquet", groups, first, rows))
                first += rows
                groups, rows = [], 0
        if groups or md.num_row_groups == 0:
            tasks.append(ReadTask(f, "parquet", groups, first, rows))
    return tasks


# --------------------------------------------------------------------------- column mapping
def item_mapping(columns) -> dict[str, str]:
    """canonical name -> user column, from gti.config.ItemColumns (None entries dropped)."""
    m = {"item_id": columns.id, "title": columns.title, "description": columns.description,
         "category": columns.category}
    m = {k: v for k, v in m.items() if v}
    for a in columns.attributes:
        m[a] = a
    return m


def interaction_mapping(columns) -> dict[str, str]:
    m = {"user_id": columns.user, "item_id": columns.item}
    if columns.ts:
        m["ts"] = columns.ts
    return m


def check_columns(path: str, present: list[str], mapping: dict[str, str], required: list[str],
                  section: str) -> list[str]:
    """DataError naming the file and column when a required column is absent.
    Returns the optional mapped columns that are absent (reported, not fatal)."""
    have = set(present)
    for canon in required:
        col = mapping[canon]
        if col not in have:
            raise DataError(
                f"{path}: missing column '{col}' (data.{section}.columns; the file has: "
                f"{', '.join(present[:12]) or 'no columns'})"
            )
    return [mapping[c] for c in mapping if c not in required and mapping[c] not in have]


def _rename(cols: dict[str, list], mapping: dict[str, str], n: int) -> RawBatch:
    out: RawBatch = {canon: cols.get(user, [None] * n) for canon, user in mapping.items()}
    if READ_ERROR in cols:
        out[READ_ERROR] = cols[READ_ERROR]
    return out


def _arrow_to_lists(table: pa.Table) -> dict[str, list]:
    out = {}
    for name in table.column_names:
        col = table.column(name)
        # Strings travel as bytes so that invalid UTF-8 reaches the row check instead of
        # failing the batch (pyarrow does not validate UTF-8 when check_utf8=False).
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            col = col.cast(pa.large_binary())
        out[name] = col.to_pylist()
    return out


# --------------------------------------------------------------------------- format readers
def _iter_parquet(task: ReadTask, mapping, required, section, batch_rows) -> Iterator[tuple[RawBatch, int]]:
    pf = _parquet_file(task.file)
    present = pf.schema_arrow.names
    check_columns(task.file, present, mapping, required, section)
    wanted = [c for c in dict.fromkeys(mapping.values()) if c in present]
    row = task.first_row
    groups = task.row_groups if task.row_groups is not None else list(range(pf.num_row_groups))
    # One row group at a time, so that a damaged page is reported with its row group.
    for rg in groups:
        start = row
        try:
            for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[rg], columns=wanted):
                t = pa.Table.from_batches([batch])
                yield _rename(_arrow_to_lists(t), mapping, t.num_rows), row
                row += t.num_rows
        except READ_ERRORS as err:
            n = pf.metadata.row_group(rg).num_rows
            raise UnreadableFileError(
                task.file, f"row group {rg} (data rows {start}-{start + n - 1}) is damaged: {_reason(err)}"
            ) from None


def _csv_header(task: ReadTask, delimiter: str) -> list[str]:
    import csv
    import io

    try:
        with _open(task.file) as fh:
            head = fh.read(1 << 16)
    except READ_ERRORS as err:  # e.g. a gzip file whose end is cut off, read whole here
        raise UnreadableFileError(task.file, f"cannot read: {_reason(err)}") from None
    if not head.strip():
        raise UnreadableFileError(task.file, "empty file (no header row)")
    first = head.split(b"\n", 1)[0].decode("utf-8", errors="replace").lstrip("\ufeff")
    return next(csv.reader(io.StringIO(first), delimiter=delimiter))


def _iter_csv(task: ReadTask, mapping, required, section, batch_rows, delimiter=",") -> Iterator[tuple[RawBatch, int]]:
    header = _csv_header(task, delimiter)
    check_columns(task.file, header, mapping, required, section)
    # Every column as a string: "007" stays "007" and "12.0" reaches the id check as written.
    convert = pacsv.ConvertOptions(
        column_types={c: pa.string() for c in header}, check_utf8=False,
        include_columns=[c for c in dict.fromkeys(mapping.values()) if c in header],
        strings_can_be_null=True,
    )
    read = pacsv.ReadOptions(block_size=8 << 20)
    parse = pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True)
    row = 0
    try:
        with _open(task.file) as fh:
            reader = pacsv.open_csv(fh, read_options=read, parse_options=parse, convert_options=convert)
            for batch in reader:
                t = pa.Table.from_batches([batch])
                for off in range(0, t.num_rows, batch_rows):
                    part = t.slice(off, batch_rows)
                    yield _rename(_arrow_to_lists(part), mapping, part.num_rows), row
                    row += part.num_rows
    except pa.ArrowInvalid as err:
        # pyarrow parses blocks of rows and does not say which row failed; find it.
        where = _ragged_row(task.file, delimiter, len(header))
        # pyarrow's own "Row #N" (a line number, given only when it parses serially) would
        # contradict the data row: drop it with its redundant prefix.
        what = re.sub(r"^CSV parse error: (Row #\d+: )?", "", _reason(err))
        raise UnreadableFileError(task.file, f"CSV parse error{where}: {what}") from None
    except READ_ERRORS as err:
        # Where in the failing block the damage starts is not known; say what was read.
        read = f" (after the first {row} data rows)" if row else ""
        raise UnreadableFileError(task.file, f"cannot read{read}: {_reason(err)}") from None


def _ragged_row(path: str, delimiter: str, n_columns: int) -> str:
    """' at data row R (line L)' for the first row of `path` whose field count is not
    `n_columns` (R counts data rows from 0, as `source_row` in the quarantine files; L is the
    file line where that row ends), or '' when no such row is found."""
    import csv
    import io

    try:
        with _open(path) as fh:
            text = io.TextIOWrapper(fh, encoding="utf-8", errors="replace", newline="")
            reader = csv.reader(text, delimiter=delimiter)
            next(reader, None)  # the header
            for r, fields in enumerate(reader):
                if fields and len(fields) != n_columns:
                    return f" at data row {r} (line {reader.line_num})"
    except (csv.Error, *READ_ERRORS):
        pass
    return ""


def _json_records(task: ReadTask, literal_ok: bool = False) -> Iterator[dict]:
    """Records of a JSON-lines file (or a JSON array file); bad lines become error records.
    A file that cannot be read past some line raises UnreadableFileError naming that line."""
    counter = [0]
    try:
        yield from _json_records_of(task, literal_ok, counter)
    except READ_ERRORS as err:
        raise UnreadableFileError(task.file, f"cannot read after line {counter[0]}: {_reason(err)}") from None


def _json_records_of(task: ReadTask, literal_ok: bool, counter: list[int]) -> Iterator[dict]:
    with _open(task.file) as fh:
        data_iter = _counted(_lines(fh), counter)
        first = None
        for first in data_iter:
            if first.strip():
                break
        if first is None or not first.strip():
            return
        if first.lstrip().startswith(b"["):
            # A JSON array file: read whole (use JSON lines for large catalogs).
            rest = b"\n".join(_chain([first], data_iter))
            try:
                arr = json.loads(rest)
            except (ValueError, UnicodeDecodeError) as err:
                raise UnreadableFileError(task.file, f"not valid JSON: {_reason(err)}") from None
            for rec in arr:
                yield rec if isinstance(rec, dict) else {READ_ERROR: MALFORMED_RECORD, "_raw": repr(rec)}
            return
        for line in _chain([first], data_iter):
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                yield {READ_ERROR: INVALID_UTF8, "_raw": line}
                continue
            try:
                rec = json.loads(text)
            except ValueError:
                rec = None
                if literal_ok:
                    try:
                        rec = ast.literal_eval(text)  # Amazon 2014 metadata lines are Python literals
                    except (ValueError, SyntaxError, MemoryError, RecursionError):
                        rec = None
            if not isinstance(rec, dict):
                yield {READ_ERROR: MALFORMED_RECORD, "_raw": text}
                continue
            yield rec


def _counted(lines: Iterator[bytes], counter: list[int]) -> Iterator[bytes]:
    """`lines`, counting in counter[0] the lines read whole so far."""
    for line in lines:
        counter[0] += 1
        yield line


def _chain(a, b):
    yield from a
    yield from b


def _lines(fh, chunk: int = 1 << 20) -> Iterator[bytes]:
    buf = b""
    while True:
        block = fh.read(chunk)
        if not block:
            break
        buf += block
        *lines, buf = buf.split(b"\n")
        yield from lines
    if buf:
        yield buf


def _records_to_batches(task, records, mapping, required, section, batch_rows, convert=None):
    rows: list[dict] = []
    row = 0
    checked = False
    for rec in records:
        if convert is not None and READ_ERROR not in rec:
            rec = convert(rec)
        rows.append(rec)
        if len(rows) >= batch_rows:
            if not checked:
                _check_json_columns(task.file, rows, mapping, required, section)
                checked = True
            yield _rows_to_batch(rows, mapping), row
            row += len(rows)
            rows = []
    if rows:
        if not checked:
            _check_json_columns(task.file, rows, mapping, required, section)
        yield _rows_to_batch(rows, mapping), row


def _check_json_columns(path, rows, mapping, required, section):
    keys: set[str] = set()
    for r in rows:
        if READ_ERROR not in r:
            keys.update(r)
    if keys:  # only error records: they are quarantined row by row
        check_columns(path, sorted(keys), mapping, required, section)


def _rows_to_batch(rows: list[dict], mapping: dict[str, str]) -> RawBatch:
    out: RawBatch = {canon: [r.get(user) for r in rows] for canon, user in mapping.items()}
    errs = [r.get(READ_ERROR) for r in rows]
    if any(errs):
        out[READ_ERROR] = errs
        raw = [r.get("_raw") for r in rows]
        # Keep the undecodable line visible in the quarantine file.
        first = next(iter(mapping))
        out[first] = [raw[i] if errs[i] else v for i, v in enumerate(out[first])]
    return out


def _amazon_record(rec: dict) -> dict:
    def flat(v):
        if isinstance(v, list):
            parts = []
            for x in v:
                parts.extend(flat(x) if isinstance(x, list) else [x])
            return parts
        return [v]

    out = dict(rec)
    out["item_id"] = rec.get("asin")
    desc = rec.get("description")
    if isinstance(desc, list):
        desc = " ".join(x for x in flat(desc) if isinstance(x, str)) or None
    out["description"] = desc
    cats = rec.get("categories", rec.get("category"))
    if isinstance(cats, list):
        first = cats[0] if cats and isinstance(cats[0], list) else cats
        cats = " > ".join(x for x in flat(first) if isinstance(x, str)) or None
    out["category"] = cats
    return out


def _movielens_records(task: ReadTask, kind: str) -> Iterator[dict]:
    with _open(task.file) as fh:
        for raw in _lines(fh):
            # ml-100k ships latin-1 text; decode accordingly instead of quarantining it.
            line = raw.decode("latin-1").rstrip("\r")
            if not line.strip():
                continue
            if kind == "items":
                parts = line.split("|")
                if len(parts) < 5 + len(MOVIELENS_GENRES):
                    yield {READ_ERROR: MALFORMED_RECORD, "_raw": line}
                    continue
                flags = parts[5 : 5 + len(MOVIELENS_GENRES)]
                genres = [g for g, f in zip(MOVIELENS_GENRES, flags) if f.strip() == "1"]
                yield {"item_id": parts[0], "title": parts[1], "description": None,
                       "category": " ".join(genres) or None, "release_date": parts[2] or None}
            else:
                parts = line.split("\t")
                if len(parts) < 4:
                    yield {READ_ERROR: MALFORMED_RECORD, "_raw": line}
                    continue
                yield {"user_id": parts[0], "item_id": parts[1], "rating": parts[2], "ts": parts[3]}


def iter_task(task: ReadTask, kind: str, columns, batch_rows: int = 8192) -> Iterator[tuple[RawBatch, int]]:
    """Stream one read task as (raw batch with canonical names, file row of its first row).

    kind: "items" (columns: gti.config.ItemColumns) or "interactions" (InteractionColumns).
    """
    if kind == "items":
        mapping = item_mapping(columns)
        required = ["item_id"]
    else:
        mapping = interaction_mapping(columns)
        required = list(mapping)
    section = kind
    if task.fmt == "parquet":
        yield from _iter_parquet(task, mapping, required, section, batch_rows)
    elif task.fmt in ("csv", "tsv"):
        yield from _iter_csv(task, mapping, required, section, batch_rows, "," if task.fmt == "csv" else "\t")
    elif task.fmt in ("jsonl", "json"):
        yield from _records_to_batches(task, _json_records(task), mapping, required, section, batch_rows)
    elif task.fmt == "amazon":
        if kind != "items":
            raise DataError(f"{task.file}: format 'amazon' is for item metadata; use csv/jsonl/parquet for interactions")
        amap = {"item_id": "item_id", "title": "title", "description": "description", "category": "category"}
        amap.update({a: a for a in columns.attributes})
        yield from _records_to_batches(task, _json_records(task, literal_ok=True), amap, ["item_id"],
                                       section, batch_rows, convert=_amazon_record)
    elif task.fmt == "amazon2023":
        from gti.data import amazon2023

        yield from amazon2023.iter_task(task, kind, columns, batch_rows)
    elif task.fmt == "movielens":
        if kind == "items":
            mmap = {"item_id": "item_id", "title": "title", "description": "description",
                    "category": "category"}
            mmap.update({a: a for a in columns.attributes})
        else:
            mmap = {"user_id": "user_id", "item_id": "item_id", "ts": "ts"}
        yield from _records_to_batches(task, _movielens_records(task, kind), mmap, ["item_id"],
                                       section, batch_rows)
    else:
        raise DataError(f"{task.file}: unknown format '{task.fmt}'")


def check_header(task: ReadTask, kind: str, columns) -> list[str]:
    """Check one read task's header against the column mapping before any work starts: the
    schema of a parquet file, the header row of a CSV/TSV file, the keys of the first records of
    a JSON-lines file (the first 100 lines). Raises DataError naming the file and the missing
    required column, UnreadableFileError when the header cannot be read; returns the mapped
    optional columns the file lacks. Other formats (JSON arrays, amazon, movielens: fixed or
    whole-file layouts) are checked while they are read."""
    mapping = item_mapping(columns) if kind == "items" else interaction_mapping(columns)
    required = ["item_id"] if kind == "items" else list(mapping)
    if task.fmt == "parquet":
        present = _parquet_file(task.file).schema_arrow.names
    elif task.fmt in ("csv", "tsv"):
        present = _csv_header(task, "," if task.fmt == "csv" else "\t")
    elif task.fmt == "jsonl":
        keys: set[str] = set()
        for i, rec in enumerate(_json_records(task)):
            if READ_ERROR not in rec:
                keys.update(rec)
            if i >= 99:
                break
        if not keys:  # empty, or only unparseable lines: quarantined row by row when read
            return []
        present = sorted(keys)
    else:
        return []
    return check_columns(task.file, list(present), mapping, required, kind)
