"""`gti data inspect`: format detection, column profile, mapping guess, quarantine dry run, and a
written data: block that `gti config validate` accepts and ingest reads, on every adapter's
fixtures and on a CSV whose columns are named unlike gti's."""

from __future__ import annotations

import csv
import json
import shutil

import pytest
import yaml

from gti import cli, config
from gti.run import pipeline
from gti.run.contract import StageContext
from gti.data import inspect as I
from gti.stages import ingest
from gti.data.batches import local_stream

from .conftest import FIXTURES


def _inspect(capsys, out, *args):
    rc = cli.main(["data", "inspect", *map(str, args), "--out", str(out)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _validate_and_ingest(capsys, tmp_path, out):
    assert cli.main(["config", "validate", "--config", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"{out}: OK"
    cfg = config.load(out, [f"run_dir={tmp_path / 'run'}"])
    work = tmp_path / "ingest-work"
    work.mkdir()
    ctx = StageContext(spec=pipeline.spec("ingest"), cfg=cfg, run_dir=tmp_path, work_dir=work,
                       fingerprint="test")
    return ingest.ingest(ctx, local_stream).facts


def _write_csv(path, rows):
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def test_renamed_csv_columns_are_mapped_dry_run_matches_ingest(tmp_path, capsys):
    items = _write_csv(tmp_path / "catalog.csv", [
        {"sku": "A1", "product_name": "Glass beaker", "summary": "250 ml", "dept": "Lab", "maker": "Pyrex", "price": "3.5"},
        {"sku": "A2", "product_name": "Gloves", "summary": "", "dept": "Safety", "maker": "", "price": "1"},
        {"sku": "A3", "product_name": "Caliper", "summary": "6 inch", "dept": "Tools", "maker": "Mitutoyo", "price": "9"},
        {"sku": "", "product_name": "No id", "summary": "", "dept": "", "maker": "", "price": ""},
        {"sku": "A4", "product_name": "", "summary": "", "dept": "", "maker": "", "price": "2"},
        {"sku": "A1", "product_name": "Again", "summary": "", "dept": "", "maker": "", "price": ""},
    ])
    inter = _write_csv(tmp_path / "events.csv", [
        {"customer_id": c, "sku": s, "event_time": str(1_700_000_000 + 60 * i)}
        for i, (c, s) in enumerate([("c1", "A1"), ("c1", "A2"), ("c1", "A3"), ("c2", "A3"), ("c2", "A1"),
                                    ("c2", "A2"), ("c2", "ZZ"), ("c3", "A1")])
    ])
    out = tmp_path / "data.yaml"
    rc, text, err = _inspect(capsys, out, items, "--interactions", inter)
    assert rc == 0, err
    block = yaml.safe_load(out.read_text())["data"]
    assert block["items"]["columns"] == {"id": "sku", "title": "product_name", "description": "summary",
                                         "category": "dept", "attributes": ["maker"]}
    assert block["interactions"]["columns"] == {"user": "customer_id", "item": "sku", "ts": "event_time"}
    assert block["items"]["format"] == "csv"
    # Profile: type, nulls and examples per column.
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("summary"))
    assert line.split()[1:3] == ["string", "4"] and "250 ml | 6 inch" in line
    assert "dry run (items, 6 rows): 3 ok, 3 would be quarantined (missing_id 1, no_text 1, duplicate_id 1)" in text
    assert "dry run (interactions, 8 rows): 6 ok, 2 would be quarantined (unknown_item 1, short_sequence 1)" in text
    facts = _validate_and_ingest(capsys, tmp_path, out)
    assert facts["items_quarantine_reasons"] == {"missing_id": 1, "no_text": 1, "duplicate_id": 1}
    assert facts["interactions_quarantine_reasons"] == {"unknown_item": 1, "short_sequence": 1}
    assert facts["n_users"] == 2


def test_interactions_without_a_time_column_get_ts_null(tmp_path, capsys):
    items = _write_csv(tmp_path / "items.csv", [{"id": str(i), "name": f"item {i}"} for i in range(4)])
    inter = _write_csv(tmp_path / "log.csv", [{"user": "u", "item": str(i % 4)} for i in range(5)])
    out = tmp_path / "d.yaml"
    rc, text, _ = _inspect(capsys, out, items, "--interactions", inter)
    assert rc == 0
    assert yaml.safe_load(out.read_text())["data"]["interactions"]["columns"] == {"user": "user", "item": "item", "ts": None}
    assert "ts: null (file order is time order)" in text
    facts = _validate_and_ingest(capsys, tmp_path, out)
    assert facts["n_users"] == 1


@pytest.mark.parametrize("items,inter,fmt", [
    ("amazon2023_meta.jsonl", "amazon2023_reviews.jsonl", "amazon2023"),
    ("u.item", "u.data", "movielens"),
    ("ml100k_items.csv", "ml100k_interactions.csv", "csv"),
    ("amazon_meta.jsonl", None, "amazon"),
])
def test_each_adapters_fixtures(tmp_path, capsys, items, inter, fmt):
    src = tmp_path / "in"
    src.mkdir()
    shutil.copy(FIXTURES / items, src / items)
    if inter is None:  # the 2014 metadata has no reviews fixture: interactions in a CSV
        inter = "inter.csv"
        _write_csv(src / inter, [{"user_id": "u", "item_id": f"B00{k}", "ts": str(k)} for k in (1, 2, 3, 4)])
    else:
        shutil.copy(FIXTURES / inter, src / inter)
    out = tmp_path / "data.yaml"
    rc, text, err = _inspect(capsys, out, src / items, "--interactions", src / inter)
    assert rc == 0, err
    block = yaml.safe_load(out.read_text())["data"]
    assert block["items"]["format"] == fmt
    assert f"items: {src / items} (format {fmt}" in text
    dry = next(ln for ln in text.splitlines() if ln.startswith("  dry run (items"))
    facts = _validate_and_ingest(capsys, tmp_path, out)
    assert f"{facts['items_rows_ok']} ok," in dry
    assert facts["n_items"] > 0 and facts["n_users"] >= 1


def test_sniffs_known_layouts_from_their_keys():
    assert I.sniff_format("m.jsonl", "items", [{"parent_asin": "P", "details": {}}]) == "amazon2023"
    assert I.sniff_format("r.jsonl", "interactions", [{"parent_asin": "P", "user_id": "u", "timestamp": 1}]) == "amazon2023"
    assert I.sniff_format("m.json", "items", [{"asin": "A", "related": {}}]) == "amazon"
    assert I.sniff_format("r.jsonl", "interactions", [{"reviewerID": "u", "asin": "A", "unixReviewTime": 1}]) == "jsonl"
    cols = I.profile([{"reviewerID": "u", "asin": "A", "unixReviewTime": 1400000000, "overall": 5}])
    assert I.guess_interaction_columns(cols, "jsonl") == {"user": "reviewerID", "item": "asin", "ts": "unixReviewTime"}
    # No time-like name: integers that look like Unix times are taken as ts.
    cols = I.profile([{"uid": "u", "iid": "i", "when": "1700000000"}])
    assert I.guess_interaction_columns(cols, "csv")["ts"] == "when"


def test_no_id_column_is_one_line_and_the_block_is_still_written(tmp_path, capsys):
    items = tmp_path / "x.jsonl"
    items.write_text(json.dumps({"label": "a", "words": "b"}) + "\n")
    out = tmp_path / "d.yaml"
    rc, _, err = _inspect(capsys, out, items)
    assert rc == 2
    assert err.strip() == (f"gti: error: {items}: no column looks like the item id (columns: label, words); "
                           "set data.items.columns.id in the written file")
    assert out.is_file()
    rc, _, err = _inspect(capsys, out, items)  # exists now
    assert rc == 2 and err.strip() == f"gti: error: {out}: exists; pass --out to write elsewhere or --force to replace it"


def test_sample_reports_whether_it_covered_the_files(tmp_path):
    from gti.config import ItemColumns

    items = _write_csv(tmp_path / "items.csv", [{"item_id": str(i), "title": f"t{i}"} for i in range(5)])
    for n, complete in ((3, False), (5, True), (9, True)):
        batches, whole = I._read_sample([str(items)], "csv", "items", ItemColumns(attributes=[]), n)
        assert whole is complete
        assert sum(len(raw["item_id"]) for _, raw, _ in batches) == min(n, 5)
