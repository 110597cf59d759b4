"""Resumable ordered output: a stage's result rows written as fixed-size chunks in its work dir.

What it is for: a stage that turns an ordered list of input rows into one output row each (the
evaluate stage decoding users) keeps every finished chunk as `<folder>/chunk-<i>.parquet`,
written atomically, so a driver killed mid-way leaves only whole chunks; on a rerun in the same
work dir (`gti.run.pipeline.run_stage`) `resume()` finds the chunks that match the expected rows
and the stage processes only the rest. Chunk i always holds input rows [i * chunk_rows, (i + 1)
* chunk_rows): a caller that batches rows in multiples dividing `chunk_rows` sees the same
batches as an uninterrupted run.

What it does not know: what the rows mean, Ray, or how they are computed. Each output chunk
must carry `key_columns` equal to the inputs' (checked on resume).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq


class ChunkedOutput:
    """Output rows of `expected` (a table of the input's key columns, in order) in chunks.

    add(table) (or append, as on a list) takes output rows in input order, any number at a
    time; the last, partial chunk is written when the last expected row arrives. Iterating gives
    the chunk tables (resumed and new) in order, len() their number, so a caller collecting
    tables in a list can use this object in its place; finish() gives them as one table.
    """

    def __init__(self, folder: Path, expected: pa.Table, chunk_rows: int,
                 on_chunk: Callable[[int], None] | None = None) -> None:
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        self.folder = Path(folder)
        self.expected = expected
        self.key_columns = expected.column_names
        self.chunk_rows = chunk_rows
        self.on_chunk = on_chunk  # called with the index of each chunk written (a test hook)
        self.chunks: list[pa.Table] = []
        self.pending: list[pa.Table] = []
        self.n_pending = 0

    def _path(self, i: int) -> Path:
        return self.folder / f"chunk-{i:06d}.parquet"

    @property
    def rows_done(self) -> int:
        return sum(t.num_rows for t in self.chunks)

    def resume(self) -> int:
        """Load the chunks of an earlier attempt that match the expected rows, contiguously from
        chunk 0; remove any others. Returns the number of input rows already done."""
        self.folder.mkdir(parents=True, exist_ok=True)
        n = self.expected.num_rows
        i = 0
        while True:
            p = self._path(i)
            start = i * self.chunk_rows
            if not p.is_file() or start >= n:
                break
            want = self.expected.slice(start, self.chunk_rows)
            try:
                got = pq.read_table(p)
            except (OSError, pa.ArrowException):
                break  # unreadable: decoded again
            if not _same_keys(got, want, self.key_columns):
                break
            self.chunks.append(got)
            i += 1
        for stale in self.folder.glob("chunk-*.parquet"):
            if int(stale.stem.split("-")[1]) >= i:
                stale.unlink()
        return self.rows_done

    def add(self, table: pa.Table) -> None:
        self.pending.append(table)
        self.n_pending += table.num_rows
        while self.n_pending >= self.chunk_rows:
            self._write(self.chunk_rows)
        if self.n_pending and self.rows_done + self.n_pending >= self.expected.num_rows:
            self._write(self.n_pending)  # the last chunk: no more rows will come

    append = add

    def __iter__(self):
        # Chunks read back from parquet may differ from new ones in schema details (string vs
        # large_string): give them all the first chunk's schema so they concatenate.
        schema = self.chunks[0].schema if self.chunks else None
        return (t if t.schema.equals(schema) else t.cast(schema) for t in self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    def _write(self, n: int) -> None:
        buf = pa.concat_tables(self.pending)
        chunk, rest = buf.slice(0, n), buf.slice(n)
        i = len(self.chunks)
        want = self.expected.slice(i * self.chunk_rows, n)
        if not _same_keys(chunk, want, self.key_columns):
            raise RuntimeError(f"{self._path(i)}: output rows are not the input rows in order")
        tmp = self._path(i).with_suffix(".tmp")
        pq.write_table(chunk, tmp)
        os.replace(tmp, self._path(i))
        self.chunks.append(chunk)
        self.pending = [rest] if rest.num_rows else []
        self.n_pending = rest.num_rows
        if self.on_chunk is not None:
            self.on_chunk(i)

    def finish(self) -> pa.Table | None:
        """Every output row in input order (None when there are none); writes a partial last
        chunk first when fewer rows came than expected."""
        if self.n_pending:
            self._write(self.n_pending)
        if not self.chunks:
            return None
        return pa.concat_tables(list(self))


def _same_keys(got: pa.Table, want: pa.Table, keys: list[str]) -> bool:
    """Same rows in the key columns, by value (string vs large_string do not matter)."""
    if got.num_rows != want.num_rows or any(k not in got.column_names for k in keys):
        return False
    return all(got.column(k).to_pylist() == want.column(k).to_pylist() for k in keys)
