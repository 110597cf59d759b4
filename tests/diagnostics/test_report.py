"""Tests of gti/diagnostics/report.py: every arm in the HTML, JSON/CSV == HTML numbers, stats."""

from __future__ import annotations

import csv
import json
import re
from html.parser import HTMLParser

import numpy as np
import pytest

from gti.diagnostics import geometry as G
from gti.diagnostics import plots as P
from gti.diagnostics.report import RunRecord, build_report, metrics_table, spectra_plots

ARMS = ["mean", "gti", "gti+multitask"]


def _metrics(r10, r5, seed, per_user=None):
    m = {
        "splits": {"test": {
            "recall@10": {"value": r10, "ci": [r10 - 0.01, r10 + 0.01]},
            "ndcg@5": {"value": r5, "ci": [r5 - 0.005, r5 + 0.005]},
        }},
        "baselines": {"mostpop": {"test": {"recall@10": {"value": 0.03, "ci": [0.02, 0.04]}}},
                      "markov": {"test": {"recall@10": 0.08}}},
        "invalid_sid_rate": 0.001 * seed,
    }
    if per_user is not None:
        m["per_user"] = {"test": {"user_ids": [f"u{i}" for i in range(len(per_user))],
                                  "recall@10": list(per_user), "ndcg@5": list(per_user / 2)}}
    return m


def _diag(rng, rank1=False):
    sizes = [6, 6]
    codes = [rng.normal(size=(6, 3)), rng.normal(size=(6, 3))]
    E = np.tile(rng.normal(size=(1, 8)), (12, 1)) if rank1 else rng.normal(size=(12, 8))
    return G.diagnose(E, sizes, codes, rng.normal(size=(20, 8)))


def _records(per_user=False):
    rng = np.random.default_rng(0)
    recs = []
    base = {"mean": 0.10, "gti": 0.12, "gti+multitask": 0.13}
    for arm in ARMS:
        for seed in (0, 1):
            r10 = base[arm] + 0.01 * seed
            pu = rng.binomial(1, r10, size=200).astype(float) if per_user else None
            if per_user:  # the reported value is the mean of the per-user values
                r10 = float(pu.mean())
            recs.append(RunRecord(
                arm=arm, seed=seed, metrics=_metrics(r10, r10 / 2, seed, pu),
                diagnostics={"init": _diag(rng, rank1=arm == "mean"), "sft": _diag(rng)},
                config={"init": {"method": "mean"}, "arm": arm}, versions={"torch": "x"},
                run_dir=f"/runs/{arm}/seed{seed}",
            ))
    return recs


class _Cells(HTMLParser):
    """Collects the data-* attributes of every number cell and all src/href attributes."""

    def __init__(self):
        super().__init__()
        self.cells, self.links = [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "td" and "data-name" in a:
            self.cells.append(a)
        for k in ("src", "href"):
            if k in a:
                self.links.append(a[k])


def test_report_contains_every_arm_and_is_self_contained(tmp_path):
    recs = _records()
    png = P.plot_spectra({"x": [3.0, 1.0]}, tmp_path / "p.png")
    paths = build_report(recs, tmp_path / "out", plots={"a spectrum": png}, title="T")
    page = paths["html"].read_text()
    for arm in ARMS:
        assert f"<th>{arm}</th>" in page
    parser = _Cells()
    parser.feed(page)
    # the only link is the embedded PNG; nothing to fetch from disk or network
    assert parser.links and all(link.startswith("data:image/png;base64,") for link in parser.links)
    assert "<script" not in page and "<link" not in page
    assert "mostpop" in page and "markov" in page
    assert "Package versions" in page


def test_json_and_csv_match_html_table(tmp_path):
    paths = build_report(_records(), tmp_path)
    doc = json.loads(paths["json"].read_text())
    parser = _Cells()
    parser.feed(paths["html"].read_text())
    html_cells = {(c["data-arm"], c["data-group"], c["data-name"]): c for c in parser.cells}
    rows = doc["metrics"] + doc["cold"]["rows"] + doc["diagnostics"]
    assert len(html_cells) == len(rows)
    with paths["csv"].open() as fh:
        csv_rows = {(r["table"], r["arm"], r["group"], r["name"]): r for r in csv.DictReader(fh)}
    assert len(csv_rows) == len(rows)
    for row in rows:
        cell = html_cells[(row["arm"], row["group"], row["name"])]
        crow = csv_rows[(row["table"], row["arm"], row["group"], row["name"])]
        for key in ("mean", "std", "ci_lo", "ci_hi", "lift"):
            attr = cell[f"data-{key.replace('_', '-')}"]
            if row[key] is None:
                assert attr == "" and crow[key] == ""
            else:
                assert float(attr) == row[key] == float(crow[key])
    assert {r["arm"] for r in doc["metrics"]} == set(ARMS)
    assert {"effective_rank", "rsa_pearson", "block_contrast"} <= {r["name"] for r in doc["diagnostics"]}


def test_metric_statistics_are_right():
    rows = {(r["arm"], r["name"]): r for r in metrics_table(_records(), n_boot=200)}
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
    recs = _records(per_user=True)
    rows = {(r["arm"], r["name"]): r for r in metrics_table(recs, n_boot=300)}
    row = rows[("gti+multitask", "recall@10")]
    assert row["ci_method"].startswith("user bootstrap") and "paired user bootstrap" in row["ci_method"]
    users = np.mean([r.metrics["per_user"]["test"]["recall@10"] for r in recs if r.arm == "gti+multitask"], 0)
    assert row["mean"] == pytest.approx(users.mean())
    assert row["ci_lo"] < users.mean() < row["ci_hi"]
    assert row["lift_ci_lo"] < row["lift"] < row["lift_ci_hi"]
    assert row["lift_ci_lo"] < row["lift_ci_hi"]


def test_single_seed_has_no_std_and_mean_init_rsa_is_undefined(tmp_path):
    recs = [r for r in _records() if r.seed == 0]
    paths = build_report(recs, tmp_path)
    doc = json.loads(paths["json"].read_text())
    assert all(r["std"] is None for r in doc["metrics"])
    rsa_init = [r for r in doc["diagnostics"]
                if r["arm"] == "mean" and r["group"] == "init" and r["name"] == "rsa_pearson"]
    assert rsa_init[0]["mean"] is None
    er = {(r["arm"], r["group"]): r["mean"] for r in doc["diagnostics"] if r["name"] == "effective_rank"}
    assert er[("mean", "init")] == pytest.approx(1.0, abs=1e-6) and er[("gti", "init")] > 3
    assert not re.search(r"\bNaN\b", paths["json"].read_text())


def test_spectra_plots_one_per_phase(tmp_path):
    out = spectra_plots(_records(), tmp_path)
    assert sorted(p.name for p in out.values()) == ["spectra_init.png", "spectra_sft.png"]
    assert all(p.stat().st_size > 3000 for p in out.values())


# --------------------------------------------------------------------------- exact ranks, cold
# slice, learning curves, wall time
N_ITEMS = 101


def _rank_block(ranks, n_items=N_ITEMS):
    r = np.asarray(ranks, dtype=float)
    rr, pct = 1.0 / r, (r - 1) / (n_items - 1)
    return {"mrr": {"value": float(rr.mean()), "ci": [float(rr.mean()) * 0.9, float(rr.mean()) * 1.1]},
            "mean_percentile_rank": {"value": float(pct.mean()),
                                     "ci": [float(pct.mean()) * 0.9, float(pct.mean()) * 1.1]},
            "median_rank": float(np.median(r)), "mean_rank": float(r.mean()),
            "n_users": int(r.size), "n_items": n_items}


def _cold_block(r10, mrr, n_users):
    return {"n_users": n_users,
            "model": {"recall@10": {"value": r10, "ci": [r10 - 0.02, r10 + 0.02]}},
            "baselines": {"mostpop": {"recall@10": {"value": 0.01, "ci": [0.0, 0.02]}}},
            "ranks": {"mrr": {"value": mrr, "ci": [mrr - 0.01, mrr + 0.01]},
                      "mean_percentile_rank": {"value": 0.5 - mrr, "ci": [0.45 - mrr, 0.55 - mrr]}}}


# arm -> (max rank of its users' targets: smaller = better, cold recall@10, cold mrr)
RANK_ARMS = {"mean": (60, 0.02, 0.05), "gti": (15, 0.06, 0.12), "random": (100, 0.01, 0.02)}


def _rank_records(cold=True, curves=True, timing=True):
    rng = np.random.default_rng(3)
    recs = []
    for arm, (top, c10, cmrr) in RANK_ARMS.items():
        for seed in (0, 1):
            ranks = rng.integers(1, top + 1, size=150).astype(float)
            hits = (ranks <= 10).astype(float)
            m = {
                "splits": {"test": {"recall@10": {"value": float(hits.mean()), "ci": [0.0, 1.0]}}},
                "baselines": {}, "invalid_sid_rate": 0.0,
                "ranks": {"test": _rank_block(ranks)},
                "per_user": {"test": {"user_ids": [f"u{i}" for i in range(150)], "recall@10": hits.tolist(),
                                      "exact_rank": ranks.tolist()}},
            }
            if cold:
                m["slices"] = {"cold": {
                    "definition": {"max_sft_targets": 1, "n_cold_items": 30, "n_items": N_ITEMS},
                    "test": _cold_block(c10 + 0.01 * seed, cmrr + 0.01 * seed, 40 + seed),
                }}
            cv = {}
            if curves:
                # gti starts ahead and stays ahead on val_mrr; val_loss: gti lower (better)
                start = {"mean": 0.01, "gti": 0.05, "random": 0.005}[arm]
                cv = {"val_mrr": [[s, start + 0.001 * s + 0.002 * seed] for s in (10, 20, 30)],
                      "val_loss": [[s, 3.0 - 10 * start - 0.01 * s + 0.05 * seed] for s in (10, 20, 30)]}
            tm = {}
            if timing:
                tm = {"ground_s": 100.0 + seed if arm == "gti" else 5.0, "sft_s": 200.0 + 2 * seed,
                      "sft_compute_s": 150.0, "grounding": arm == "gti"}
            recs.append(RunRecord(arm=arm, seed=seed, metrics=m, run_dir=f"/r/{arm}/{seed}",
                                  curves=cv, timing=tm))
    return recs


def test_mrr_and_percentile_rank_rows_with_user_bootstrap_and_direction():
    recs = _rank_records()
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
    recs = _rank_records()
    for r in recs:
        del r.metrics["per_user"]["test"]["exact_rank"]
    rows = {(r["arm"], r["name"]): r for r in metrics_table(recs, n_boot=100)}
    row = rows[("gti", "mean_percentile_rank")]
    assert row["ci_method"].startswith("per-seed user bootstrap") and "seed bootstrap" in row["ci_method"]
    assert row["lift"] < 0


def test_report_html_and_json_show_ranks_cold_curves_wall_time(tmp_path):
    from gti.diagnostics.report import learning_curve_plots

    recs = _rank_records()
    plots = learning_curve_plots(recs, tmp_path / "plots")
    assert sorted(p.name for p in plots.values()) == ["curve_val_loss.png", "curve_val_mrr.png"]
    assert all(p.stat().st_size > 3000 for p in plots.values())
    paths = build_report(recs, tmp_path / "out", plots=plots, n_boot=200)
    doc = json.loads(paths["json"].read_text())
    page = paths["html"].read_text()

    # ranks: arrow on the lower-is-better column, plain-words reading direction-aware
    assert "mean_percentile_rank <span" in page and "&darr;" in page
    gti_line = next(x for x in doc["reading"] if x.startswith("gti vs mean (test):"))
    better = gti_line.split("better on ", 1)[1]
    assert "mrr" in better and "mean_percentile_rank" in better and "lower is better" in better
    assert "worse on" not in gti_line
    rnd_line = next(x for x in doc["reading"] if x.startswith("random vs mean (test):"))
    assert "mean_percentile_rank" in rnd_line.split("worse on ", 1)[1]

    # cold slice: mean over seeds, n_users per seed, definition, baselines
    cold = doc["cold"]
    assert cold["definition"] == {"max_sft_targets": 1, "n_cold_items": 30, "n_items": N_ITEMS}
    assert cold["n_users"]["gti"]["test"] == [40, 41]
    crow = {(r["arm"], r["name"]): r for r in cold["rows"]}
    assert crow[("gti", "recall@10")]["mean"] == pytest.approx(0.065)
    assert crow[("gti", "recall@10")]["std"] == pytest.approx(np.std([0.06, 0.07], ddof=1))
    assert crow[("gti", "recall@10")]["ci_lo"] == pytest.approx(0.045)
    assert crow[("gti", "mrr")]["mean"] == pytest.approx(0.125)
    assert crow[("gti", "mean_percentile_rank")]["direction"] == "lower"
    assert crow[("gti", "recall@10")]["lift"] == pytest.approx(0.065 / 0.025 - 1)
    assert crow[("gti", "recall@10")]["group"] == "cold/test"
    assert "Cold-item slice" in page and "40-41" in page
    assert any("on the cold slice" in x for x in doc["reading"])
    with paths["csv"].open() as fh:
        assert sum(r["table"] == "cold" for r in csv.DictReader(fh)) == len(cold["rows"])

    # learning curves: raw mean per step in JSON, plots embedded in their own section
    lc = doc["learning_curves"]
    assert set(lc) == {"val_loss", "val_mrr"} and set(lc["val_mrr"]) == set(RANK_ARMS)
    assert lc["val_mrr"]["gti"] == [[10, pytest.approx(0.061)], [20, pytest.approx(0.071)],
                                    [30, pytest.approx(0.081)]]
    assert doc["learning_curves_range"]["val_mrr"]["gti"][0] == [10, pytest.approx(0.06),
                                                                  pytest.approx(0.062), 2]
    assert "Learning curves" in page and page.count("data:image/png;base64,") == 2
    assert any(x.startswith("val_mrr: gti starts ahead of mean at step 10") and "ahead of it at step 30" in x
               for x in doc["reading"])
    assert any(x.startswith("val_loss: gti starts ahead of mean") and "[lower is better]" in x
               for x in doc["reading"])
    assert any(x.startswith("val_mrr: random starts behind mean") for x in doc["reading"])

    # wall time: ground + SFT stage seconds, mean over seeds, vs the baseline arm
    wt = doc["wall_time"]
    assert wt["gti"]["ground_s"] == pytest.approx(100.5) and wt["gti"]["sft_s"] == pytest.approx(201.0)
    assert wt["gti"]["total_s"] == pytest.approx(301.5) and wt["gti"]["grounding"] is True
    assert wt["mean"]["total_s"] == pytest.approx(206.0) and wt["mean"]["grounding"] is False
    assert wt["gti"]["extra_vs_baseline_s"] == pytest.approx(95.5)
    assert wt["gti"]["sft_compute_s"] == pytest.approx(150.0)
    assert "Wall time" in page and "+95.5 s" in page
    assert any(x.startswith("wall time: gti takes 301.5 s") for x in doc["reading"])
    assert not re.search(r"\bNaN\b", paths["json"].read_text())


def test_old_runs_without_new_fields_still_render(tmp_path):
    recs = _rank_records(cold=False, curves=False, timing=False)
    for r in recs:
        r.metrics.pop("ranks")
        r.metrics["per_user"]["test"].pop("exact_rank")
    paths = build_report(recs, tmp_path, n_boot=50)
    doc = json.loads(paths["json"].read_text())
    page = paths["html"].read_text()
    assert {r["name"] for r in doc["metrics"]} == {"recall@10", "invalid_sid_rate"}
    assert doc["cold"]["rows"] == [] and "Cold-item slice" not in page
    assert doc["learning_curves"] == {} and "Learning curves" not in page
    assert doc["wall_time"] == {} and "Wall time" not in page
    # a cold slice with 0 users (no cold targets) is skipped too
    for r in recs:
        r.metrics["slices"] = {"cold": {"definition": {"max_sft_targets": 1, "n_cold_items": 0, "n_items": 9},
                                        "test": {"n_users": 0, "model": {}, "baselines": {}, "ranks": {}}}}
    doc = json.loads(build_report(recs, tmp_path / "b", n_boot=20)["json"].read_text())
    assert doc["cold"]["rows"] == []


def test_curve_reading_says_who_catches_up():
    from gti.diagnostics.report import curve_reading, learning_curves

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


def test_diagnostics_ci_from_stored_replicates_pools_seeds():
    from gti.diagnostics.report import diagnostics_table

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
