"""Readers that turn user files into raw batches with our column names.

What it is for: the entry point of reading. `iter_task` streams a read task (a file, or a range
of a parquet file's row groups) as batches of Python values under canonical names (`item_id,
title, description, category`, attributes; or `user_id, item_id, ts`) from parquet, CSV/TSV,
JSONL/JSON or a public layout (`amazon`, `amazon2023`, `movielens`: docs/data.md);
`check_header` checks a task's columns before any work starts. Values are handed over untyped on
purpose, so that `gti.data.catalog` decides what is valid and why. Where files are and how they
are opened: `gti.data.sources`; the per-format readers: `gti.data.readers`.

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
    A bad row comes through as that row's `_read_error`, a bad file raises `DataError`, an
    unreadable one `UnreadableFileError` naming the file and, where known, the row.
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
