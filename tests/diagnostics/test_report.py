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
    rows = doc["metrics"] + doc["diagnostics"]
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
