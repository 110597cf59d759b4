"""gti.data.holdout: a slice of items held out as 'new' for the refresh measurement."""

from __future__ import annotations

import polars as pl

from gti.data.holdout import holdout_new_items, new_target_users


def _tables():
    # 6 users; each history ends on a different item, items 0..7.
    rows = [(f"u{u}", f"i{(u + j) % 8}", j) for u in range(6) for j in range(4)]
    inter = pl.DataFrame(rows, schema=["user_id", "item_id", "ts"], orient="row")
    items = pl.DataFrame({"item_id": [f"i{n}" for n in range(8)], "title": [f"t{n}" for n in range(8)]})
    return items, inter


def test_holdout_splits_items_and_interactions_without_loss():
    items, inter = _tables()
    h = holdout_new_items(items, inter, 2, seed=0)
    assert len(h.new_ids) == 2 and set(h.new_items["item_id"]) == set(h.new_ids)
    assert not h.base_items["item_id"].is_in(h.new_ids).any()
    assert not h.base_interactions["item_id"].is_in(h.new_ids).any()
    assert h.new_interactions["item_id"].is_in(h.new_ids).all()
    assert h.base_interactions.height + h.new_interactions.height == inter.height
    assert holdout_new_items(items, inter, 2, seed=0).new_ids == h.new_ids  # seeded


def test_new_target_users_are_those_whose_test_item_is_new():
    seqs = pl.DataFrame({"user_id": ["a", "b"], "train_items": [["x"], ["y"]], "valid_item": ["x", "y"],
                         "test_item": ["n1", "zz"]})
    assert new_target_users(seqs, ["n1"])["user_id"].to_list() == ["a"]
