"""gti.data.readers: column mapping and the per-format readers, called directly on small files."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gti.config import InteractionColumns, ItemColumns
from gti.data import readers
from gti.data.catalog import INVALID_UTF8, MALFORMED_RECORD, READ_ERROR
from gti.data.sources import ReadTask
from gti.common.errors import DataError, UnreadableFileError

from .conftest import FIXTURES

ITEM_MAP = {"item_id": "item_id", "title": "title"}


def test_mappings_drop_unset_columns_and_add_attributes():
    cols = ItemColumns(id="sku", description=None, attributes=["brand", "color"])
    assert readers.item_mapping(cols) == {"item_id": "sku", "title": "title", "category": "category",
                                          "brand": "brand", "color": "color"}
    assert readers.interaction_mapping(InteractionColumns(user="who", ts=None)) == {
        "user_id": "who", "item_id": "item_id"}


def test_check_columns_names_file_and_column_and_returns_absent_optional_ones():
    mapping = {"item_id": "sku", "title": "name", "brand": "brand"}
    assert readers.check_columns("f.csv", ["sku", "name"], mapping, ["item_id"], "items") == ["brand"]
    with pytest.raises(DataError, match=r"f\.csv: missing column 'sku' \(data\.items\.columns; the file has: a, b\)"):
        readers.check_columns("f.csv", ["a", "b"], mapping, ["item_id"], "items")


def test_csv_values_stay_strings_and_batches_carry_their_first_row(tmp_path):
    p = tmp_path / "items.csv"
    p.write_text("item_id,title,extra\n007,A,x\n12.0,B,y\n3,,z\n")
    got = list(readers._iter_csv(ReadTask(str(p), "csv"), {**ITEM_MAP, "brand": "brand"}, ["item_id"],
                                 "items", batch_rows=2))
    assert [row for _, row in got] == [0, 2]
    first, second = got[0][0], got[1][0]
    assert first["item_id"] == [b"007", b"12.0"] and first["title"] == [b"A", b"B"]
    assert first["brand"] == [None, None]  # absent optional column: filled, not fatal
    assert second["title"] == [None] and "extra" not in second


def test_ragged_csv_row_is_located(tmp_path):
    p = tmp_path / "items.csv"
    p.write_text('item_id,title\n1,a\n"2\nstill 2",b\n3,c,EXTRA\n')
    assert readers._ragged_row(str(p), ",", 2) == " at data row 2 (line 5)"
    assert readers._ragged_row(str(p), ",", 3) == " at data row 0 (line 2)"
    with pytest.raises(UnreadableFileError, match="CSV parse error at data row 2 .line 5.: Expected 2 columns"):
        list(readers._iter_csv(ReadTask(str(p), "csv"), ITEM_MAP, ["item_id"], "items", batch_rows=10))


def test_parquet_reads_row_groups_with_running_row_numbers(tmp_path):
    p = tmp_path / "items.parquet"
    pq.write_table(pa.table({"item_id": [str(i) for i in range(10)], "title": ["t"] * 10, "n": list(range(10))}),
                   p, row_group_size=4)
    task = ReadTask(str(p), "parquet", row_groups=[1, 2], first_row=4, rows=6)
    got = list(readers._iter_parquet(task, {**ITEM_MAP, "n": "n"}, ["item_id"], "items", batch_rows=3))
    assert [row for _, row in got] == [4, 7, 8]
    assert [v for b, _ in got for v in b["item_id"]] == [str(i).encode() for i in range(4, 10)]
    assert got[0][0]["n"] == [4, 5, 6]  # numbers stay numbers
    with pytest.raises(DataError, match="missing column 'user_id'"):
        list(readers._iter_parquet(task, {"user_id": "user_id"}, ["user_id"], "interactions", 3))


def test_json_lines_bad_lines_become_error_records(tmp_path):
    p = tmp_path / "meta.jsonl"
    p.write_bytes(b'{"item_id": "1"}\n\n[1, 2]\nnot json\n\xff\xfe{"x": 1}\n{\'item_id\': \'2\'}\n')
    recs = list(readers._json_records(ReadTask(str(p), "jsonl")))
    assert recs[0] == {"item_id": "1"}
    assert [r[READ_ERROR] for r in recs[1:]] == [MALFORMED_RECORD, MALFORMED_RECORD, INVALID_UTF8, MALFORMED_RECORD]
    assert recs[3]["_raw"] == b'\xff\xfe{"x": 1}'
    # Amazon 2014 lines are Python literals: parsed only when asked for
    assert list(readers._json_records(ReadTask(str(p), "amazon"), literal_ok=True))[-1] == {"item_id": "2"}


def test_json_array_file_and_empty_file(tmp_path):
    p = tmp_path / "items.json"
    p.write_text(json.dumps([{"item_id": "1"}, 5, {"item_id": "2"}], indent=1))
    recs = list(readers._json_records(ReadTask(str(p), "json")))
    assert recs == [{"item_id": "1"}, {READ_ERROR: MALFORMED_RECORD, "_raw": "5"}, {"item_id": "2"}]
    (tmp_path / "blank.jsonl").write_text("\n\n")
    assert list(readers._json_records(ReadTask(str(tmp_path / "blank.jsonl"), "jsonl"))) == []
    (tmp_path / "bad.json").write_text('[{"item_id": ')
    with pytest.raises(UnreadableFileError, match="not valid JSON"):
        list(readers._json_records(ReadTask(str(tmp_path / "bad.json"), "json")))


def test_records_to_batches_checks_columns_and_keeps_bad_lines_visible():
    task = ReadTask("mem.jsonl", "jsonl")
    recs = [{"item_id": "1", "title": "a"}, {READ_ERROR: INVALID_UTF8, "_raw": b"\xff"}, {"item_id": "3"}]
    got = list(readers._records_to_batches(task, iter(recs), ITEM_MAP, ["item_id"], "items", batch_rows=2))
    assert [row for _, row in got] == [0, 2]
    assert got[0][0] == {"item_id": ["1", b"\xff"], "title": ["a", None], READ_ERROR: [None, INVALID_UTF8]}
    assert got[1][0] == {"item_id": ["3"], "title": [None]}
    with pytest.raises(DataError, match="mem.jsonl: missing column 'item_id'"):
        list(readers._records_to_batches(task, iter([{"sku": 1}]), ITEM_MAP, ["item_id"], "items", 2))
    # only error records: nothing to check the columns against, they are quarantined row by row
    only_bad = list(readers._records_to_batches(task, iter(recs[1:2]), ITEM_MAP, ["item_id"], "items", 2))
    assert only_bad[0][0][READ_ERROR] == [INVALID_UTF8]


def test_amazon_record_flattens_description_and_takes_first_category_path():
    rec = readers._amazon_record({"asin": "B1", "description": ["One.", ["Two."], 3],
                                  "categories": [["A", "B"], ["C"]], "brand": "X"})
    assert (rec["item_id"], rec["description"], rec["category"], rec["brand"]) == ("B1", "One. Two.", "A > B", "X")
    flat = readers._amazon_record({"asin": "B2", "description": [], "category": ["A", "B"]})
    assert flat["description"] is None and flat["category"] == "A > B"


def test_movielens_lines():
    items = list(readers._movielens_records(ReadTask(str(FIXTURES / "u.item"), "movielens"), "items"))
    assert items[1] == {"item_id": "2", "title": "GoldenEye (1995)", "description": None,
                        "category": "Action Adventure Thriller", "release_date": "01-Jan-1995"}
    inter = list(readers._movielens_records(ReadTask(str(FIXTURES / "u.data"), "movielens"), "interactions"))
    assert inter[0] == {"user_id": "1", "item_id": "1", "rating": "5", "ts": "874965758"}


def test_short_movielens_lines_are_malformed(tmp_path):
    (tmp_path / "u.item").write_text("1|only|three\n")
    (tmp_path / "u.data").write_text("1\t2\n")
    got = [next(readers._movielens_records(ReadTask(str(tmp_path / f), "movielens"), k))
           for f, k in (("u.item", "items"), ("u.data", "interactions"))]
    assert [r[READ_ERROR] for r in got] == [MALFORMED_RECORD] * 2 and got[1]["_raw"] == "1\t2"


class _Chunks:
    def __init__(self, data: bytes):
        self.data = data

    def read(self, n):
        out, self.data = self.data[:n], self.data[n:]
        return out


def test_lines_across_chunk_boundaries():
    assert list(readers._lines(_Chunks(b"ab\ncdef\n\ng"), chunk=3)) == [b"ab", b"cdef", b"", b"g"]
    assert list(readers._lines(_Chunks(b"x\n"), chunk=1)) == [b"x"]
