"""gti/common/parquet_stream.py: the same batches as Arrow's iter_batches, from a file opened without
pre-buffering (Arrow's read-ahead made one pass over a 10M-row file hold 2.2 GB)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from gti.common import parquet_stream
from gti.common.parquet_stream import iter_parquet, open_parquet


def _file(tmp_path):
    t = pa.table({"a": list(range(1000)), "b": [str(i) for i in range(1000)]})
    path = tmp_path / "t.parquet"
    pq.write_table(t, path, row_group_size=300)
    return path, t


def test_batches_equal_iter_batches(tmp_path):
    path, t = _file(tmp_path)
    got = list(iter_parquet(path, 128, columns=["b"]))
    want = list(pq.ParquetFile(path).iter_batches(batch_size=128, columns=["b"]))
    assert [b.num_rows for b in got] == [b.num_rows for b in want] and max(b.num_rows for b in got) <= 128
    assert pa.Table.from_batches(got).equals(t.select(["b"]))
    only = pa.Table.from_batches(list(iter_parquet(path, 1000, row_groups=[1])))
    assert only.equals(t.slice(300, 300))


def test_files_are_opened_without_pre_buffering(tmp_path, monkeypatch):
    path, _ = _file(tmp_path)
    seen = []
    real = pq.ParquetFile

    def spy(*args, **kwargs):
        seen.append(kwargs.get("pre_buffer"))
        return real(*args, **kwargs)

    monkeypatch.setattr(parquet_stream.pq, "ParquetFile", spy)
    open_parquet(path)
    list(iter_parquet(path, 100))
    assert seen == [False, False]
