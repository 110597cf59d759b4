"""Fast tests (no Ray, no model) of gti/eval/slices.py, the evaluate stage's user slicing: the
evaluation prompts of a split, the seeded user sample, cold membership from SFT target counts
and the slice metric block (including 0 users). (Its tables and the MRR line:
tests/eval/test_tables.py.)"""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from gti.common.errors import ConfigError
from gti.eval import slices as S
from gti.eval.reference import baseline_rows, metric_block
from gti.train import sft_data

KS = [1, 2]
CATALOG = ["a", "b", "c", "d", "e"]


def _seqs() -> pl.DataFrame:
    # SFT targets (train_items[1:]): b x3, c x1; a and d only first items, e only held out.
    return pl.DataFrame({
        "user_id": ["u0", "u1", "u2", "u3"],
        "train_items": [["a", "b", "c"], ["a", "b"], ["d", "b"], ["c"]],
        "valid_item": ["d", "c", "e", "b"],
        "test_item": ["e", "a", "b", "e"],
    })


def _recs(frame: pl.DataFrame, ranks=None) -> pl.DataFrame:
    """Decoded rows as the actor returns them: every user gets the catalog in order."""
    n = frame.height
    return frame.select("user_id", "split", "target").with_columns(
        items=pl.Series([CATALOG] * n, dtype=pl.List(pl.Utf8)),
        exact_rank=pl.Series(ranks if ranks is not None else [None] * n, dtype=pl.Float64),
    )


def test_eval_windows_valid_and_test():
    seqs = pl.DataFrame(
        {"user_id": ["a"], "train_items": [["1", "2", "3", "4"]], "valid_item": ["5"], "test_item": ["6"]}
    )
    v = S.eval_windows(seqs, "valid", max_history=3)
    t = S.eval_windows(seqs, "test", max_history=3)
    assert v.row(0, named=True) == {"user_id": "a", "split": "valid", "history": ["2", "3", "4"], "target": "5",
                                    "pos": 4}
    assert t.row(0, named=True) == {"user_id": "a", "split": "test", "history": ["3", "4", "5"], "target": "6",
                                    "pos": 5}
    with pytest.raises(ConfigError, match="split"):
        S.eval_windows(seqs, "train", 3)


def test_eval_windows_of_the_time_split_are_every_period_item_with_all_before_it():
    """valid_items / test_items of the global time split: one row per item, its history the
    last max_history items before it (earlier items of its own period included); a target with
    nothing before it is no row."""
    seqs = pl.DataFrame({
        "user_id": ["a", "b", "c"], "train_items": [["1", "2", "3"], ["4"], []],
        "valid_item": [None] * 3, "test_item": [None] * 3,
        "valid_items": [["5"], [], []], "test_items": [["6", "7"], ["8"], ["9", "10"]],
    }, schema_overrides={"valid_item": pl.Utf8, "test_item": pl.Utf8})
    v = S.eval_windows(seqs, "valid", 2)
    assert v.select("user_id", "history", "target", "pos").rows() == [("a", ["2", "3"], "5", 3)]
    t = S.eval_windows(seqs, "test", 2)
    assert t.select("user_id", "history", "target", "pos").rows() == [
        ("a", ["3", "5"], "6", 4), ("a", ["5", "6"], "7", 5), ("b", ["4"], "8", 1), ("c", ["9"], "10", 1)]


def test_sample_users_deterministic():
    users = [f"u{i}" for i in range(100)]
    a = S.sample_users(users, 10, seed=0)
    assert a == S.sample_users(users, 10, seed=0)
    assert len(set(a)) == 10 and a != S.sample_users(users, 10, seed=1)
    assert S.sample_users(users, None, 0) == users
    assert S.sample_users(users, 1000, 0) == users


def test_cold_users_from_sft_counts():
    seqs = _seqs()
    counts = sft_data.sft_target_counts(seqs)
    assert counts == {"b": 3, "c": 1}
    valid = S.eval_windows(seqs, "valid", 5)  # targets d, c, e, b
    assert S.cold_users(valid, counts, 1) == [True, True, True, False]
    assert S.cold_users(valid, counts, 0) == [True, False, True, False]
    assert S.cold_users(valid, counts, 3) == [True] * 4
    test = S.eval_windows(seqs, "test", 5)  # targets e, a, b, e
    assert S.cold_users(test, counts, 0) == [True, True, False, True]
    assert S.cold_users(test.head(0), counts, 1) == []
    # Catalog items under the same definition: a, c, d, e are cold at <= 1 (b is not).
    assert S.n_cold_items(CATALOG, counts, 1) == 4
    assert S.n_cold_items(CATALOG, counts, 0) == 3


def test_cold_counts_ignore_valid_and_test_items():
    """Making an item the valid/test target of every user must not warm it up."""
    seqs = _seqs().with_columns(valid_item=pl.lit("e"), test_item=pl.lit("e"))
    counts = sft_data.sft_target_counts(seqs)
    assert "e" not in counts
    frame = S.eval_windows(seqs, "test", 5)
    assert S.cold_users(frame, counts, 0) == [True] * 4


def test_metric_and_rank_blocks_on_zero_users_do_not_crash():
    from gti.eval.rank import rank_metrics

    table, per_user = metric_block([], [], KS, 50, 0)
    assert set(table) == {f"{m}@{k}" for m in ("hr", "recall", "ndcg", "precision") for k in KS}
    assert all(c == {"value": 0.0, "ci": [0.0, 0.0]} for c in table.values())
    assert all(v == [] for v in per_user.values())
    r = rank_metrics(np.array([]), len(CATALOG), 50, 0)
    assert r["n_users"] == 0 and r["mrr"]["value"] == 0.0


@pytest.mark.parametrize("exact_rank", [False, True])
def test_slice_metrics_on_cold_users(exact_rank):
    seqs = _seqs()
    frame = S.eval_windows(seqs, "valid", 5)  # targets d, c, e, b
    ranks = [4.0, 3.0, 5.0, 2.0] if exact_rank else None
    part = _recs(frame, ranks)
    counts = sft_data.sft_target_counts(seqs)
    mask = pl.Series(S.cold_users(frame, counts, 1))
    got = S.slice_metrics(part.filter(mask), frame.filter(mask), seqs, "valid", KS, 50, 0, CATALOG, exact_rank)
    assert got["n_users"] == 3
    # The model ranks the catalog in order: cold targets d, c, e sit at ranks 4, 3, 5 -> no hit @2.
    assert got["model"]["recall@2"]["value"] == 0.0
    full, _ = metric_block(part["items"].to_list(), part["target"].to_list(), KS, 50, 0)
    assert full["recall@2"]["value"] == pytest.approx(0.25)  # only the warm user (target b) hits
    # Baselines: the same rows as on the full split, fitted on the split's training data.
    assert set(got["baselines"]) == {"mostpop", "markov"}
    want = baseline_rows(seqs, "valid", frame.filter(mask), KS, 50, 0, CATALOG)
    assert got["baselines"] == want
    if exact_rank:
        r = got["ranks"]
        assert r["n_users"] == 3 and r["n_items"] == 5
        assert r["mrr"]["value"] == pytest.approx(np.mean([1 / 4, 1 / 3, 1 / 5]))
        assert r["mean_percentile_rank"]["value"] == pytest.approx(np.mean([3 / 4, 2 / 4, 4 / 4]))
        assert r["median_rank"] == 4.0
    else:
        assert got["ranks"] == {}


def test_slice_metrics_with_no_cold_user_gives_empty_blocks():
    seqs = _seqs()
    frame = S.eval_windows(seqs, "valid", 5)
    none = pl.Series([False] * frame.height)
    got = S.slice_metrics(_recs(frame).filter(none), frame.filter(none), seqs, "valid", KS, 50, 0, CATALOG, True)
    assert got == {"n_users": 0, "n_rows": 0, "model": {}, "baselines": {"mostpop": {}, "markov": {}}, "ranks": {}}
