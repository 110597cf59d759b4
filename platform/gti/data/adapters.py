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

This module is the entry point: `iter_task` picks the reader of a read task and
`check_header` checks a task's columns before any work starts; where the files are and how
they are opened lives in `gti.data.sources`, the per-format readers in `gti.data.readers`
(`gti.data.amazon2023` for the Amazon Reviews 2023 layout).

What it does not know: validation rules, Ray, or where outputs go.
"""

from __future__ import annotations

from typing import Iterator

from gti.data import amazon2023
from gti.data.catalog import READ_ERROR
from gti.data.readers import (
    RawBatch,
    _amazon_record,
    _csv_header,
    _iter_csv,
    _iter_parquet,
    _json_records,
    _movielens_records,
    _records_to_batches,
    check_columns,
    interaction_mapping,
    item_mapping,
)
from gti.data.sources import ReadTask, _parquet_file
from gti.common.errors import DataError


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
        present = _parquet_file(task.file, task.storage_options).schema_arrow.names
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
