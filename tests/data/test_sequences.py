"""gti.data.sequences: chronological order, tie-breaking, leave-one-out, drops; the check of a
sequences table's columns."""

from __future__ import annotations

import polars as pl
import pytest

from gti.data.catalog import OUTSIDE_MAX_USERS, SHORT_SEQUENCE
from gti.data.sequences import build_sequences, check_sequences
from gti.errors import DataError


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
