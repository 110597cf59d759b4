"""Streaming a parquet file a batch at a time, with memory that does not grow with the file.

What it is for: every pass over a catalog-sized parquet file (embeddings, codes, maps, items).
Arrow's `ParquetFile` pre-buffers column chunks by default, and `iter_batches` then reads ahead
of what it hands out, so one pass holds memory that grows with the file; without
pre-buffering it stays flat (bench/scale_memory/RESULTS.md, "A sid driver that does not grow").
`open_parquet` opens a file with pre-buffering off; `iter_parquet` streams its
record batches.

What it does not know: what the columns mean, Ray (Ray Data has its own readers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq


def open_parquet(path: str | Path) -> pq.ParquetFile:
    """`pq.ParquetFile` of path without pre-buffering (no read-ahead beyond the batch asked for)."""
    return pq.ParquetFile(str(path), pre_buffer=False)


def iter_parquet(path: str | Path, batch_rows: int, columns: Sequence[str] | None = None,
                 row_groups: Sequence[int] | None = None) -> Iterator[pa.RecordBatch]:
    """The file's record batches of at most `batch_rows` rows (`columns`, `row_groups`: as
    `ParquetFile.iter_batches` takes them), read as they are asked for."""
    yield from open_parquet(path).iter_batches(batch_size=batch_rows, columns=columns, row_groups=row_groups)
