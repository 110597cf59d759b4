"""gti.data.dense: the top-N items by interactions and the users with >= M interactions on them,
as `gti data dense` writes it and as the ingest stage cuts it from `data.dense`."""

from __future__ import annotations

import json

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gti import cli
from gti.data.catalog import OUTSIDE_DENSE
from gti.data.dense import cut_interactions, dense_subset, quarantine_items
from gti.common.errors import DataError


def _data():
    items = pl.DataFrame({"item_id": ["a", "b", "c", "d"], "title": ["A", "B", "C", "D"]})
    inter = pl.DataFrame({
        "user_id": ["u1"] * 4 + ["u2"] * 3 + ["u3"] * 2 + ["u4"] * 3,
        "item_id": ["a", "b", "a", "c", "a", "b", "d", "b", "a", "c", "c", "d"],
        "ts": list(range(12)),
    })
    return items, inter


def test_top_items_then_active_users_until_both_hold():
    items, inter = _data()
    # Counts: a 4, b 3, c 3, d 2 -> top 2 = a, b (b before c by catalog order on the tie).
    sub_items, sub_inter = dense_subset(items, inter, n_items=2, min_user_len=2)
    assert sub_items["item_id"].to_list() == ["a", "b"]
    assert set(sub_inter["item_id"]) <= {"a", "b"}
    lens = dict(sub_inter.group_by("user_id").len().iter_rows())
    assert lens == {"u1": 3, "u2": 2, "u3": 2}  # u4 has no a/b interaction
    assert sub_inter["ts"].to_list() == sorted(sub_inter["ts"].to_list())  # input order kept


def test_dropping_users_can_drop_items_and_nothing_short_remains():
    items, inter = _data()
    sub_items, sub_inter = dense_subset(items, inter, n_items=4, min_user_len=3)
    lens = sub_inter.group_by("user_id").len()["len"]
    assert lens.min() >= 3
    assert set(sub_items["item_id"]) == set(sub_inter["item_id"])


def test_bad_arguments_and_columns_are_named():
    items, inter = _data()
    with pytest.raises(DataError, match="--items"):
        dense_subset(items, inter, 0, 2)
    with pytest.raises(DataError, match="interactions: missing column"):
        dense_subset(items, inter.drop("user_id"), 2, 2)


def test_cli_on_the_bundled_data(tmp_path):
    out = tmp_path / "dense"
    assert cli.main(["data", "dense", "--items", "200", "--min-user-len", "5", "--out", str(out)]) == 0
    info = json.loads((out / "dense.json").read_text())
    inter = pl.read_parquet(out / "interactions.parquet")
    assert info["interactions"] == inter.height and info["items"] <= 200
    assert inter.group_by("user_id").len()["len"].min() >= 5
    assert pl.read_parquet(out / "items.parquet").height == info["items"]


# --------------------------------------------------------------------------- in the pipeline (data.dense)
def test_cut_interactions_keeps_dense_subsets_rows_and_tags_the_rest():
    items, inter = _data()
    cut = cut_interactions(items["item_id"].to_list(), inter, top_items=2, min_user_len=2)
    _, expected = dense_subset(items, inter, n_items=2, min_user_len=2)
    assert cut.interactions.equals(expected)
    assert cut.items == ["a", "b"]
    assert cut.interactions.height + cut.dropped.height == inter.height
    assert cut.dropped["ts"].to_list() == sorted(cut.dropped["ts"].to_list())  # input order
    assert set(cut.dropped["reason"]) == {OUTSIDE_DENSE}
    # Rows of c and d (outside the top 2) say item_id; no a/b row drops at min_user_len 2.
    assert dict(zip(cut.dropped["item_id"], cut.dropped["detail"])) == {"c": "item_id", "d": "item_id"}
    assert cut.facts == {"top_items": 2, "min_user_len": 2, "items_before": 4, "items_after": 2,
                         "users_before": 4, "users_after": 3, "interactions_before": 12, "interactions_after": 7}
    # A user cut for too few rows on the subset's items: their kept-item rows say user_id.
    short = cut_interactions(items["item_id"].to_list(), inter, top_items=2, min_user_len=3)
    assert set(short.dropped.filter(pl.col("item_id").is_in(["a", "b"]))["detail"]) == {"user_id"}


def test_quarantine_items_moves_the_other_items_with_their_text(tmp_path):
    from gti.data.schemas import ITEMS_OUT_SCHEMA, ITEMS_Q_SCHEMA

    rows = {"item_id": ["a", "b", "c"], "title": ["A", "B", "C"], "description": [None, "bee", None],
            "category": ["x", "y", "z"], "attributes_text": ["", "", ""], "text_is_pseudo": [False] * 3}
    pq.write_table(pa.table(rows).cast(ITEMS_OUT_SCHEMA), tmp_path / "items.parquet")
    earlier = {"source_file": ["f"], "source_row": [7], "item_id": [None], "reason": ["missing_id"],
               "detail": ["id"], "raw": ["{}"]}  # a row the items pass quarantined
    pq.write_table(pa.table(earlier).cast(ITEMS_Q_SCHEMA), tmp_path / "items_quarantine.parquet")
    assert quarantine_items(tmp_path, ["c", "a"]) == 1
    assert pq.read_table(tmp_path / "items.parquet").column("item_id").to_pylist() == ["a", "c"]  # order kept
    q = pq.read_table(tmp_path / "items_quarantine.parquet")
    assert q.schema == ITEMS_Q_SCHEMA and q.column("reason").to_pylist() == ["missing_id", OUTSIDE_DENSE]
    moved = q.slice(1).to_pylist()[0]
    assert moved["item_id"] == "b" and moved["detail"] == "item_id" and moved["source_row"] is None
    assert json.loads(moved["raw"])["description"] == "bee"
    assert quarantine_items(tmp_path, ["a", "c"]) == 0  # nothing left to move: files untouched


def _ingest(tmp_path, cfg, name):
    from gti.run import pipeline
    from gti.run.contract import StageContext
    from gti.stages import ingest
    from gti.data.batches import local_stream

    work = tmp_path / name
    work.mkdir()
    ctx = StageContext(spec=pipeline.spec("ingest"), cfg=cfg, run_dir=tmp_path, work_dir=work, fingerprint="t")
    return ingest.ingest(ctx, local_stream).facts, work


def test_a_run_config_with_dense_keys_builds_the_subset_in_ingest(tmp_path):
    """The config keys alone (no `gti data dense` step) give the subset `gti data dense` writes
    (on the bundled data, whose rows are all valid); what is left out is quarantined, counted,
    and the subset is part of the ingest fingerprint."""
    from gti import config
    from gti.run import pipeline
    from gti.data import bundled

    conf = tmp_path / "dense.yaml"
    conf.write_text(f"run_dir: {tmp_path / 'run'}\n"
                    "data:\n  items: {path: 'bundled:amazon-scientific'}\n"
                    "  interactions: {path: 'bundled:amazon-scientific'}\n"
                    "  dense: {top_items: 300, min_user_len: 4}\n")
    cfg = config.load(conf)
    assert (cfg.data.dense.top_items, cfg.data.dense.min_user_len) == (300, 4)
    facts, work = _ingest(tmp_path, cfg, "work")

    raw_items = pl.read_parquet(bundled.resolve("bundled:amazon-scientific", "items"))
    raw_inter = pl.read_parquet(bundled.resolve("bundled:amazon-scientific", "interactions"))
    want_items, want_inter = dense_subset(raw_items, raw_inter, 300, 4)
    items = pl.read_parquet(work / "items.parquet")
    inter = pl.read_parquet(work / "interactions.parquet")
    assert items["item_id"].to_list() == want_items["item_id"].cast(pl.Utf8).to_list()
    assert inter.height == want_inter.height and inter["user_id"].n_unique() == want_inter["user_id"].n_unique()
    assert facts["n_items"] == items.height and facts["n_users"] == inter["user_id"].n_unique()
    dense = facts["dense"]
    assert dense["items_before"] == raw_items.height and dense["items_after"] == items.height
    assert dense["users_before"] == raw_inter["user_id"].n_unique() and dense["users_after"] == facts["n_users"]
    assert dense["interactions_before"] == raw_inter.height and dense["interactions_after"] == inter.height
    # Every row is accounted for: ok + quarantined (outside_dense) = read.
    assert facts["items_rows_in"] == facts["items_rows_ok"] + facts["items_rows_quarantined"]
    assert facts["interactions_rows_in"] == facts["interactions_rows_ok"] + facts["interactions_rows_quarantined"]
    assert facts["items_quarantine_reasons"][OUTSIDE_DENSE] == raw_items.height - items.height
    assert facts["interactions_quarantine_reasons"][OUTSIDE_DENSE] == raw_inter.height - inter.height
    assert pl.read_parquet(work / "items_quarantine.parquet").height == raw_items.height - items.height
    assert {"items_s", "interactions_s", "dense_items_s", "total_s"} <= set(facts["timing"])

    off = config.load(conf, ["data.dense.top_items=null"])
    fp = {c.data.dense.top_items: pipeline.fingerprint(pipeline.spec("ingest"), c, tmp_path)[0] for c in (cfg, off)}
    other = config.load(conf, ["data.dense.min_user_len=5"])
    assert len({*fp.values(), pipeline.fingerprint(pipeline.spec("ingest"), other, tmp_path)[0]}) == 3


def test_the_demo_config_builds_its_dense_subset_from_the_bundled_data():
    """jobs/configs/demo.yaml (what `make demo` runs) loads, asks ingest for a dense subset, and
    that subset of the bundled data is what the demo's figures in bench/RESULTS.md were measured
    on: 1,000 items, 2,559 users, every kept user with >= 5 interactions on those items."""
    from pathlib import Path

    from gti import config
    from gti.data import bundled

    root = Path(__file__).resolve().parents[2]
    cfg = config.load(root / "jobs" / "configs" / "demo.yaml")
    assert cfg.data.dense.top_items == 1000 and cfg.data.dense.min_user_len == 5
    assert cfg.model.name == "smollm2-135m" and cfg.init.method == "mean" and cfg.ground.steps > 0
    items = pl.read_parquet(bundled.resolve(cfg.data.items.path, "items"))
    inter = pl.read_parquet(bundled.resolve(cfg.data.interactions.path, "interactions"))
    cut = cut_interactions(items["item_id"].cast(pl.Utf8).to_list(), inter,
                           cfg.data.dense.top_items, cfg.data.dense.min_user_len)
    assert len(cut.items) == 1000
    per_user = cut.interactions.group_by("user_id").len()
    assert per_user.height == 2559 and per_user["len"].min() >= 5
    assert cut.interactions.height + cut.dropped.height == inter.height  # nothing lost: the rest is quarantined
