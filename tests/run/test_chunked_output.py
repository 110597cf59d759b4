"""gti.run.chunked_output.ChunkedOutput: ordered output rows in atomic chunks, resumed after an
interrupted attempt from the chunks that match the expected rows."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gti.run.chunked_output import ChunkedOutput

N = 23


def _expected() -> pa.Table:
    return pa.table({"user_id": [f"u{i}" for i in range(N)], "split": ["valid"] * N})


def _out(start: int, stop: int) -> pa.Table:
    """Output rows [start, stop): the key columns plus a value computed from the row."""
    return pa.table({"user_id": pa.array([f"u{i}" for i in range(start, stop)], pa.large_string()),
                     "split": ["valid"] * (stop - start), "value": [i * i for i in range(start, stop)]})


def _feed(c: ChunkedOutput, start: int, sizes: list[int]) -> None:
    for n in sizes:
        stop = min(start + n, N)
        c.add(_out(start, stop))
        start = stop


def test_chunks_are_fixed_size_files_and_finish_returns_all_rows(tmp_path):
    written = []
    c = ChunkedOutput(tmp_path / "d", _expected(), 5, on_chunk=written.append)
    assert c.resume() == 0
    _feed(c, 0, [3, 9, 1, 6])  # block sizes unrelated to the chunk size
    assert written == [0, 1, 2]
    _feed(c, 19, [4])
    assert written == [0, 1, 2, 3, 4]  # the last, partial chunk once the last row is in
    table = c.finish()
    assert written == [0, 1, 2, 3, 4]
    assert table.column("value").to_pylist() == [i * i for i in range(N)]
    files = sorted((tmp_path / "d").glob("chunk-*.parquet"))
    assert [pq.read_metadata(f).num_rows for f in files] == [5, 5, 5, 5, 3]
    assert not list((tmp_path / "d").glob("*.tmp"))


def test_resume_skips_the_whole_chunks_of_an_interrupted_attempt(tmp_path):
    class Stop(Exception):
        pass

    def stop_after_two(i):
        if i == 1:
            raise Stop

    c = ChunkedOutput(tmp_path / "d", _expected(), 5, on_chunk=stop_after_two)
    c.resume()
    with pytest.raises(Stop):
        _feed(c, 0, [4, 4, 4, 4])  # 12 rows in: chunks 0 and 1 written, then "killed"
    written = []
    again = ChunkedOutput(tmp_path / "d", _expected(), 5, on_chunk=written.append)
    done = again.resume()
    assert done == 10  # a chunk boundary: rows 10.. are computed again
    _feed(again, done, [6, 7])
    table = again.finish()
    assert written == [2, 3, 4]
    assert table.column("user_id").to_pylist() == [f"u{i}" for i in range(N)]
    assert table.column("value").to_pylist() == [i * i for i in range(N)]


def test_resume_drops_chunks_that_do_not_match_and_all_after_them(tmp_path):
    c = ChunkedOutput(tmp_path / "d", _expected(), 5)
    c.resume()
    _feed(c, 0, [N])
    c.finish()
    # Chunk 1 from other input rows (e.g. a hand-edited folder): it and every later chunk go.
    pq.write_table(_out(10, 15), tmp_path / "d" / "chunk-000001.parquet")
    (tmp_path / "d" / "chunk-000003.parquet").write_bytes(b"not parquet")
    again = ChunkedOutput(tmp_path / "d", _expected(), 5)
    assert again.resume() == 5
    assert sorted(p.name for p in (tmp_path / "d").glob("chunk-*")) == ["chunk-000000.parquet"]


def test_rows_out_of_order_are_refused(tmp_path):
    c = ChunkedOutput(tmp_path / "d", _expected(), 5)
    c.resume()
    with pytest.raises(RuntimeError, match="not the input rows in order"):
        c.add(_out(1, 7))


def test_list_like_use_in_place_of_a_list_of_tables(tmp_path):
    """The evaluate stage collects tables with parts.append and concatenates `parts`."""
    c = ChunkedOutput(tmp_path / "d", _expected(), 5)
    c.resume()
    assert not c and len(c) == 0
    for start in range(0, N, 4):
        c.append(_out(start, min(start + 4, N)))
    assert len(c) == 5
    # A resumed object mixes chunks read back from parquet with new ones; they concatenate.
    again = ChunkedOutput(tmp_path / "d", _expected(), 5)
    assert again.resume() == N
    table = pa.concat_tables(again)
    assert table.column("value").to_pylist() == [i * i for i in range(N)]
