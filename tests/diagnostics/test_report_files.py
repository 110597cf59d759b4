"""Tests of gti/diagnostics/report_files.py: every arm in the HTML, JSON/CSV == HTML numbers, plots."""

from __future__ import annotations

import csv
import json
import re
from html.parser import HTMLParser

import numpy as np
import pytest

from gti.diagnostics import plots as P
from gti.diagnostics.report_files import build_report, spectra_plots

from .conftest import ARMS, N_ITEMS, RANK_ARMS, make_rank_records, make_records


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
    recs = make_records()
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
    paths = build_report(make_records(), tmp_path)
    doc = json.loads(paths["json"].read_text())
    parser = _Cells()
    parser.feed(paths["html"].read_text())
    html_cells = {(c["data-arm"], c["data-group"], c["data-name"]): c for c in parser.cells}
    rows = doc["metrics"] + doc["pairwise"] + doc["cold"]["rows"] + doc["diagnostics"]
    assert doc["pairwise"]  # gti vs gti+multitask
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


def test_single_seed_has_no_std_and_mean_init_rsa_is_undefined(tmp_path):
    recs = [r for r in make_records() if r.seed == 0]
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
    out = spectra_plots(make_records(), tmp_path)
    assert sorted(p.name for p in out.values()) == ["spectra_init.png", "spectra_sft.png"]
    assert all(p.stat().st_size > 3000 for p in out.values())


def test_report_html_and_json_show_ranks_cold_curves_wall_time(tmp_path):
    from gti.diagnostics.report_files import learning_curve_plots

    recs = make_rank_records()
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
    recs = make_rank_records(cold=False, curves=False, timing=False)
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


def test_csv_text_writes_exact_floats_and_blanks_for_missing():
    from gti.diagnostics.report_files import CSV_COLUMNS, _csv_text

    text = _csv_text([{"table": "metrics", "arm": "gti", "name": "recall@10", "n": 2, "mean": 0.1 + 0.2,
                       "std": None, "ci_method": "a, b"}])
    header, row = text.splitlines()
    assert header.split(",") == CSV_COLUMNS
    values = dict(zip(CSV_COLUMNS, next(csv.reader([row]))))
    assert values["mean"] == "0.30000000000000004" and float(values["mean"]) == 0.1 + 0.2
    assert values["std"] == "" and values["group"] == "" and values["n"] == "2" and values["ci_method"] == "a, b"


def test_pairwise_rows_put_each_arm_against_the_later_non_baseline_arms(tmp_path):
    from gti.diagnostics.tables import metrics_table

    recs = make_records(per_user=True)  # arms mean (baseline), gti, gti+multitask
    paths = build_report(recs, tmp_path / "out", n_boot=200)
    doc = json.loads(paths["json"].read_text())
    pw = doc["pairwise"]
    # Only gti vs gti+multitask: never the baseline, never both directions of a pair.
    assert {(r["arm"], r["group"], r["table"]) for r in pw} == {("gti", "test vs gti+multitask", "pairwise")}
    want = {r["name"]: r for r in metrics_table(recs, "test", "gti+multitask", 200, 0) if r["arm"] == "gti"}
    for r in pw:
        assert r["lift"] == pytest.approx(want[r["name"]]["lift"])
        assert (r["lift_ci_lo"], r["lift_ci_hi"]) == pytest.approx((want[r["name"]]["lift_ci_lo"],
                                                                    want[r["name"]]["lift_ci_hi"]))
        if r["name"] == "recall@10":  # per-user values exist: the lift is paired over users
            assert "paired user bootstrap" in r["ci_method"]
    gti = np.mean([r.metrics["splits"]["test"]["recall@10"]["value"] for r in recs if r.arm == "gti"])
    mt = np.mean([r.metrics["splits"]["test"]["recall@10"]["value"] for r in recs if r.arm == "gti+multitask"])
    assert {r["name"]: r for r in pw}["recall@10"]["lift"] == pytest.approx(gti / mt - 1)
    assert any(x.startswith("gti vs gti+multitask (test): ") for x in doc["reading"])
    assert not any(x.startswith("gti vs mean (test) vs") for x in doc["reading"])
    page = paths["html"].read_text()
    assert "Arm against arm" in page and 'class="pairwise"' in page
    with paths["csv"].open() as fh:
        assert sum(r["table"] == "pairwise" for r in csv.DictReader(fh)) == len(pw)
