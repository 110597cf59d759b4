"""Issue 30, item 6: a bad value quarantines its row, not its whole file, and what cannot be
read is one line naming the file (and the limit it hit).

- an out-of-range integer timestamp (past int64, in JSON lines, CSV, a uint64 parquet column,
  or a timestamp column outside Python's years 1-9999) is `invalid_ts` for that row; the file's good
  rows are kept, also under `data.on_unreadable_file: skip`;
- deeply nested JSON (RecursionError): one JSON-lines row quarantined, or one line naming a JSON
  array file;
- a CSV field longer than the reader's block size: one line naming the file and the size.
Runs the ingest stage body in process (tests/data/conftest.py), no Ray."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gti.config import InteractionColumns
from gti.data import readers
from gti.data.sources import plan_tasks
from gti.data import catalog as cat
from gti.data.batches import local_stream, raise_file_error
from gti.common.errors import UnreadableFileError

ITEMS = "item_id,title\n1,Beaker\n2,Flask\n3,Pipette\n"
HUGE = 99999999999999999999  # > 2**63 - 1


def _write(tmp_path, name, content):
    p = tmp_path / name
    if isinstance(content, pa.Table):
        pq.write_table(content, p)
    else:
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return p


def _interactions(tmp_path, fmt: str):
    """Four good rows of user u (items 1,2,3,1) and one with an out-of-range ts in between."""
    users, items, ts = ["u"] * 5, ["1", "2", "9", "3", "1"], [1, 2, HUGE, 3, 4]
    if fmt == "jsonl":
        lines = [f'{{"user_id": "{u}", "item_id": "{i}", "ts": {t}}}' for u, i, t in zip(users, items, ts)]
        return _write(tmp_path, "inter.jsonl", "\n".join(lines) + "\n")
    if fmt == "csv":
        return _write(tmp_path, "inter.csv", "user_id,item_id,ts\n" + "".join(
            f"{u},{i},{t}\n" for u, i, t in zip(users, items, ts)))
    if fmt == "parquet_uint64":
        return _write(tmp_path, "inter.parquet", pa.table({
            "user_id": users, "item_id": items, "ts": pa.array([1, 2, 2**64 - 1, 3, 4], pa.uint64())}))
    # a timestamp[s] column with a value before year 1 (Python's datetime cannot hold it)
    return _write(tmp_path, "inter.parquet", pa.table({
        "user_id": users, "item_id": items,
        "ts": pa.array([1, 2, -10**13, 3, 4], pa.timestamp("s"))}))


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet_uint64", "parquet_timestamp"])
@pytest.mark.parametrize("mode", ["error", "skip"])
def test_an_out_of_range_timestamp_quarantines_its_row_not_the_file(tmp_path, run_ingest, fmt, mode):
    items = _write(tmp_path, "items.csv", ITEMS)
    inter = _interactions(tmp_path, fmt)
    r = run_ingest(items, inter, "data.min_seq_len=3", f"data.on_unreadable_file={mode}")
    r.check_accounting()
    assert r.facts["skipped_files"] == {"items": [], "interactions": []}
    q = r.table("interactions_quarantine").to_pylist()
    assert [(row["reason"], row["source_row"]) for row in q] == [("invalid_ts", 2)]
    assert q[0]["source_file"] == str(inter)
    assert r.facts["interactions_rows_ok"] == 4
    assert r.table("sequences").column("user_id").to_pylist() == ["u"]


def test_parse_ts_bounds():
    assert cat.parse_ts(2**63 - 1) == 2**63 - 1
    for bad in (2**63, HUGE, str(HUGE), f"{HUGE}.0", "9" * 5000, 1e300, -1, "-5"):
        assert cat.parse_ts(bad) is None, bad
    assert cat.parse_ts("0000000000000000000000012") == 12  # leading zeros are not magnitude


def test_a_timestamp_column_reads_as_epoch_seconds(tmp_path):
    p = _write(tmp_path, "t.parquet", pa.table({
        "user_id": ["u", "u"], "item_id": ["1", "2"],
        "ts": pa.array([1_700_000_000_123, None], pa.timestamp("ms", tz="UTC"))}))
    (batch,) = list(local_stream(plan_tasks([str(p)], "auto"), "interactions", InteractionColumns(), 100))
    assert batch.column("ts").to_pylist() == [1_700_000_000, None]
    assert batch.column("reason").to_pylist() == [None, "invalid_ts"]


def _read(path, kind="interactions"):
    out = []
    for b in local_stream(plan_tasks([str(path)], "auto"), kind, InteractionColumns(), 100):
        raise_file_error(b)
        out.append(b)
    return pa.concat_tables(out)


def test_a_deeply_nested_json_line_is_one_quarantined_row(tmp_path):
    deep = "[" * 200_000 + "]" * 200_000
    p = _write(tmp_path, "inter.jsonl", '{"user_id": "u", "item_id": "1", "ts": 1}\n'
               f'{{"user_id": "u", "item_id": {deep}, "ts": 2}}\n{{"user_id": "u", "item_id": "2", "ts": 3}}\n')
    t = _read(p)
    assert t.column("reason").to_pylist() == [None, cat.MALFORMED_RECORD, None]
    assert t.column("source_file").to_pylist() == [str(p)] * 3


def test_a_deeply_nested_json_array_file_is_one_line_naming_it(tmp_path):
    p = _write(tmp_path, "inter.json", "[" * 200_000 + "]" * 200_000)
    with pytest.raises(UnreadableFileError) as e:
        _read(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: ") and "nested deeper" in msg and len(msg.splitlines()) == 1
    assert e.value.file == str(p)


def test_a_csv_field_over_the_block_size_names_the_file_and_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "CSV_BLOCK_BYTES", 4096)
    p = _write(tmp_path, "inter.csv", "user_id,item_id,ts\n" + "u,1,1\n" * 20
               + 'u,"' + "x" * 10_000 + '",2\nu,2,3\n')
    with pytest.raises(UnreadableFileError) as e:
        _read(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: ") and "block size of 4 KiB" in msg and len(msg.splitlines()) == 1
    assert "after the first 20 data rows" in msg


def test_the_block_size_is_named_in_mib():
    assert readers._size(readers.CSV_BLOCK_BYTES) == "8 MiB"


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 20])
def test_lines_are_split_the_same_at_any_chunk_size(chunk):
    data = b"a\n\nbb\nccc" + b"d" * 50 + b"\n\n" + b"e" * 20
    assert list(readers._lines(io.BytesIO(data), chunk)) == data.split(b"\n")[:-1] + [b"e" * 20]
    assert list(readers._lines(io.BytesIO(b"x\n"), chunk)) == [b"x"]


def test_a_long_line_is_read_in_linear_time():
    """A minified one-line JSON array of 8 MiB in 1 KiB blocks: linear, milliseconds (the old
    reader re-split and re-copied the whole growing buffer per block: ~32 GB scanned)."""
    import time

    data = b"x" * (8 << 20) + b"\nend"
    t0 = time.perf_counter()
    lines = list(readers._lines(io.BytesIO(data), 1024))
    elapsed = time.perf_counter() - t0
    assert lines == [b"x" * (8 << 20), b"end"]
    assert elapsed < 1.0, f"{elapsed:.2f}s for one 8 MiB line"
