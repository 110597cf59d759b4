"""Tests of gti/diagnostics/runs.py: values read out of run records (metrics, exact ranks,
per-user values)."""

from __future__ import annotations

import pytest

from gti.diagnostics import runs as R


def _rec(arm="gti", seed=0, **metrics):
    return R.RunRecord(arm=arm, seed=seed, metrics=metrics)


def test_ordered_arms_keep_first_seen_order():
    recs = [_rec("b"), _rec("a"), _rec("b", 1), _rec("c")]
    assert R._ordered_arms(recs) == ["b", "a", "c"]


def test_rank_values_mrr_and_percentile():
    assert R._rank_values([1, 4, None, 0], "mrr", None) == [1.0, 0.25, None, None]
    assert R._rank_values([1, 11], "mean_percentile_rank", 21) == [0.0, 0.5]
    assert R._rank_values([1], "mean_percentile_rank", 1) == [0.0]
    assert R._rank_values([3], "mean_percentile_rank", None) == [None]


def test_n_items_from_ranks_or_the_cold_slice_definition():
    assert R._n_items(_rec(ranks={"test": {"n_items": 50}}), "test") == 50
    assert R._n_items(_rec(slices={"cold": {"definition": {"n_items": 9}}}), "test") == 9
    assert R._n_items(_rec(ranks={"test": {"n_items": 0}}), "test") is None


def test_per_user_values_and_their_mean_over_seeds():
    pu = {"test": {"user_ids": ["a", "b", "c"], "recall@10": [1.0, 0.0, None], "exact_rank": [1, 2, 5]}}
    rec = _rec(per_user=pu, ranks={"test": {"n_items": 5}})
    assert R._per_user(rec, "test", "recall@10") == {"a": 1.0, "b": 0.0}
    assert R._per_user(rec, "test", "mrr") == {"a": 1.0, "b": 0.5, "c": 0.2}
    assert R._per_user(rec, "test", "mean_percentile_rank") == {"a": 0.0, "b": 0.25, "c": 1.0}
    assert R._per_user(rec, "test", "ndcg@5") is None and R._per_user(rec, "valid", "recall@10") is None
    bad = _rec(per_user={"test": {"user_ids": ["a"], "recall@10": [1.0, 0.0]}})
    assert R._per_user(bad, "test", "recall@10") is None  # lengths disagree
    other = _rec(seed=1, per_user={"test": {"user_ids": ["b", "a"], "recall@10": [1.0, 0.0]}})
    assert R._user_means([rec, other], "test", "recall@10") == {"a": 0.5, "b": 0.5}
    assert R._user_means([rec, bad], "test", "recall@10") is None


def test_metric_names_and_values_of_a_split():
    a = _rec(splits={"test": {"recall@10": {"value": 0.2, "ci": [0.1, 0.3]}}}, invalid_sid_rate=0.01,
             ranks={"test": {"mrr": {"value": 0.4}}})
    b = _rec(seed=1, splits={"test": {"recall@10": 0.3, "ndcg@5": 0.1}},
             per_user={"test": {"user_ids": ["u", "v"], "exact_rank": [1, 4]}})
    assert R.metric_names([a, b], "test") == ["recall@10", "ndcg@5", "mrr", "invalid_sid_rate"]
    assert R._values([a, b], "test", "recall@10") == ([0.2, 0.3], [(0.1, 0.3), None])
    # mrr of b: no ranks block, so the mean of its per-user 1/rank
    assert R._values([a, b], "test", "mrr") == ([0.4, pytest.approx(0.625)], [None, None])
    assert R._values([a, b], "test", "invalid_sid_rate") == ([0.01, None], [None, None])
