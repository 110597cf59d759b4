"""The bad-input corpus (issue 8, item 4) for catalogs and interactions.

Each malformed input gives either one clear DataError line naming the file/column, or rows in
quarantine with a reason — and rows_in == ok + quarantined for items and interactions. The
damaged-file cases of issue 18 (truncated gzip, corrupt parquet page, zero-byte part, ragged
row) run here in-process; tests/stages/test_ingest_damaged.py runs them through the CLI on Ray."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gti.data import catalog as C
from gti.common.errors import DataError, UnreadableFileError

GOOD_ITEMS = "item_id,title\n1,Beaker\n2,Flask\n3,Pipette\n"
GOOD_INTER = "user_id,item_id,ts\n" + "".join(f"u,{i},{t}\n" for t, i in enumerate([1, 2, 3, 1]))


@pytest.fixture
def files(tmp_path):
    def w(name, content):
        p = tmp_path / name
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
        return p

    return w


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_empty_file(files, run_ingest):
    p = files("items.csv", "")
    with pytest.raises(DataError) as e:
        run_ingest(p, files("i.csv", GOOD_INTER))
    assert str(p) in _one_line(e) and "empty file" in str(e.value)
    p = files("items.jsonl", "")
    with pytest.raises(DataError, match="no valid items"):
        run_ingest(p, files("i.csv", GOOD_INTER))


def test_header_only(files, run_ingest):
    p = files("items.csv", "item_id,title\n")
    with pytest.raises(DataError) as e:
        run_ingest(p, files("i.csv", GOOD_INTER))
    assert "no valid items (0 rows read" in _one_line(e) and str(p) in str(e.value)
    with pytest.raises(DataError, match="no valid interactions"):
        run_ingest(files("items.csv", GOOD_ITEMS), files("i2.csv", "user_id,item_id,ts\n"))


@pytest.mark.parametrize("fmt", ["csv", "parquet", "jsonl"])
def test_missing_columns_name_file_and_column(tmp_path, files, run_ingest, fmt):
    rows = [{"sku": "1", "title": "Beaker"}]
    p = tmp_path / f"items.{fmt}"
    if fmt == "csv":
        p.write_text("sku,title\n1,Beaker\n")
    elif fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), p)
    else:
        p.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(DataError) as e:
        run_ingest(p, files("i.csv", GOOD_INTER))
    assert f"{p}: missing column 'item_id'" in _one_line(e)
    # A missing ts column on interactions names it too.
    with pytest.raises(DataError, match=r"i\.csv: missing column 'ts'"):
        run_ingest(files("items.csv", GOOD_ITEMS), files("i.csv", "user_id,item_id\nu,1\n"))


def test_wrong_types_are_quarantined(tmp_path, files, run_ingest):
    p = tmp_path / "items.parquet"
    # description is an int column; only the rows that carry an int value are bad.
    pq.write_table(pa.table({"item_id": ["1", "2", "3", "4"], "title": ["Beaker", "Flask", "Pipette", "Tube"],
                             "description": pa.array([None, 7, None, None], pa.int64())}), p)
    inter = files("i.jsonl", "".join(json.dumps(r) + "\n" for r in [
        {"user_id": "u", "item_id": "1", "ts": 1}, {"user_id": "u", "item_id": "3", "ts": "soon"},
        {"user_id": "u", "item_id": "3", "ts": 2}, {"user_id": "u", "item_id": 4, "ts": 3},
        {"user_id": ["u"], "item_id": "1", "ts": 4}]))
    r = run_ingest(p, inter)
    r.check_accounting()
    assert r.reasons("items_quarantine") == [C.NON_STRING_TEXT]
    assert r.table("items_quarantine").column("detail").to_pylist() == ["description"]
    assert sorted(r.reasons("interactions_quarantine")) == sorted([C.INVALID_TS, C.BAD_ID_TYPE])
    assert r.table("sequences").to_pylist()[0]["test_item"] == "4"  # int item id normalised


def test_duplicate_ids_first_kept(files, run_ingest):
    r = run_ingest(files("items.csv", "item_id,title\n1,First\n2,Flask\n1,Second\n3,Pipette\n1,Third\n"),
                   files("i.csv", GOOD_INTER))
    r.check_accounting()
    items = r.table("items").to_pylist()
    assert [i["title"] for i in items] == ["First", "Flask", "Pipette"]
    q = r.table("items_quarantine").to_pylist()
    assert [(x["reason"], x["source_row"]) for x in q] == [(C.DUPLICATE_ID, 2), (C.DUPLICATE_ID, 4)]
    assert "Second" in q[0]["raw"]


def test_ids_as_floats(tmp_path, files, run_ingest):
    p = tmp_path / "items.parquet"
    pq.write_table(pa.table({"item_id": [1.0, 2.0, 2.5, float("nan"), 3.0],
                             "title": ["Beaker", "Flask", "Half", "Nan", "Pipette"]}), p)
    # Interactions written by pandas with float ids: "1.0" etc. match "1".
    inter = files("i.csv", "user_id,item_id,ts\n7.0,1.0,1\n7.0,2.0,2\n7.0,3.0,3\n7.0,2.5,4\n")
    r = run_ingest(p, inter)
    r.check_accounting()
    assert r.table("items").column("item_id").to_pylist() == ["1", "2", "3"]
    assert r.reasons("items_quarantine") == [C.FLOAT_ID, C.MISSING_ID]
    assert r.table("sequences").to_pylist() == [{"user_id": "7", "train_items": ["1"], "valid_item": "2", "test_item": "3",
                       "valid_items": ["2"], "test_items": ["3"]}]
    assert r.reasons("interactions_quarantine") == [C.UNKNOWN_ITEM]  # "2.5" is a string id not in the catalog


def test_non_utf8_bytes(files, run_ingest):
    items_csv = files("items.csv", b"item_id,title\n1,Beaker\n2,Fl\xffask\n3,Pipette\n4,Tube\n")
    r = run_ingest(items_csv, files("i.csv", GOOD_INTER))
    r.check_accounting()
    assert r.reasons("items_quarantine") == [C.INVALID_UTF8]
    assert "\\xff" in r.table("items_quarantine").column("raw")[0].as_py()
    items_jsonl = files("items.jsonl", b'{"item_id": "1", "title": "Beaker"}\n{"item_id": "2", "title": "Fl\xffask"}\n'
                        b'{"item_id": "3", "title": "Pipette"}\n')
    inter = files("i2.csv", b"user_id,item_id,ts\nu,1,1\nu,3,2\n\xfe,1,3\nu,1,4\n")
    r = run_ingest(items_jsonl, inter)
    r.check_accounting()
    assert r.reasons("items_quarantine") == [C.INVALID_UTF8]
    assert r.reasons("interactions_quarantine") == [C.INVALID_UTF8]


def test_megabyte_titles_are_truncated_and_counted(tmp_path, files, run_ingest):
    p = tmp_path / "items.parquet"
    pq.write_table(pa.table({"item_id": ["1", "2", "3"], "title": ["B" * 1_000_000, "Flask", "Pipette"],
                             "description": ["D" * 1_000_000, None, None]}), p)
    r = run_ingest(p, files("i.csv", GOOD_INTER), "data.max_text_chars=500")
    r.check_accounting()
    items = r.table("items").to_pylist()
    assert len(items[0]["title"]) == 500 and len(items[0]["description"]) == 500
    assert r.facts["truncated_texts"] == 1


def test_negative_timestamps_quarantined(files, run_ingest):
    inter = files("i.csv", "user_id,item_id,ts\nu,1,5\nu,2,-3\nu,2,6\nu,3,7\nu,1,\n")
    r = run_ingest(files("items.csv", GOOD_ITEMS), inter)
    r.check_accounting()
    assert r.reasons("interactions_quarantine") == [C.INVALID_TS, C.INVALID_TS]
    assert r.facts["interactions_quarantine_reasons"] == {C.INVALID_TS: 2}


def test_users_with_one_interaction_are_dropped_and_counted(files, run_ingest):
    inter = files("i.csv", GOOD_INTER + "lonely,1,9\n")
    r = run_ingest(files("items.csv", GOOD_ITEMS), inter)
    r.check_accounting()
    q = r.table("interactions_quarantine").to_pylist()
    assert [(x["user_id"], x["reason"]) for x in q] == [("lonely", C.SHORT_SEQUENCE)]
    assert r.facts["n_users"] == 1


def test_unknown_items_quarantined(files, run_ingest):
    inter = files("i.csv", GOOD_INTER + "u,999,10\n")
    r = run_ingest(files("items.csv", GOOD_ITEMS), inter)
    r.check_accounting()
    q = r.table("interactions_quarantine").to_pylist()
    assert [(x["item_id"], x["reason"], x["source_row"]) for x in q] == [("999", C.UNKNOWN_ITEM, 4)]


def test_mixed_schemas_across_parquet_files(tmp_path, files, run_ingest):
    d = tmp_path / "catalog"
    d.mkdir()
    pq.write_table(pa.table({"item_id": ["1", "2"], "title": ["Beaker", "Flask"]}), d / "a.parquet")
    # Another writer: int ids, an extra column, description instead of title, one int title.
    pq.write_table(pa.table({"item_id": pa.array([3, 4], pa.int64()), "description": ["A pipette", "A tube"],
                             "price": [1.5, 2.5]}), d / "b.parquet")
    pq.write_table(pa.table({"item_id": ["5"], "title": pa.array([42], pa.int64())}), d / "c.parquet")
    r = run_ingest(d, files("i.csv", GOOD_INTER))
    r.check_accounting()
    assert r.table("items").column("item_id").to_pylist() == ["1", "2", "3", "4"]
    assert r.reasons("items_quarantine") == [C.NON_STRING_TEXT]
    # A file in the directory without the id column fails with its name.
    pq.write_table(pa.table({"sku": ["6"], "title": ["x"]}), d / "d.parquet")
    with pytest.raises(DataError) as e:
        run_ingest(d, files("i.csv", GOOD_INTER))
    assert f"{d / 'd.parquet'}: missing column 'item_id'" in _one_line(e)


def test_items_without_any_text_and_pseudo_text(files, run_ingest):
    items = files("items.csv", "item_id,title,description,category,brand\n1,Beaker,,,\n2,,,Lab > Glass,Pyrex\n"
                  "3,,,,\n4,,A flask,,\n")
    inter = files("i.csv", "user_id,item_id,ts\nu,1,1\nu,2,2\nu,4,3\n")
    r = run_ingest(items, inter)
    r.check_accounting()
    got = {i["item_id"]: i for i in r.table("items").to_pylist()}
    assert got["2"]["text_is_pseudo"] and got["2"]["title"] == "Pyrex Lab > Glass"
    assert not got["4"]["text_is_pseudo"] and got["4"]["title"] == ""
    assert r.reasons("items_quarantine") == [C.NO_TEXT]
    assert r.facts["pseudo_texts"] == 1


def test_max_items_keeps_first_valid_and_quarantines_other_interactions(files, run_ingest):
    items = files("items.csv", "item_id,title\n1,A\n,missing\n2,B\n3,C\n4,D\n5,E\n")
    inter = files("i.csv", "user_id,item_id,ts\n" + "".join(f"u,{i},{t}\n" for t, i in enumerate([1, 2, 3, 4, 1, 3])))
    r = run_ingest(items, inter, "data.max_items=3")
    r.check_accounting()
    assert r.table("items").column("item_id").to_pylist() == ["1", "2", "3"]
    assert r.facts["items_rows_in"] == 4 and r.facts["items_limit_reached"]  # rows after the 3rd kept are not read
    assert r.reasons("interactions_quarantine") == [C.OUTSIDE_MAX_ITEMS]
    assert r.table("sequences").to_pylist()[0]["train_items"] == ["1", "2", "3"]


def test_quarantine_facts_sum_to_quarantined_rows(files, run_ingest):
    items = files("items.csv", "item_id,title\n1,A\n1,dup\n2,B\n3,C\n,x\n")
    inter = files("i.csv", GOOD_INTER + "u,9,1\nv,1,2\n")
    r = run_ingest(items, inter)
    r.check_accounting()
    f = r.facts
    assert sum(f["quarantine_reasons"].values()) == f["items_rows_quarantined"] + f["interactions_rows_quarantined"]
    assert f["quarantine_reasons"] == {C.DUPLICATE_ID: 1, C.MISSING_ID: 1, C.UNKNOWN_ITEM: 1, C.SHORT_SEQUENCE: 1}


def test_max_users_keeps_first_eligible_users(files, run_ingest):
    inter = files("i.csv", "user_id,item_id,ts\n" + "".join(
        f"{u},{i},{t}\n" for t, (u, i) in enumerate([("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3), ("b", 3), ("c", 1)])))
    r = run_ingest(files("items.csv", GOOD_ITEMS), inter, "data.max_users=1")
    r.check_accounting()
    assert r.table("sequences").column("user_id").to_pylist() == ["a"]
    assert r.facts["interactions_quarantine_reasons"] == {C.OUTSIDE_MAX_USERS: 3, C.SHORT_SEQUENCE: 1}


def test_json_array_file(files, run_ingest):
    items = files("items.json", '[{"item_id": "1", "title": "Beaker"},\n {"item_id": "2",\n "title": "Flask"}, 7]')
    inter = files("i.csv", "user_id,item_id,ts\nu,1,1\nu,2,2\nu,1,3\n")
    r = run_ingest(items, inter)
    r.check_accounting()
    assert r.table("items").column("title").to_pylist() == ["Beaker", "Flask"]
    assert r.reasons("items_quarantine") == [C.MALFORMED_RECORD]


# --------------------------------------------------------------------------- damaged files (issue 18)
BIG = 120_000  # rows: ~6 MB of CSV/JSONL, so the damage lies beyond the driver's header read


def _read_tasks_started(capsys) -> bool:
    """Did the stage get past the driver's header checks (so a later error is a read task's)?"""
    return "read task(s) from" in capsys.readouterr().err


def test_truncated_gzip_csv_names_the_file(damaged, files, run_ingest, capsys):
    small = damaged.truncated_gzip("items.csv.gz", damaged.items_csv(50))
    with pytest.raises(UnreadableFileError) as e:
        run_ingest(small, files("i.csv", GOOD_INTER))
    assert _one_line(e) == f"{small}: cannot read: Truncated compressed stream"
    assert not _read_tasks_started(capsys)  # found by the header check in the driver
    big = damaged.truncated_gzip("big.csv.gz", damaged.items_csv(BIG))
    with pytest.raises(UnreadableFileError) as e:
        run_ingest(big, files("i.csv", GOOD_INTER))
    assert _read_tasks_started(capsys)  # found by the read task
    assert re.fullmatch(rf"{re.escape(str(big))}: cannot read( \(after the first \d+ data rows\))?: "
                        r"Truncated compressed stream", _one_line(e))


def test_truncated_gzip_jsonl_names_the_file_and_line(damaged, files, run_ingest, capsys):
    small = damaged.truncated_gzip("items.jsonl.gz", damaged.items_jsonl(50))
    with pytest.raises(UnreadableFileError) as e:
        run_ingest(small, files("i.csv", GOOD_INTER))
    assert _one_line(e) == f"{small}: cannot read after line 0: Truncated compressed stream"
    assert not _read_tasks_started(capsys)
    big = damaged.truncated_gzip("big.jsonl.gz", damaged.items_jsonl(BIG))
    with pytest.raises(UnreadableFileError) as e:
        run_ingest(big, files("i.csv", GOOD_INTER))
    assert _read_tasks_started(capsys)
    m = re.fullmatch(rf"{re.escape(str(big))}: cannot read after line (\d+): Truncated compressed stream",
                     _one_line(e))
    assert m and 100 < int(m.group(1)) < BIG


def test_corrupt_parquet_page_among_good_parts(damaged, tmp_path, run_ingest):
    cat_dir = damaged.parquet_parts("catalog", damage=(1, 2))
    inter = damaged.interactions_csv(tmp_path / "i.csv", n_users=300, n_items=3000)
    with pytest.raises(UnreadableFileError) as e:
        run_ingest(cat_dir, inter)
    assert _one_line(e).startswith(f"{cat_dir / 'part-1.parquet'}: row group 2 (data rows 500-749) is damaged: ")
    # skip: the whole part is left out (also its rows before the damage), recorded with its reason.
    r = run_ingest(cat_dir, inter, "data.on_unreadable_file=skip")
    r.check_accounting()
    f = r.facts
    assert f["items_rows_in"] == f["items_rows_ok"] == 2000
    ids = set(r.table("items").column("item_id").to_pylist())
    assert ids == {str(i) for i in range(1000)} | {str(i) for i in range(2000, 3000)}
    (skipped,) = f["skipped_files"]["items"]
    assert skipped["file"] == str(cat_dir / "part-1.parquet")
    assert skipped["reason"].startswith("row group 2 (data rows 500-749) is damaged: ")
    assert f["skipped_files"]["interactions"] == []
    assert f["skipped_files_rows_in"].startswith("unknown")
    # The interactions of the skipped part's items are unknown items now, counted as such.
    assert f["interactions_quarantine_reasons"]["unknown_item"] > 0


def test_zero_byte_part(damaged, tmp_path, run_ingest):
    cat_dir = damaged.parquet_parts("catalog", n_parts=2)
    (cat_dir / "part-9.parquet").write_bytes(b"")
    inter = damaged.interactions_csv(tmp_path / "i.csv", n_users=50, n_items=2000)
    with pytest.raises(UnreadableFileError) as e:
        run_ingest(cat_dir, inter)
    assert _one_line(e) == (f"{cat_dir / 'part-9.parquet'}: not a readable parquet file: "
                            "Parquet file size is 0 bytes")
    r = run_ingest(cat_dir, inter, "data.on_unreadable_file=skip")
    r.check_accounting()
    assert r.facts["items_rows_in"] == 2000
    assert r.facts["skipped_files"]["items"] == [
        {"file": str(cat_dir / "part-9.parquet"), "reason": "not a readable parquet file: Parquet file size is 0 bytes"}]
    # Skipping every file is still an error, naming the first one.
    only = tmp_path / "only"
    only.mkdir()
    (only / "a.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"all 1 file\(s\) are unreadable \(first: .*a\.parquet: not a readable"):
        run_ingest(only, inter, "data.on_unreadable_file=skip")


def test_directory_without_data_files(tmp_path, files, run_ingest):
    d = tmp_path / "empty_catalog"
    d.mkdir()
    (d / "_SUCCESS").write_text("")
    (d / ".hidden.parquet").write_text("")
    with pytest.raises(DataError) as e:
        run_ingest(d, files("i.csv", GOOD_INTER))
    assert _one_line(e) == f"data.items.path: no data files match {d}"


def test_ragged_csv_row_number(files, run_ingest):
    # Data row 1 holds a quoted newline, so data row 3 (0-based, as source_row) ends on line 6.
    p = files("items.csv", 'item_id,title\n1,Beaker\n2,"Flask\nwith a lid"\n3,Pipette\n4,Tube,extra\n5,Cap\n')
    with pytest.raises(UnreadableFileError) as e:
        run_ingest(p, files("i.csv", GOOD_INTER))
    assert _one_line(e) == (f"{p}: CSV parse error at data row 3 (line 6): "
                            "Expected 2 columns, got 3: 4,Tube,extra")


def test_interaction_columns_checked_before_items_are_read(tmp_path, files, run_ingest):
    inter = files("i.csv", "user,item_id,ts\nu,1,1\n")  # "user" instead of "user_id"
    with pytest.raises(DataError) as e:
        run_ingest(files("items.csv", GOOD_ITEMS), inter)
    assert _one_line(e).startswith(f"{inter}: missing column 'user_id'")
    assert not (tmp_path / "work1" / "items.parquet").exists()  # no item was read


def test_cap_that_removes_most_interactions_warns(files, run_ingest):
    items = files("items.csv", "item_id,title\n" + "".join(f"{i},T{i}\n" for i in range(10)))
    inter = files("i.csv", "user_id,item_id,ts\n" + "".join(f"u{u},{i},{i}\n" for u in range(3) for i in range(10)))
    r = run_ingest(items, inter, "data.max_items=3")
    assert r.facts["warnings"] == [
        "data.max_items=3 removed 70% of the interactions (21 of 30 rows, reason outside_max_items); "
        "raise or remove it to keep them"]
    assert run_ingest(items, inter).facts["warnings"] == []


def test_uri_errors_name_the_uri(files, run_ingest):
    inter = files("i.csv", GOOD_INTER)
    with pytest.raises(DataError) as e:  # a scheme neither pyarrow nor fsspec knows
        run_ingest("nosuch://bucket/items.parquet", inter)
    assert _one_line(e) == ("data.items.path: cannot list nosuch://bucket/items.parquet: "
                            "Unrecognized filesystem type in URI: nosuch://bucket/items.parquet")
    with pytest.raises(DataError) as e:  # an fsspec glob that matches nothing
        run_ingest("memory://gti-test-empty/*.parquet", inter)
    assert _one_line(e) == "data.items.path: no data files match memory://gti-test-empty/*.parquet"
