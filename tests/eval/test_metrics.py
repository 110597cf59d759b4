"""Metrics (gti/eval/metrics.py) against hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gti.eval import metrics as M

RANKED = [["a", "b", "c", "d"], ["x", "y"], ["p", "q", "r", "s"], ["t", "t", "u"]]
TARGETS = ["c", "z", "p", "u"]  # ranks: 2, absent, 0, 2 (the repeated "t" still takes rank 1)


def test_target_ranks():
    assert M.target_ranks(RANKED, TARGETS).tolist() == [2, -1, 0, 2]


def test_single_target_hand_computed():
    np.testing.assert_allclose(M.recall_at_k(RANKED, TARGETS, 1), [0, 0, 1, 0])
    np.testing.assert_allclose(M.recall_at_k(RANKED, TARGETS, 3), [1, 0, 1, 1])
    np.testing.assert_allclose(M.precision_at_k(RANKED, TARGETS, 3), [1 / 3, 0, 1 / 3, 1 / 3])
    np.testing.assert_allclose(M.ndcg_at_k(RANKED, TARGETS, 3), [0.5, 0, 1.0, 0.5])  # 1/log2(4)=.5
    np.testing.assert_allclose(M.ndcg_at_k(RANKED, TARGETS, 2), [0, 0, 1.0, 0])
    # K past the list length: a short list is not an error, just fewer hits.
    np.testing.assert_allclose(M.recall_at_k(RANKED, TARGETS, 50), [1, 0, 1, 1])
    np.testing.assert_allclose(M.precision_at_k(RANKED, TARGETS, 50), [0.02, 0, 0.02, 0.02])
    with pytest.raises(ValueError, match="K must be"):
        M.recall_at_k(RANKED, TARGETS, 0)
    with pytest.raises(ValueError, match="ranked lists"):
        M.recall_at_k(RANKED[:2], TARGETS, 1)


def test_graded_hand_computed():
    ranked = [["a", "b", "c", "d"], ["e", "f"]]
    rel = [{"b": 2, "d": 1, "z": 3}, {"q": 1}]
    # User 0: relevant {b, d, z}; top 4 holds b (rank 1) and d (rank 3).
    np.testing.assert_allclose(M.graded_recall_at_k(ranked, rel, 4), [2 / 3, 0])
    np.testing.assert_allclose(M.graded_precision_at_k(ranked, rel, 4), [0.5, 0])
    dcg = (2**2 - 1) / math.log2(3) + (2**1 - 1) / math.log2(5)
    idcg = (2**3 - 1) / 1 + (2**2 - 1) / math.log2(3) + (2**1 - 1) / 2
    np.testing.assert_allclose(M.graded_ndcg_at_k(ranked, rel, 4), [dcg / idcg, 0])
    lin = (2 / math.log2(3) + 1 / math.log2(5)) / (3 + 2 / math.log2(3) + 1 / 2)
    np.testing.assert_allclose(M.graded_ndcg_at_k(ranked, rel, 4, gain="linear"), [lin, 0])
    # K=2: ideal DCG uses only the 2 best grades.
    np.testing.assert_allclose(
        M.graded_ndcg_at_k(ranked, rel, 2), [(3 / math.log2(3)) / (7 + 3 / math.log2(3)), 0]
    )


def test_graded_with_one_item_equals_single_target():
    rel = [{t: 1} for t in TARGETS]
    for k in (1, 2, 3, 10):
        single = M.per_user_metrics(RANKED, TARGETS, [k])
        graded = M.per_user_metrics(RANKED, ks=[k], relevance=rel)
        for name in single:
            np.testing.assert_allclose(single[name], graded[name], err_msg=name)


def test_per_user_metrics_keys_and_errors():
    pu = M.per_user_metrics(RANKED, TARGETS, [1, 3])
    assert list(pu) == ["recall@1", "recall@3", "ndcg@1", "ndcg@3", "precision@1", "precision@3"]
    assert all(v.shape == (4,) for v in pu.values())
    with pytest.raises(ValueError, match="exactly one"):
        M.per_user_metrics(RANKED, TARGETS, [1], relevance=[{}] * 4)
    with pytest.raises(ValueError, match="unknown metric"):
        M.per_user_metrics(RANKED, TARGETS, [1], metrics=["mrr"])


def test_bootstrap_ci_seeded_and_sane():
    rng = np.random.default_rng(1)
    v = (rng.random(500) < 0.2).astype(float)
    lo, hi = M.bootstrap_ci(v, n_boot=400, seed=3)
    assert (lo, hi) == M.bootstrap_ci(v, n_boot=400, seed=3), "same seed, same CI"
    assert (lo, hi) != M.bootstrap_ci(v, n_boot=400, seed=4)
    assert lo < v.mean() < hi
    # Normal approximation of a proportion: half-width ~ 1.96 * sqrt(p(1-p)/n).
    half = 1.96 * math.sqrt(v.mean() * (1 - v.mean()) / v.size)
    assert abs((hi - lo) / 2 - half) < 0.25 * half
    assert M.bootstrap_ci([0.3], n_boot=100) == (0.3, 0.3)
    assert M.bootstrap_ci([], n_boot=100) == (0.0, 0.0)
    assert M.bootstrap_ci(v, n_boot=0) == (v.mean(), v.mean())


def test_paired_bootstrap_is_tighter_than_unpaired():
    rng = np.random.default_rng(0)
    base = rng.random(300)
    a, b = base + 0.05, base  # same users, a constant lift
    lo, hi = M.paired_bootstrap_ci(a, b, n_boot=200)
    assert lo == pytest.approx(0.05) and hi == pytest.approx(0.05)
    with pytest.raises(ValueError, match="same users"):
        M.paired_bootstrap_ci(a, b[:-1])


def test_stratified_bootstrap_weights_each_stratum_by_its_share():
    """Two strata sampled equally but 10% / 90% of the population: the value is the weighted
    mean, not the pooled one; the CI covers the spread of the heavier stratum."""
    rng = np.random.default_rng(1)
    new, old = rng.binomial(1, 0.5, 100).astype(float), rng.binomial(1, 0.1, 100).astype(float)
    value, lo, hi = M.stratified_bootstrap_ci([new, old], [0.1, 0.9], n_boot=500)
    assert value == pytest.approx(0.1 * new.mean() + 0.9 * old.mean())
    assert value != pytest.approx(np.concatenate([new, old]).mean())
    assert lo < value < hi
    # the old stratum's half width (~1.96 * sd / sqrt(100)) scaled by 0.9 dominates
    half = 1.96 * 0.9 * old.std() / 10
    assert abs((hi - lo) / 2 - half) < 0.35 * half
    # constant strata: no spread at all
    assert M.stratified_bootstrap_ci([[1.0] * 5, [0.0] * 7], [0.25, 0.75], n_boot=50) == (0.25, 0.25, 0.25)
    with pytest.raises(ValueError, match="summing to 1"):
        M.stratified_bootstrap_ci([new, old], [0.5, 0.6])
    with pytest.raises(ValueError, match="every stratum needs users"):
        M.stratified_bootstrap_ci([new, []], [0.5, 0.5])
    with pytest.raises(ValueError, match="2 strata but 1 weights"):
        M.stratified_bootstrap_ci([new, old], [1.0])


def test_metrics_table_and_format():
    table, per_user = M.metrics_table(RANKED, TARGETS, [1, 3], n_boot=50, return_per_user=True)
    assert table["recall@3"]["value"] == pytest.approx(0.75)
    assert table["ndcg@3"]["value"] == pytest.approx((0.5 + 1 + 0.5) / 4)
    assert table["precision@1"]["value"] == pytest.approx(0.25)
    lo, hi = table["recall@3"]["ci"]
    assert 0 <= lo <= 0.75 <= hi <= 1
    assert per_user["recall@3"] == [1.0, 0.0, 1.0, 1.0]
    text = M.format_table({"sft": table, "mostpop": table}, columns=["recall@3", "ndcg@3"])
    lines = text.splitlines()
    assert len(lines) == 3 and "recall@3" in lines[0] and lines[1].startswith("sft")
    assert "0.7500" in lines[1] and "0.5000" in lines[2]
    assert "[" in M.format_table({"sft": table}, ci=True)


def test_hr_at_3_hand_computed_over_rows_of_several_users():
    """Four rows of three users (the time split gives a user several): HR@3 is the share of
    rows whose target is in the top 3, NDCG@3 the mean of 1/log2(rank + 2) over those hits."""
    ranked = [["a", "b", "c", "d"], ["x", "y", "z", "t"], ["p", "q", "r", "s"], ["m", "n", "o", "k"]]
    targets = ["c", "t", "p", "n"]  # ranks 2 (hit), 3 (miss at 3), 0 (hit), 1 (hit)
    users = ["u1", "u1", "u2", "u3"]
    table, per_row = M.metrics_table(ranked, targets, [3], n_boot=200, seed=0, return_per_user=True, groups=users)
    assert table["hr@3"]["value"] == pytest.approx(3 / 4)
    assert table["hr@3"] == table["recall@3"] and "hr@3" not in per_row  # one target: the same figure
    assert list(table)[0] == "hr@3"
    assert table["ndcg@3"]["value"] == pytest.approx((1 / math.log2(4) + 1 + 1 / math.log2(3)) / 4)
    assert "hr@3" not in M.metrics_table(ranked, relevance=[{t: 1} for t in targets], ks=[3], n_boot=0)


def test_bootstrap_resamples_users_with_all_their_rows():
    rng = np.random.default_rng(0)
    v = rng.random(40)
    # Every row its own user: the plain bootstrap, draw for draw.
    assert M.bootstrap_ci(v, 300, seed=4, groups=[f"u{i}" for i in range(40)]) == M.bootstrap_ci(v, 300, seed=4)
    # Four users of ten rows: each replicate draws 4 users and averages their rows.
    users = [f"u{i // 10}" for i in range(40)]
    sums = np.array([v[i * 10:(i + 1) * 10].sum() for i in range(4)])
    draws = np.random.default_rng(4).integers(0, 4, size=(300, 4))
    want = np.quantile(sums[draws].sum(axis=1) / (10 * 4), [0.025, 0.975])
    assert M.bootstrap_ci(v, 300, seed=4, groups=users) == pytest.approx(tuple(want))
    # A user with one row and a user with nine: a replicate is the mean over the rows drawn,
    # 0 (b, b), 1/10 (a, b) or 1 (a, a), never a mean over users.
    lo, hi = M.bootstrap_ci([1.0] + [0.0] * 9, 500, seed=0, groups=["a"] + ["b"] * 9)
    assert (lo, hi) == (0.0, 1.0)
    assert M.bootstrap_ci([1.0] + [0.0] * 9, 500, seed=0, alpha=0.6, groups=["a"] + ["b"] * 9) == (
        pytest.approx(0.1), pytest.approx(0.1))
    with pytest.raises(ValueError, match="groups"):
        M.bootstrap_ci(v, 10, groups=users[:3])
    a, b = rng.random(40), rng.random(40)
    assert M.paired_bootstrap_ci(a, b, 100, seed=1, groups=users) == M.bootstrap_ci(a - b, 100, seed=1, groups=users)
