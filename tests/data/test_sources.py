"""gti.data.sources: which files a path means, their formats, read tasks, opening files."""

from __future__ import annotations

import gzip

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gti.data import sources
from gti.common.errors import DataError, UnreadableFileError


def test_directory_walk_skips_marker_and_hidden_files_and_folders(tmp_path):
    d = tmp_path / "parts"
    (d / "sub").mkdir(parents=True)
    (d / "_tmp").mkdir()
    (d / ".cache").mkdir()
    for p in ("b.csv", "a.csv", "sub/c.csv", "_SUCCESS", ".crc", "_tmp/x.csv", ".cache/y.csv"):
        (d / p).write_text("item_id\n1\n")
    assert sources.expand_paths(str(d), "items") == [str(d / "a.csv"), str(d / "b.csv"), str(d / "sub" / "c.csv")]


def test_glob_file_uri_and_plain_file(tmp_path):
    for name in ("x2.jsonl", "x1.jsonl", "y.csv"):
        (tmp_path / name).write_text("{}\n")
    assert sources.expand_paths(str(tmp_path / "x*.jsonl"), "items") == [
        str(tmp_path / "x1.jsonl"), str(tmp_path / "x2.jsonl")]
    assert sources.expand_paths(f"file://{tmp_path}/y.csv", "items") == [f"{tmp_path}/y.csv"]
    assert sources.expand_paths(str(tmp_path / "y.csv"), "interactions") == [str(tmp_path / "y.csv")]


def test_unknown_extension_and_missing_path(tmp_path):
    (tmp_path / "items.txt").write_text("x")
    with pytest.raises(DataError, match="set data.<source>.format"):
        sources.plan_tasks([str(tmp_path / "items.txt")], "auto")
    with pytest.raises(DataError, match="no such file or directory"):
        sources.expand_paths(str(tmp_path / "nope.csv"), "items")
    with pytest.raises(DataError, match="no data files"):
        sources.expand_paths(str(tmp_path / "*.parquet"), "items")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"data\.interactions\.path: no data files"):
        sources.expand_paths(str(tmp_path / "empty"), "interactions")


@pytest.mark.parametrize("path, fmt, want", [
    ("a/items.parquet", "auto", "parquet"),
    ("a/items.pq", "auto", "parquet"),
    ("a/items.csv.gz", "auto", "csv"),
    ("a/items.TSV", "auto", "tsv"),
    ("a/items.ndjson.zst", "auto", "jsonl"),
    ("a/items.json", "auto", "json"),
    ("ml-100k/u.item", "auto", "movielens"),
    ("ml-100k/u.data.bz2", "auto", "movielens"),
    ("a/any.name", "movielens", "movielens"),
    ("a/meta.jsonl.gz", "amazon", "amazon"),
    ("a/meta.jsonl", "amazon2023", "amazon2023"),
    ("a/items.tsv", "csv", "tsv"),  # csv configured, the extension says tab-separated
    ("a/items.txt", "csv", "csv"),
    ("a/items.dat", "jsonl", "jsonl"),
])
def test_detect_format(path, fmt, want):
    assert sources.detect_format(path, fmt) == want


def test_plan_tasks_cuts_parquet_by_row_groups_and_keeps_file_order(tmp_path):
    big = tmp_path / "big.parquet"
    pq.write_table(pa.table({"item_id": [str(i) for i in range(250)]}), big, row_group_size=50)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"item_id": pa.array([], pa.string())}), empty)
    csv = tmp_path / "c.csv"
    csv.write_text("item_id\n1\n")
    tasks = sources.plan_tasks([str(big), str(csv), str(empty)], "auto", rows_per_task=120)
    assert [(t.fmt, t.row_groups, t.first_row, t.rows) for t in tasks[:3]] == [
        ("parquet", [0, 1, 2], 0, 150), ("parquet", [3, 4], 150, 100), ("csv", None, 0, None)]
    # a parquet file without row groups is still one (empty) task, so its schema gets checked
    last = tasks[3]
    assert last.file == str(empty) and last.fmt == "parquet" and last.rows == 0
    assert last.row_groups == list(range(pq.ParquetFile(empty).metadata.num_row_groups))
    assert len(tasks) == 4


def test_open_decompresses_by_extension_and_names_a_missing_file(tmp_path):
    p = tmp_path / "lines.jsonl.gz"
    with gzip.open(p, "wb") as fh:
        fh.write(b'{"item_id": 1}\n')
    with sources._open(str(p)) as fh:
        assert fh.read() == b'{"item_id": 1}\n'
    missing = str(tmp_path / "gone.csv")
    with pytest.raises(UnreadableFileError, match="cannot open") as err:
        sources._open(missing)
    assert err.value.file == missing


def test_parquet_file_that_is_not_parquet(tmp_path):
    p = tmp_path / "fake.parquet"
    p.write_text("item_id\n1\n")
    with pytest.raises(UnreadableFileError, match="not a readable parquet file") as err:
        sources._parquet_file(str(p))
    assert err.value.file == str(p) and "\n" not in str(err.value)


def test_reason_is_the_first_line_with_control_characters_escaped():
    assert sources.error_reason(OSError("\n  bad page\x00\x07 here\nsecond line")) == "bad page\\x00\\x07 here"
    assert sources.error_reason(EOFError()) == "EOFError"
    assert issubclass(pa.ArrowInvalid, sources.READ_ERRORS) and issubclass(EOFError, sources.READ_ERRORS)
