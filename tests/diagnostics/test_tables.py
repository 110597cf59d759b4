"""Tests of gti/diagnostics/tables.py: the statistics of the metrics, cold, diagnostics, RSA,
learning-curve and wall-time tables."""

from __future__ import annotations

import numpy as np
import pytest

from gti.diagnostics.runs import RunRecord
from gti.diagnostics.tables import (
    cold_table,
    diagnostics_table,
    learning_curves,
    metrics_table,
    rsa_level_table,
    wall_time_table,
)

from .conftest import N_ITEMS, RANK_ARMS, make_rank_records, make_records


def test_metric_statistics_are_right():
    rows = {(r["arm"], r["name"]): r for r in metrics_table(make_records(), n_boot=200)}
    gti = rows[("gti", "recall@10")]
    assert gti["mean"] == pytest.approx(0.125)
    assert gti["std"] == pytest.approx(np.std([0.12, 0.13], ddof=1))
    assert gti["lift"] == pytest.approx(0.125 / 0.105 - 1)
    assert rows[("mean", "recall@10")]["lift"] == pytest.approx(0.0)
    # no per-user data: CI = per-seed bounds averaged; lift CI from seeds
    assert gti["ci_lo"] == pytest.approx(0.115) and gti["ci_hi"] == pytest.approx(0.135)
    assert "seed bootstrap" in gti["ci_method"]
    assert gti["lift_ci_lo"] <= gti["lift"] <= gti["lift_ci_hi"]
    assert rows[("gti", "invalid_sid_rate")]["mean"] == pytest.approx(0.0005)


def test_paired_user_bootstrap_when_per_user_values_exist():
    recs = make_records(per_user=True)
    rows = {(r["arm"], r["name"]): r for r in metrics_table(recs, n_boot=300)}
    row = rows[("gti+multitask", "recall@10")]
    assert row["ci_method"].startswith("user bootstrap") and "paired user bootstrap" in row["ci_method"]
    users = np.mean([r.metrics["per_user"]["test"]["recall@10"] for r in recs if r.arm == "gti+multitask"], 0)
    assert row["mean"] == pytest.approx(users.mean())
    assert row["ci_lo"] < users.mean() < row["ci_hi"]
    assert row["lift_ci_lo"] < row["lift"] < row["lift_ci_hi"]
    assert row["lift_ci_lo"] < row["lift_ci_hi"]


def test_mrr_and_percentile_rank_rows_with_user_bootstrap_and_direction():
    recs = make_rank_records()
    rows = {(r["arm"], r["name"]): r for r in metrics_table(recs, n_boot=300)}
    for arm in RANK_ARMS:
        assert (arm, "mrr") in rows and (arm, "mean_percentile_rank") in rows
    # the value is the mean over seeds of metrics.json ranks; the CI a user bootstrap of the
    # per-user 1/rank and (rank-1)/(N-1) derived from per_user.exact_rank
    gti = [r for r in recs if r.arm == "gti"]
    ranks = np.array([r.metrics["per_user"]["test"]["exact_rank"] for r in gti])
    mrr, pct = rows[("gti", "mrr")], rows[("gti", "mean_percentile_rank")]
    assert mrr["mean"] == pytest.approx(np.mean([(1 / r).mean() for r in ranks]))
    assert pct["mean"] == pytest.approx(((ranks - 1) / (N_ITEMS - 1)).mean())
    for row in (mrr, pct):
        assert row["ci_method"].startswith("user bootstrap") and "paired user bootstrap" in row["ci_method"]
        assert row["ci_lo"] < row["mean"] < row["ci_hi"]
    assert mrr["direction"] == "higher" and pct["direction"] == "lower"
    # gti ranks its targets higher: MRR up, percentile rank DOWN; both are "better"
    assert mrr["lift"] > 0 and mrr["lift_ci_lo"] > 0 and mrr["verdict"] == "better"
    assert pct["lift"] < 0 and pct["lift_ci_hi"] < 0 and pct["verdict"] == "better"
    # random ranks them lower: percentile up = worse
    rnd = rows[("random", "mean_percentile_rank")]
    assert rnd["lift"] > 0 and rnd["verdict"] == "worse"
    assert rows[("random", "mrr")]["verdict"] == "worse"
    assert rows[("mean", "mrr")]["verdict"] is None  # the baseline itself
    assert rows[("gti", "invalid_sid_rate")]["direction"] == "lower"


def test_rank_rows_without_per_user_ranks_fall_back_to_seed_cis():
    recs = make_rank_records()
    for r in recs:
        del r.metrics["per_user"]["test"]["exact_rank"]
    rows = {(r["arm"], r["name"]): r for r in metrics_table(recs, n_boot=100)}
    row = rows[("gti", "mean_percentile_rank")]
    assert row["ci_method"].startswith("per-seed user bootstrap") and "seed bootstrap" in row["ci_method"]
    assert row["lift"] < 0


def test_diagnostics_ci_from_stored_replicates_pools_seeds():
    def rec(seed, er, boot):
        diag = {"effective_rank": er, "rsa": {"overall": {"pearson": 0.5, "spearman": 0.4,
                                                          "pearson_boot": boot}}}
        return RunRecord(arm="gti", seed=seed, diagnostics={"sft": diag})

    one = diagnostics_table([rec(0, 10.0, [0.4, 0.5, 0.6] * 50)], n_boot=2000)
    row = next(r for r in one if r["name"] == "rsa_pearson")
    assert (row["ci_lo"], row["ci_hi"]) == (0.4, 0.6) and row["ci_method"] == "codes bootstrap"
    er = next(r for r in one if r["name"] == "effective_rank")
    assert er["ci_lo"] is None and er["ci_method"] == ""  # one seed: no CI claimed
    two = diagnostics_table([rec(0, 1.0, [0.1] * 10), rec(1, 3.0, [0.3] * 10)], n_boot=4000)
    row = next(r for r in two if r["name"] == "rsa_pearson")
    # seed means are .1, .2 or .3: the CI spans the seeds' spread, not one seed's
    assert (row["ci_lo"], row["ci_hi"]) == pytest.approx((0.1, 0.3)) and row["ci_method"] == "seed x codes bootstrap"
    er = next(r for r in two if r["name"] == "effective_rank")
    assert (er["ci_lo"], er["ci_hi"]) == (1.0, 3.0) and er["ci_method"] == "seed bootstrap"
    sp = next(r for r in two if r["name"] == "rsa_spearman")
    assert sp["ci_lo"] is None and sp["ci_method"] == ""  # no replicates stored: no CI claimed


def test_rsa_levels_are_averaged_over_seeds_per_arm_and_phase():
    def rec(seed, p0, p1):
        levels = [{"level": 1, "pearson": p1, "spearman": 0.1}, {"level": 0, "pearson": p0, "spearman": None}]
        return RunRecord(arm="gti", seed=seed, diagnostics={"sft": {"rsa": {"per_level": levels}}})

    rows = rsa_level_table([rec(0, 0.2, 0.5), rec(1, 0.4, float("nan"))])
    assert [(r["phase"], r["level"]) for r in rows] == [("sft", 0), ("sft", 1)]
    assert rows[0]["pearson"] == pytest.approx(0.3) and rows[0]["spearman"] is None
    assert rows[1]["pearson"] == pytest.approx(0.5) and rows[1]["spearman"] == pytest.approx(0.1)


def test_cold_table_directly():
    recs = make_rank_records()
    cold = cold_table(recs, n_boot=100)
    assert cold["baselines"]["test"] == {"mostpop": {"recall@10": {"value": 0.01, "ci": [0.0, 0.02]}}}
    rows = {(r["arm"], r["name"]): r for r in cold["rows"]}
    assert set(rows) == {(a, m) for a in RANK_ARMS for m in ("recall@10", "mrr", "mean_percentile_rank")}
    rnd = rows[("random", "mrr")]
    assert rnd["lift"] == pytest.approx(0.025 / 0.055 - 1) and rnd["ci_method"].endswith("; lift: seed bootstrap")
    assert rows[("mean", "mrr")]["lift"] == 0.0 and rows[("mean", "mrr")]["verdict"] is None
    assert cold_table(make_records())["rows"] == []  # no run has a cold slice


def test_learning_curves_pool_seeds_per_step():
    recs = [RunRecord(arm="a", seed=0, curves={"zeta": [[1, 1.0]], "val_mrr": [[0, 0.1], [10.0, 0.3]]}),
            RunRecord(arm="a", seed=1, curves={"val_mrr": [[10, 0.5], [20, float("nan")]], "val_loss": []}),
            RunRecord(arm="b", seed=0, curves={"val_loss": [[5, 2.0]]})]
    lc = learning_curves(recs)
    assert list(lc) == ["val_loss", "val_mrr", "zeta"]  # known curves first, then alphabetical
    assert lc["val_mrr"]["a"] == [{"step": 0, "mean": 0.1, "min": 0.1, "max": 0.1, "n": 1},
                                  {"step": 10, "mean": pytest.approx(0.4), "min": 0.3, "max": 0.5, "n": 2}]
    assert list(lc["val_loss"]) == ["b"] and list(lc["zeta"]) == ["a"]


def test_wall_time_per_arm_and_against_the_baseline():
    recs = [RunRecord(arm="mean", seed=0, timing={"sft_s": 10.0}),
            RunRecord(arm="gti", seed=0, timing={"ground_s": 4.0, "sft_s": 10.0, "grounding": True}),
            RunRecord(arm="gti", seed=1, timing={"ground_s": 6.0, "sft_s": 12.0}),
            RunRecord(arm="old", seed=0)]
    wt = wall_time_table(recs)
    assert list(wt) == ["mean", "gti"]  # runs without timing are left out
    assert wt["gti"]["total_s"] == pytest.approx(16.0) and wt["gti"]["total_s_std"] == pytest.approx(np.sqrt(8))
    assert wt["gti"]["grounding"] is True and wt["mean"]["grounding"] is False
    assert wt["gti"]["extra_vs_baseline_s"] == pytest.approx(6.0) and wt["mean"]["ground_s"] is None
    assert wall_time_table(recs, baseline_arm="none")["gti"]["extra_vs_baseline_s"] is None
    rl = wall_time_table(recs + [RunRecord(arm="gti+rl", seed=0, timing={"ground_s": 4.0, "sft_s": 10.0,
                                                                         "rl_s": 30.0, "rl_compute_s": 20.0})])
    assert rl["gti+rl"]["total_s"] == pytest.approx(44.0) and rl["gti+rl"]["rl_compute_s"] == 20.0
    assert rl["gti+rl"]["extra_vs_baseline_s"] == pytest.approx(34.0) and rl["gti"]["rl_s"] is None
