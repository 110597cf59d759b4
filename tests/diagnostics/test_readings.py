"""Tests of gti/diagnostics/readings.py: the report's numbers in plain words."""

from __future__ import annotations

from gti.diagnostics.readings import _standing, curve_reading, reading
from gti.diagnostics.runs import RunRecord
from gti.diagnostics.tables import learning_curves


def test_curve_reading_says_who_catches_up():
    recs = [RunRecord(arm="mean", seed=0, curves={"val_mrr": [[0, 0.01], [50, 0.05], [100, 0.09]],
                                                  "val_loss": [[0, 3.0], [100, 2.0]]}),
            RunRecord(arm="gti", seed=0, curves={"val_mrr": [[0, 0.04], [50, 0.06], [100, 0.08]],
                                                 "val_loss": [[0, 3.2], [100, 1.9]]})]
    lines = curve_reading(learning_curves(recs), "mean")
    mrr = next(x for x in lines if x.startswith("val_mrr"))
    assert "gti starts ahead of mean at step 0" in mrr and "behind it at step 100" in mrr
    assert mrr.endswith("mean catches up [higher is better].")
    loss = next(x for x in lines if x.startswith("val_loss"))  # higher loss = behind
    assert "gti starts behind mean" in loss and "gti catches up and overtakes" in loss


def test_standing_of_one_curve_point_against_the_baseline():
    p = {"mean": 0.5, "min": 0.4, "max": 0.6, "n": 2}
    assert _standing(p, {"mean": 0.3, "min": 0.2, "max": 0.35, "n": 2}, up=True) == "ahead of"
    assert _standing(p, {"mean": 0.3, "min": 0.2, "max": 0.45, "n": 2}, up=True) == "ahead of (seed ranges overlap)"
    assert _standing(p, {"mean": 0.3, "min": 0.3, "max": 0.3, "n": 1}, up=False) == "behind"
    assert _standing(p, dict(p), up=True) == "level with"


def _row(arm, name, lift, lo=None, hi=None, direction="higher", verdict=None, group="test"):
    return {"arm": arm, "group": group, "name": name, "lift": lift, "lift_ci_lo": lo, "lift_ci_hi": hi,
            "direction": direction, "verdict": verdict}


def test_reading_groups_metrics_by_verdict_per_arm():
    doc = {"baseline_arm": "mean",
           "metrics": [_row("mean", "recall@10", 0.0),
                       _row("gti", "recall@10", 0.2, 0.1, 0.3, verdict="better"),
                       _row("gti", "mean_percentile_rank", 0.1, 0.05, 0.2, "lower", "worse"),
                       _row("gti", "ndcg@5", 0.01, -0.1, 0.1, verdict="no clear difference"),
                       _row("one", "recall@10", 0.05, verdict="better (no CI)")],
           "cold": {"rows": [_row("gti", "mrr", -0.5, -0.7, -0.2, verdict="worse", group="cold/test")]},
           "curve_reading": ["val_mrr: a curve line."],
           "wall_time": {"mean": {"total_s": 10.0, "extra_vs_baseline_s": 0.0},
                         "gti": {"total_s": 7.5, "extra_vs_baseline_s": -2.5}}}
    lines = reading(doc)
    assert lines == [
        "gti vs mean (test): better on recall@10 (+20.0% [+10.0%, +30.0%]); worse on mean_percentile_rank "
        "(+10.0% [+5.0%, +20.0%], lower is better); no clear difference (95% CI of the lift contains 0) on ndcg@5.",
        "one vs mean (test): better by the point estimate only (no CI) on recall@10.",
        "gti vs mean (test) on the cold slice: worse on mrr (-50.0% [-70.0%, -20.0%]).",
        "val_mrr: a curve line.",
        "wall time: gti takes 7.5 s (ground + SFT stages), 2.5 s less than mean.",
    ]
