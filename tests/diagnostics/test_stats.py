"""Tests of gti/diagnostics/stats.py: cleaning numbers, CIs, lift CIs, verdicts, number text."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from gti.diagnostics import stats as S


def test_num_and_clean_drop_what_json_cannot_hold():
    assert S._num("0.5") == 0.5 and S._num(3) == 3.0
    assert S._num(None) is None and S._num("x") is None and S._num(float("nan")) is None and S._num(math.inf) is None
    got = S._clean({1: [np.float32(0.5), np.int64(3), float("nan")], "a": (np.array([1.0, np.inf]), "s", None)})
    assert got == {"1": [0.5, 3, None], "a": [[1.0, None], "s", None]}
    assert type(got["1"][1]) is int
    json.dumps(got, allow_nan=False)


def test_dig_and_metric_entry():
    d = {"a": {"b": {"c": 1}}}
    assert S._dig(d, ("a", "b", "c")) == 1 and S._dig(d, ("a", "x")) is None and S._dig(d, ("a", "b", "c", "d")) is None
    assert S.metric_entry({"value": "0.2", "ci": [0.1, 0.3]}) == (0.2, (0.1, 0.3))
    assert S.metric_entry({"value": 0.2, "ci": [0.1]}) == (0.2, None)
    assert S.metric_entry(0.4) == (0.4, None) and S.metric_entry(None) == (None, None)


def test_mean_std_and_percentile_ci():
    assert S._mean_std([1.0, None, 3.0]) == (2.0, pytest.approx(math.sqrt(2)))
    assert S._mean_std([5.0]) == (5.0, None) and S._mean_std([None]) == (None, None)
    assert S._percentile_ci(np.array([np.nan, np.inf])) == (None, None)
    lo, hi = S._percentile_ci(np.append(np.arange(1001.0), np.nan))
    assert (lo, hi) == (pytest.approx(25.0), pytest.approx(975.0))


def test_direction():
    assert S.higher_is_better("recall@10") and S.higher_is_better("mrr")
    for name in ("mean_percentile_rank", "invalid_sid_rate", "median_rank", "mean_rank", "val_loss", "loss"):
        assert not S.higher_is_better(name), name


@pytest.mark.parametrize("row, want", [
    ({"lift": None}, None),
    ({"lift": 0.1, "lift_ci_lo": 0.02, "lift_ci_hi": 0.2}, "better"),
    ({"lift": -0.1, "lift_ci_lo": -0.2, "lift_ci_hi": -0.01}, "worse"),
    ({"lift": -0.1, "lift_ci_lo": -0.2, "lift_ci_hi": -0.01, "direction": "lower"}, "better"),
    ({"lift": 0.1, "lift_ci_lo": -0.02, "lift_ci_hi": 0.2}, "no clear difference"),
    ({"lift": 0.1}, "better (no CI)"),
    ({"lift": 0.1, "direction": "lower"}, "worse (no CI)"),
    ({"lift": 0.0}, "equal (no CI)"),
])
def test_verdict_reads_the_lift_ci_with_the_direction(row, want):
    assert S.verdict(row) == want


def test_lift_ci_paired_users_then_seeds_then_nothing():
    rng = np.random.default_rng(0)
    users = {f"u{i}": 0.2 + 0.001 * (i % 7) for i in range(100)}
    base = {f"u{i}": 0.1 + 0.001 * (i % 5) for i in range(50, 150)}
    lo, hi, how = S._lift_ci(users, base, [], [], 500, rng)
    assert how == "paired user bootstrap" and 0.5 < lo < hi < 1.5
    lo, hi, how = S._lift_ci(None, None, [0.2, 0.22], [0.1, 0.11], 500, rng)
    assert how == "seed bootstrap" and lo == pytest.approx(0.2 / 0.11 - 1) and hi == pytest.approx(0.22 / 0.1 - 1)
    assert S._lift_ci({"u": 1.0}, {"u": 1.0}, [0.2], [0.1, None], 10, rng) == (None, None, "")


def test_nested_boot_ci_uses_every_seeds_replicates():
    rng = np.random.default_rng(1)
    assert S._nested_boot_ci([[], [None, np.nan]], 10, rng) == (None, None)
    lo, hi = S._nested_boot_ci([[0.4, 0.6], [None]], 2000, rng)  # one seed with replicates
    assert (lo, hi) == (0.4, 0.6)


def test_number_text():
    assert S.fmt(0.123456) == "0.1235" and S.fmt(None) == "&ndash;" and S.fmt_plain(None) == "-"
    assert S.fmt(123456.0) == "1.235e+05" and S.fmt_plain(0.0001234) == "1.234e-04" and S.fmt(0) == "0"
    assert S.fmt(2.5, digits=2) == "2.5"
    assert S._pct(0.1234) == "+12.3%" and S._pct(None) == "&ndash;"
    assert S._pct_plain(-0.05) == "-5.0%" and S._pct_plain("x") == "-"
