"""gti.data.dense: the top-N items by interactions and the users with >= M interactions on them."""

from __future__ import annotations

import json

import polars as pl
import pytest

from gti import cli
from gti.data.dense import dense_subset
from gti.errors import DataError


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
