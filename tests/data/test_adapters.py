"""gti.data.adapters: every input format, paths (file, glob, directory, URI), column mapping."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from gti.config import InteractionColumns, ItemColumns
from gti.data import adapters
from gti.data.sources import ReadTask, expand_paths, plan_tasks
from gti.common.errors import DataError

from .conftest import FIXTURES

ITEMS = [
    {"item_id": "1", "title": "Toy Story", "description": "A toy cowboy.", "category": "Animation", "brand": "Pixar"},
    {"item_id": "2", "title": "GoldenEye", "description": "", "category": "Action", "brand": "MGM"},
    {"item_id": "3", "title": "Four Rooms", "description": "Hotel night.", "category": "Comedy", "brand": None},
]
INTER = [{"user_id": "u1", "item_id": str(i % 3 + 1), "ts": 100 + i} for i in range(4)] + [
    {"user_id": "u2", "item_id": str(i % 3 + 1), "ts": 50 - i} for i in range(3)
]


def _write(path, rows, fmt):
    t = pa.Table.from_pylist(rows)
    if fmt == "parquet":
        pq.write_table(t, path)
    elif fmt == "csv":
        pacsv.write_csv(t, path)
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    return path


@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl", "json"])
def test_each_format_round_trips(tmp_path, run_ingest, fmt):
    ip = _write(tmp_path / f"items.{fmt}", ITEMS, fmt)
    xp = _write(tmp_path / f"inter.{fmt}", INTER, fmt)
    r = run_ingest(ip, xp)
    r.check_accounting()
    items = r.table("items").to_pylist()
    assert [i["item_id"] for i in items] == ["1", "2", "3"]
    assert items[0]["attributes_text"] == "brand: Pixar" and items[2]["attributes_text"] == ""
    seqs = r.table("sequences").to_pylist()
    assert seqs[0] == {"user_id": "u1", "train_items": ["1", "2"], "valid_item": "3", "test_item": "1",
                       "valid_items": ["3"], "test_items": ["1"]}
    # u2's timestamps run backwards in the file: sorted chronologically.
    assert seqs[1] == {"user_id": "u2", "train_items": ["3"], "valid_item": "2", "test_item": "1",
                       "valid_items": ["2"], "test_items": ["1"]}


def test_tsv_directory_glob_and_column_mapping(tmp_path, run_ingest):
    d = tmp_path / "items_dir"
    d.mkdir()
    renamed = [{"sku": r["item_id"], "name": r["title"], "dept": r["category"]} for r in ITEMS]
    pacsv.write_csv(pa.Table.from_pylist(renamed[:2]), d / "part-0.tsv",
                    pacsv.WriteOptions(delimiter="\t"))
    pacsv.write_csv(pa.Table.from_pylist(renamed[2:]), d / "part-1.tsv",
                    pacsv.WriteOptions(delimiter="\t"))
    (d / "_SUCCESS").write_text("")  # marker files are skipped
    xp = _write(tmp_path / "inter.parquet", [dict(r, who=r["user_id"]) for r in INTER], "parquet")
    r = run_ingest(d, xp, "data.items.columns.id=sku", "data.items.columns.title=name",
                   "data.items.columns.category=dept", "data.items.columns.description=null",
                   "data.items.columns.attributes=[]", "data.interactions.columns.user=who")
    r.check_accounting()
    assert r.table("items").column("item_id").to_pylist() == ["1", "2", "3"]
    assert r.table("items").column("title").to_pylist()[1] == "GoldenEye"
    # The same through a glob and a file:// URI.
    assert expand_paths(str(d / "*.tsv"), "items") == [str(d / "part-0.tsv"), str(d / "part-1.tsv")]
    assert expand_paths(f"file://{d}/part-0.tsv", "items") == [f"{d}/part-0.tsv"]


def test_no_ts_column_uses_file_order(tmp_path, run_ingest):
    ip = _write(tmp_path / "items.csv", ITEMS, "csv")
    xp = _write(tmp_path / "inter.csv", [{k: v for k, v in r.items() if k != "ts"} for r in INTER], "csv")
    r = run_ingest(ip, xp, "data.interactions.columns.ts=null")
    r.check_accounting()
    seq = r.table("sequences").to_pylist()
    assert seq[1] == {"user_id": "u2", "train_items": ["1"], "valid_item": "2", "test_item": "3",
                       "valid_items": ["2"], "test_items": ["3"]}
    assert r.table("interactions").column("ts").to_pylist()[:4] == [0, 1, 2, 3]


def test_amazon_metadata_adapter(tmp_path, run_ingest):
    xp = _write(tmp_path / "inter.csv", [{"user_id": "u", "item_id": f"B00{k}", "ts": k} for k in (1, 2, 3, 4)], "csv")
    r = run_ingest(FIXTURES / "amazon_meta.jsonl", xp, "data.items.format=amazon")
    r.check_accounting()
    items = {i["item_id"]: i for i in r.table("items").to_pylist()}
    assert items["B001"]["description"] == "Heavy duty borosilicate glass. Graduated."
    assert items["B001"]["category"] == "Industrial & Scientific > Lab & Scientific Products > Beakers"
    # 2014 Python-literal line: nested categories, first path used.
    assert items["B003"]["category"] == "Industrial & Scientific > Measurement > Calipers"
    assert items["B003"]["attributes_text"] == "brand: Mitutoyo"
    # No title, no description: pseudo-text from brand + category.
    assert items["B004"]["text_is_pseudo"] and items["B004"]["title"].startswith("Eppendorf Industrial")
    q = r.table("items_quarantine").to_pylist()
    assert sorted(x["reason"] for x in q) == ["malformed_record", "no_text"]
    assert r.facts["pseudo_texts"] == 1


def test_movielens_raw_files(tmp_path, run_ingest):
    d = tmp_path / "ml"
    d.mkdir()
    shutil.copy(FIXTURES / "u.item", d / "u.item")
    shutil.copy(FIXTURES / "u.data", d / "u.data")
    r = run_ingest(d / "u.item", d / "u.data", "data.items.columns.attributes=[release_date]")
    r.check_accounting()
    items = {i["item_id"]: i for i in r.table("items").to_pylist()}
    assert items["1"]["title"] == "Toy Story (1995)"
    assert items["1"]["category"] == "Animation Children's Comedy"
    assert items["13"]["title"] == "Misérables, Les (1995)"  # latin-1 decoded
    assert items["1"]["attributes_text"] == "release_date: 01-Jan-1995"
    inter = r.table("interactions")
    assert inter.num_rows == 43 and inter.column("ts").to_pylist()[0] == 874965758


def test_movielens_normalised_csv(run_ingest):
    r = run_ingest(FIXTURES / "ml100k_items.csv", FIXTURES / "ml100k_interactions.csv",
                   "data.items.columns.attributes=[release_year]")
    r.check_accounting()
    assert r.facts["n_items"] == 12 and r.facts["n_users"] == 6
    # ml-100k has titles but no descriptions: '' not null.
    assert set(r.table("items").column("description").to_pylist()) == {""}
    u1 = [s for s in r.table("sequences").to_pylist() if s["user_id"] == "1"][0]
    # The latest two ratings of user 1 among the fixture's items (ts 887431973, 889751712).
    assert (u1["valid_item"], u1["test_item"]) == ("6", "5")


def test_plan_tasks_splits_large_parquet_by_row_groups(tmp_path):
    p = tmp_path / "big.parquet"
    pq.write_table(pa.table({"item_id": [str(i) for i in range(1000)], "title": ["t"] * 1000}), p,
                   row_group_size=100)
    tasks = plan_tasks([str(p)], "auto", rows_per_task=300)
    assert [t.first_row for t in tasks] == [0, 300, 600, 900]
    rows = []
    for t in tasks:
        for batch, first in adapters.iter_task(t, "items", ItemColumns(), batch_rows=64):
            rows.extend(batch["item_id"])
    assert [r.decode() for r in rows] == [str(i) for i in range(1000)]


def test_iter_task_refuses_unknown_and_misused_formats(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"item_id": "1"}\n')
    with pytest.raises(DataError, match="unknown format 'xml'"):
        list(adapters.iter_task(ReadTask(str(p), "xml"), "items", ItemColumns()))
    with pytest.raises(DataError, match="format 'amazon' is for item metadata"):
        list(adapters.iter_task(ReadTask(str(p), "amazon"), "interactions", InteractionColumns()))


def test_check_header_reads_only_what_it_needs(tmp_path):
    csv = tmp_path / "items.csv"
    csv.write_text("item_id,title\n1,a\n")
    task = plan_tasks([str(csv)], "auto")[0]
    assert adapters.check_header(task, "items", ItemColumns()) == ["description", "category", "brand"]
    with pytest.raises(DataError, match="missing column 'ts'"):
        adapters.check_header(task, "interactions", InteractionColumns(user="title"))
    jl = tmp_path / "inter.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in INTER))
    assert adapters.check_header(ReadTask(str(jl), "jsonl"), "interactions", InteractionColumns()) == []
    # only unparseable lines, or a layout checked while it is read: nothing to check up front
    (tmp_path / "bad.jsonl").write_text("nope\n")
    assert adapters.check_header(ReadTask(str(tmp_path / "bad.jsonl"), "jsonl"), "items", ItemColumns()) == []
    assert adapters.check_header(ReadTask(str(jl), "amazon"), "items", ItemColumns()) == []
