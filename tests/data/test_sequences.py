"""gti.data.sequences: chronological order, tie-breaking, leave-one-out, drops; the check of a
sequences table's columns."""

from __future__ import annotations

import polars as pl
import pytest

from gti.data.catalog import OUTSIDE_MAX_USERS, SHORT_SEQUENCE
from gti.data.schemas import SEQ_SCHEMA
from gti.data.sequences import build_sequences, check_sequences, split_lists
from gti.common.errors import DataError


def _df(rows):
    return pl.DataFrame(
        {"user_id": [r[0] for r in rows], "item_id": [r[1] for r in rows], "ts": [r[2] for r in rows],
         "order": list(range(len(rows)))},
        schema={"user_id": pl.String, "item_id": pl.String, "ts": pl.Int64, "order": pl.Int64},
    )


ROWS = [
    ("u2", "a", 5), ("u1", "x", 30), ("u1", "y", 10), ("u2", "b", 5), ("u2", "c", 1),
    ("u1", "z", 20), ("u3", "q", 1), ("u1", "w", 40), ("u2", "d", 9),
]


def test_chronological_with_ties_in_file_order_and_leave_one_out():
    res = build_sequences(_df(ROWS), min_seq_len=3)
    seq = {r["user_id"]: r for r in res.sequences.iter_rows(named=True)}
    # u2: c(1), then a and b tie at ts 5 -> file order a, b; then d(9).
    assert seq["u2"]["train_items"] == ["c", "a"]
    assert (seq["u2"]["valid_item"], seq["u2"]["test_item"]) == ("b", "d")
    assert seq["u1"]["train_items"] == ["y", "z"] and seq["u1"]["test_item"] == "w"
    # Users in order of first appearance; u3 (1 interaction) dropped as short.
    assert res.sequences["user_id"].to_list() == ["u2", "u1"]
    assert res.dropped["reason"].to_list() == [SHORT_SEQUENCE]
    assert res.interactions.height + res.dropped.height == len(ROWS)


def test_deterministic_under_row_shuffle_with_same_order_column():
    df = _df(ROWS)
    a = build_sequences(df, 3)
    b = build_sequences(df.sample(fraction=1.0, shuffle=True, seed=3), 3)
    assert a.sequences.equals(b.sequences)
    assert a.interactions.equals(b.interactions)


def test_no_leakage_positional_even_with_repeats():
    rows = [("u", "a", 1), ("u", "b", 2), ("u", "a", 3), ("u", "b", 4), ("u", "c", 5)]
    s = build_sequences(_df(rows), 3).sequences.row(0, named=True)
    # The held-out interactions are the last two; "b" repeats earlier and legitimately stays in train.
    assert s["train_items"] == ["a", "b", "a"] and (s["valid_item"], s["test_item"]) == ("b", "c")


def test_min_seq_len_and_max_users():
    rows = [(u, f"i{k}", k) for u in ["u1", "u2", "u3", "u4"] for k in range(4)] + [("u5", "i0", 0)]
    res = build_sequences(_df(rows), min_seq_len=4, max_users=2)
    assert res.sequences["user_id"].to_list() == ["u1", "u2"]
    reasons = res.dropped.group_by("reason").len().sort("reason")
    assert dict(zip(reasons["reason"], reasons["len"])) == {OUTSIDE_MAX_USERS: 8, SHORT_SEQUENCE: 1}
    # min_seq_len below 3 is raised to 3: leave-one-out needs a training item.
    assert build_sequences(_df(rows), min_seq_len=1).min_seq_len == 3


def test_check_sequences_names_the_missing_columns_and_the_file():
    ok = pl.DataFrame({"user_id": ["a"], "train_items": [["1"]], "valid_item": ["2"], "test_item": ["3"]})
    check_sequences(ok)
    with pytest.raises(DataError, match=r"s\.parquet: missing column\(s\) \['valid_item', 'test_item'\]"):
        check_sequences(ok.drop("valid_item", "test_item"), "s.parquet")


# --------------------------------------------------------------------------- global time split
def test_global_time_cuts_all_interactions_8_1_1_by_time_ties_in_file_order():
    # 20 interactions: train = the first int(20 * .8) = 16 by (ts, file order), valid the next 2.
    rows = [("a", f"a{i}", i) for i in range(8)] + [("b", f"b{i}", i) for i in range(8)]
    rows += [("a", "a8", 8), ("b", "b8", 8), ("b", "b9", 8), ("a", "a9", 9)]  # a tie at ts 8 across the cut
    res = build_sequences(_df(rows), 2, None, "global_time")
    s = {r["user_id"]: r for r in res.sequences.iter_rows(named=True)}
    assert s["a"]["train_items"] == [f"a{i}" for i in range(8)] and s["b"]["train_items"] == [f"b{i}" for i in range(8)]
    assert s["a"]["valid_items"] == ["a8"] and s["b"]["valid_items"] == ["b8"]  # file order breaks the ts-8 tie
    assert s["a"]["test_items"] == ["a9"] and s["b"]["test_items"] == ["b9"]
    assert s["a"]["valid_item"] is None and s["a"]["test_item"] is None
    assert res.split == {"name": "global_time", "by": "position", "ratios": [8.0, 1.0, 1.0],
                         "cut_positions": [16, 18], "cut_ts": [8, 8],
                         "interactions": {"train": 16, "valid": 2, "test": 2}}
    assert res.sequences.columns == SEQ_SCHEMA.names
    # The same rows in another file order (the order column follows them): the same split.
    again = build_sequences(_df(rows).sample(fraction=1.0, shuffle=True, seed=1), 2, None, "global_time")
    assert again.sequences.sort("user_id").equals(res.sequences.sort("user_id"))


def test_given_periods_keep_ties_on_a_cut_and_new_rows_go_by_the_cut_timestamps():
    # The position cut of the tie test above, re-split by its recorded cut_ts (8, 8: b9 opens
    # the test period at ts 8) as a refresh does: rows carrying their period keep it (a8 and b8,
    # valid at ts 8, which the timestamps alone would move to test), new rows go by timestamp.
    rows = [("a", f"a{i}", i) for i in range(8)] + [("b", f"b{i}", i) for i in range(8)]
    rows += [("a", "a8", 8), ("b", "b8", 8), ("b", "b9", 8), ("a", "a9", 9)]
    first = build_sequences(_df(rows), 2, None, "global_time")
    cuts = tuple(first.split["cut_ts"])
    old = first.interactions.join(  # each kept row's period, as the first split made it
        first.sequences.select("user_id", pl.concat_list("valid_items", "test_items").alias("_held"),
                               pl.col("test_items").alias("_test")), on="user_id", how="left"
    ).select("user_id", "item_id", "ts", period=pl.when(pl.col("item_id").is_in(pl.col("_test"))).then(2)
             .when(pl.col("item_id").is_in(pl.col("_held"))).then(1).otherwise(0).cast(pl.Int8))
    new = pl.DataFrame({"user_id": ["a", "b", "c", "c"], "item_id": ["n_early", "n_tie", "n_c1", "n_c2"],
                        "ts": [3, 8, 2, 20]}, schema={"user_id": pl.String, "item_id": pl.String, "ts": pl.Int64})
    merged = pl.concat([old, new], how="diagonal_relaxed").with_columns(order=pl.int_range(0, pl.len()))
    res = build_sequences(merged, 2, None, "global_time", cuts=cuts)
    s = {r["user_id"]: r for r in res.sequences.iter_rows(named=True)}
    assert s["a"]["train_items"] == ["a0", "a1", "a2", "a3", "n_early", "a4", "a5", "a6", "a7"]
    assert (s["a"]["valid_items"], s["a"]["test_items"]) == (["a8"], ["a9"])
    assert (s["b"]["valid_items"], s["b"]["test_items"]) == (["b8"], ["b9", "n_tie"])
    assert (s["c"]["train_items"], s["c"]["valid_items"], s["c"]["test_items"]) == (["n_c1"], [], ["n_c2"])
    assert res.split["cut_ts"] == [8, 8]
    # Without the periods the timestamps alone would move a8 and b8 (ts 8) from valid to test.
    with pytest.raises(DataError, match=r"the valid period\(s\) of the 24 kept"):
        build_sequences(merged.drop("period"), 2, None, "global_time", cuts=cuts)


def test_global_time_a_users_periods_follow_each_other_and_short_users_go():
    rows = [("u", "x", 1), ("v", "y", 2), ("v", "z", 3), ("v", "w", 30), ("u", "q", 40), ("u", "r", 50)]
    res = build_sequences(_df(rows), 2, None, "global_time", ratios=(1, 1, 1))
    s = {r["user_id"]: r for r in res.sequences.iter_rows(named=True)}
    assert (s["u"]["train_items"], s["u"]["valid_items"], s["u"]["test_items"]) == (["x"], [], ["q", "r"])
    assert (s["v"]["train_items"], s["v"]["valid_items"], s["v"]["test_items"]) == (["y"], ["z", "w"], [])
    short = build_sequences(_df(rows + [("lone", "x", 5)]), 2, None, "global_time", ratios=(1, 1, 1))
    assert short.dropped["reason"].to_list() == [SHORT_SEQUENCE]
    # Leave-one-out still needs 3 items; global_time 2.
    assert build_sequences(_df(rows), 1, None).min_seq_len == 3
    assert build_sequences(_df(rows), 1, None, "global_time").min_seq_len == 2


def test_global_time_by_given_cut_timestamps_and_empty_periods_are_named():
    rows = [("u", "a", 0), ("u", "b", 1), ("u", "c", 4), ("u", "d", 6)]
    res = build_sequences(_df(rows), 2, None, "global_time", cuts=(4, 6))
    r = res.sequences.row(0, named=True)
    assert (r["train_items"], r["valid_items"], r["test_items"]) == (["a", "b"], ["c"], ["d"])
    assert res.split["by"] == "timestamp" and res.split["cut_ts"] == [4, 6]
    with pytest.raises(DataError, match=r"data.split=global_time: the valid period\(s\) of the 4 kept"):
        build_sequences(_df(rows), 2, None, "global_time", cuts=(4, 4))
    with pytest.raises(DataError, match="data.split must be one of"):
        build_sequences(_df(rows), 2, None, "random")


def test_split_lists_fills_the_lists_of_an_older_table():
    old = pl.DataFrame({"user_id": ["u"], "train_items": [["a"]], "valid_item": ["b"], "test_item": ["c"]})
    got = split_lists(old).row(0, named=True)
    assert (got["valid_items"], got["test_items"]) == (["b"], ["c"])
    loo = build_sequences(_df([("u", "a", 0), ("u", "b", 1), ("u", "c", 2)]), 3).sequences.row(0, named=True)
    assert (loo["valid_item"], loo["valid_items"], loo["test_items"]) == ("b", ["b"], ["c"])
