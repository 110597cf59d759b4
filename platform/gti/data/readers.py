"""Per-format readers: one read task streamed as raw batches under our column names.

What it is for: mapping the configured user columns to canonical names, checking that a file has
the required ones (`DataError` naming the file and column), and reading each format into batches
of untyped Python values: parquet (one row group at a time), CSV/TSV (every column a string),
JSON lines / arrays (bad lines become `_read_error` records), Amazon-reviews metadata and the
ml-100k `u.item` / `u.data` lines. A damaged read raises `UnreadableFileError` naming the file
and, where known, the row group, data row or line.

What it does not know: which files make up a path or how they are opened (`gti.data.sources`),
which reader a task needs (`gti.data.adapters`), validation rules, Ray, or where outputs go.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.csv as pacsv

from gti.data.catalog import INVALID_UTF8, MALFORMED_RECORD, READ_ERROR
from gti.data.sources import READ_ERRORS, ReadTask, _open, _parquet_file, error_reason
from gti.common.errors import DataError, UnreadableFileError

MOVIELENS_GENRES = [
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary",
    "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi",
    "Thriller", "War", "Western",
]

RawBatch = dict[str, list[Any]]
# pyarrow reads CSV in blocks of this many bytes; one row (field) must fit in one block.
CSV_BLOCK_BYTES = 8 << 20


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


_UNITS_PER_S = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}


def _epoch_seconds(col) -> list:
    """A timestamp or date column as UTC epoch seconds (Python ints, floor): never as Python
    datetimes, whose year range (1-9999) is narrower than Arrow's, so one out-of-range value
    reaches the row check (invalid_ts if negative) instead of failing the whole batch. A
    timestamp without a time zone counts as UTC, as `gti.data.catalog.parse_ts` reads one."""
    import pyarrow.compute as pc

    t = col.type
    if pa.types.is_timestamp(t):
        raw = col.cast(pa.int64())  # the stored epoch count in the column's unit
        return [None if v is None else v // _UNITS_PER_S[t.unit] for v in raw.to_pylist()]
    if pa.types.is_date32(t):
        return [None if v is None else v * 86_400 for v in col.cast(pa.int32()).cast(pa.int64()).to_pylist()]
    # date64: milliseconds since the epoch
    return [None if v is None else v // 1000 for v in pc.cast(col, pa.int64()).to_pylist()]


def _arrow_to_lists(table: pa.Table, epoch_columns: frozenset[str] | set[str] = frozenset()) -> dict[str, list]:
    """Columns as Python lists. `epoch_columns` (the mapped ts column): timestamps and dates as
    epoch seconds (`_epoch_seconds`); any other temporal column whose values Python's datetime
    cannot hold comes through as Arrow's text for them instead of failing the batch."""
    out = {}
    for name in table.column_names:
        col = table.column(name)
        temporal = pa.types.is_timestamp(col.type) or pa.types.is_date(col.type)
        # Strings travel as bytes so that invalid UTF-8 reaches the row check instead of
        # failing the batch (pyarrow does not validate UTF-8 when check_utf8=False).
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            col = col.cast(pa.large_binary())
        elif temporal and name in epoch_columns:
            out[name] = _epoch_seconds(col)
            continue
        elif temporal:
            try:
                out[name] = col.to_pylist()
            except (ValueError, OverflowError):  # a year past 9999 (or before 1)
                out[name] = col.cast(pa.string()).to_pylist()
            continue
        out[name] = col.to_pylist()
    return out


# --------------------------------------------------------------------------- format readers
def _iter_parquet(task: ReadTask, mapping, required, section, batch_rows) -> Iterator[tuple[RawBatch, int]]:
    pf = _parquet_file(task.file, task.storage_options)
    present = pf.schema_arrow.names
    check_columns(task.file, present, mapping, required, section)
    wanted = [c for c in dict.fromkeys(mapping.values()) if c in present]
    row = task.first_row
    epoch = {mapping["ts"]} if "ts" in mapping else set()
    groups = task.row_groups if task.row_groups is not None else list(range(pf.num_row_groups))
    # One row group at a time, so that a damaged page is reported with its row group.
    for rg in groups:
        start = row
        try:
            for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[rg], columns=wanted):
                t = pa.Table.from_batches([batch])
                yield _rename(_arrow_to_lists(t, epoch), mapping, t.num_rows), row
                row += t.num_rows
        except READ_ERRORS as err:
            n = pf.metadata.row_group(rg).num_rows
            raise UnreadableFileError(
                task.file, f"row group {rg} (data rows {start}-{start + n - 1}) is damaged: {error_reason(err)}"
            ) from None


def _csv_header(task: ReadTask, delimiter: str) -> list[str]:
    import csv
    import io

    try:
        with _open(task.file, task.storage_options) as fh:
            head = fh.read(1 << 16)
    except READ_ERRORS as err:  # e.g. a gzip file whose end is cut off, read whole here
        raise UnreadableFileError(task.file, f"cannot read: {error_reason(err)}") from None
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
    read = pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES)
    parse = pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True)
    row = 0
    try:
        with _open(task.file, task.storage_options) as fh:
            reader = pacsv.open_csv(fh, read_options=read, parse_options=parse, convert_options=convert)
            for batch in reader:
                t = pa.Table.from_batches([batch])
                for off in range(0, t.num_rows, batch_rows):
                    part = t.slice(off, batch_rows)
                    yield _rename(_arrow_to_lists(part), mapping, part.num_rows), row
                    row += part.num_rows
    except pa.ArrowInvalid as err:
        if "straddl" in str(err):  # one row (a field) longer than a block: not a ragged row
            after = f" after the first {row} data rows" if row else ""
            raise UnreadableFileError(
                task.file, f"a CSV row{after} is longer than the CSV reader's block size of "
                f"{_size(CSV_BLOCK_BYTES)} (a field that long, or an unclosed quote); shorten that field, "
                "or convert the file to parquet or JSON lines") from None
        # pyarrow parses blocks of rows and does not say which row failed; find it.
        where = _ragged_row(task.file, delimiter, len(header), task.storage_options)
        # pyarrow's own "Row #N" (a line number, given only when it parses serially) would
        # contradict the data row: drop it with its redundant prefix.
        what = re.sub(r"^CSV parse error: (Row #\d+: )?", "", error_reason(err))
        raise UnreadableFileError(task.file, f"CSV parse error{where}: {what}") from None
    except READ_ERRORS as err:
        # Where in the failing block the damage starts is not known; say what was read.
        read = f" (after the first {row} data rows)" if row else ""
        raise UnreadableFileError(task.file, f"cannot read{read}: {error_reason(err)}") from None


def _size(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n / 1024:g} KiB"


def _ragged_row(path: str, delimiter: str, n_columns: int, storage_options=None) -> str:
    """' at data row R (line L)' for the first row of `path` whose field count is not
    `n_columns` (R counts data rows from 0, as `source_row` in the quarantine files; L is the
    file line where that row ends), or '' when no such row is found."""
    import csv
    import io

    try:
        with _open(path, storage_options) as fh:
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
        raise UnreadableFileError(task.file, f"cannot read after line {counter[0]}: {error_reason(err)}") from None


def _json_records_of(task: ReadTask, literal_ok: bool, counter: list[int]) -> Iterator[dict]:
    with _open(task.file, task.storage_options) as fh:
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
                raise UnreadableFileError(task.file, f"not valid JSON: {error_reason(err)}") from None
            except RecursionError:
                raise UnreadableFileError(task.file, f"not readable JSON: {_TOO_DEEP}") from None
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
            except (ValueError, RecursionError):  # a line nested too deeply: that row is malformed
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


_TOO_DEEP = "nested deeper than Python's JSON parser can follow (RecursionError)"


def _counted(lines: Iterator[bytes], counter: list[int]) -> Iterator[bytes]:
    """`lines`, counting in counter[0] the lines read whole so far."""
    for line in lines:
        counter[0] += 1
        yield line


def _chain(a, b):
    yield from a
    yield from b


def _lines(fh, chunk: int = 1 << 20) -> Iterator[bytes]:
    """The lines of a binary stream, without their newline. A block without a newline is only
    kept (joined once its line ends), so a long line (a minified JSON array) costs linear time,
    not a re-split of the growing buffer per block."""
    pending: list[bytes] = []
    while True:
        block = fh.read(chunk)
        if not block:
            break
        if b"\n" not in block:
            pending.append(block)
            continue
        head, *lines, tail = block.split(b"\n")
        pending.append(head)
        yield b"".join(pending)
        yield from lines
        pending = [tail] if tail else []
    last = b"".join(pending)
    if last:
        yield last


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
    with _open(task.file, task.storage_options) as fh:
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
