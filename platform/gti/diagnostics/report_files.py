"""The run/comparison report: one self-contained HTML file plus the same numbers as JSON and CSV.

What it is for: `build_report` turns per-run records (evaluation metrics, geometry diagnostics,
configs, package versions) of one or many arms x seeds into report.json (every table, per-run
summaries, configs, versions), report.csv (the tables in long form: the very numbers the HTML
shows) and report.html (inline CSS and plots, no scripts, no external assets: it opens from
disk). The statistics (means over seeds, lifts, user or seed bootstrap CIs, verdicts) are
written out in the report itself. The pieces live beside it: `runs` (a run's values), `stats`
(numbers, CIs, verdicts), `tables`, `readings` (plain words), `page` (the HTML), `plots`.

What it does not know: how runs were produced, Ray, files of other stages (callers pass plain
dicts), or how diagnostics are computed (`gti.diagnostics.geometry`).
"""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from gti.diagnostics.page import CURVE_PLOT_PREFIX, render_html
from gti.diagnostics.readings import curve_reading, reading
from gti.diagnostics.runs import PHASES, RunRecord, _ordered_arms
from gti.diagnostics.stats import _clean, _dig, higher_is_better
from gti.diagnostics.tables import (
    cold_table,
    diagnostics_table,
    learning_curves,
    metrics_table,
    pairwise_table,
    rsa_level_table,
    wall_time_table,
)
from gti.common.files import atomic_write_bytes

CSV_COLUMNS = [
    "table", "arm", "group", "name", "n", "mean", "std", "ci_lo", "ci_hi",
    "lift", "lift_ci_lo", "lift_ci_hi", "ci_method", "direction", "verdict",
]


def _csv_text(rows: Iterable[Mapping[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else (repr(r[k]) if isinstance(r[k], float) else r[k]))
                    for k in CSV_COLUMNS})
    return buf.getvalue()


def build_report(
    records: Sequence[RunRecord],
    out_dir: str | Path,
    plots: Mapping[str, str | Path] | None = None,
    title: str = "gti report",
    split: str = "test",
    baseline_arm: str = "mean",
    n_boot: int = 1000,
    seed: int = 0,
    run_facts: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Path]:
    """Write report.html, report.json and report.csv into out_dir; return their paths.

    plots: {caption: png path}; they are embedded, so the HTML can be moved on its own (files
    named curve_*.png, see `learning_curve_plots`, go to the learning-curves section).
    run_facts: optional short facts per record (same order) shown in the runs table.
    """
    if not records:
        raise ValueError("a report needs at least one run record")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arms = _ordered_arms(records)
    if split not in {s for r in records for s in (_dig(r.metrics, ("splits",)) or {})}:
        # fall back to a split that exists (e.g. evaluation ran on `valid` only)
        splits = [s for r in records for s in (_dig(r.metrics, ("splits",)) or {})]
        split = splits[0] if splits else split
    versions: dict[str, str] = {}
    for r in records:
        for k, v in r.versions.items():
            versions.setdefault(k, v)
    configs: dict[str, Any] = {}
    for r in records:
        configs.setdefault(r.arm, r.config)
    baselines = next((r.metrics.get("baselines") for r in records if r.metrics.get("baselines")), {})
    curves = learning_curves(records)
    doc = {
        "title": title,
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "split": split,
        "baseline_arm": baseline_arm,
        "arms": arms,
        "seeds_per_arm": {a: sum(r.arm == a for r in records) for a in arms},
        "metrics": metrics_table(records, split, baseline_arm, n_boot, seed),
        # Arm against arm beside the baseline (gti vs random: grounding's own share).
        "pairwise": pairwise_table(records, split, baseline_arm, n_boot, seed),
        "cold": cold_table(records, baseline_arm, n_boot, seed),
        "learning_curves": {m: {a: [[p["step"], p["mean"]] for p in pts] for a, pts in arms_.items()}
                            for m, arms_ in curves.items()},
        "learning_curves_range": {m: {a: [[p["step"], p["min"], p["max"], p["n"]] for p in pts]
                                      for a, pts in arms_.items()} for m, arms_ in curves.items()},
        "curve_reading": curve_reading(curves, baseline_arm),
        "wall_time": wall_time_table(records, baseline_arm),
        "diagnostics": diagnostics_table(records, n_boot=n_boot, seed=seed),
        "rsa_levels": rsa_level_table(records),
        "baselines": baselines,
        "runs": [
            {"arm": r.arm, "seed": r.seed, "run_dir": r.run_dir,
             "facts": dict(run_facts[i]) if run_facts else {},
             "diagnostics": {ph: {k: v for k, v in d.items()} for ph, d in r.diagnostics.items()}}
            for i, r in enumerate(records)
        ],
        "configs": configs,
        "versions": versions,
        "plots": {cap: Path(p).name for cap, p in (plots or {}).items()},
    }
    doc["reading"] = reading(doc)
    doc = _clean(doc)
    paths = {"html": out / "report.html", "json": out / "report.json", "csv": out / "report.csv"}
    atomic_write_bytes(paths["json"], (json.dumps(doc, indent=1, allow_nan=False) + "\n").encode())
    atomic_write_bytes(paths["csv"], _csv_text(doc["metrics"] + doc["pairwise"] + doc["cold"]["rows"]
                                               + doc["diagnostics"]).encode())
    atomic_write_bytes(paths["html"], render_html(doc, {c: Path(p) for c, p in (plots or {}).items()}).encode())
    return paths


def spectra_plots(records: Sequence[RunRecord], plot_dir: str | Path) -> dict[str, Path]:
    """One spectrum plot per phase, a line per arm (its first seed); {caption: png path}."""
    from gti.diagnostics.plots import plot_spectra

    out = {}
    for phase in PHASES:
        spectra = {}
        for arm in _ordered_arms(records):
            rec = next((r for r in records if r.arm == arm and phase in r.diagnostics), None)
            sv = _dig(rec.diagnostics[phase], ("singular_values",)) if rec else None
            if sv:
                spectra[f"{arm} (seed {rec.seed})"] = sv
        if spectra:
            out[f"singular-value spectra after {phase}" if phase != "init" else "singular-value spectra at init"] = (
                plot_spectra(spectra, Path(plot_dir) / f"spectra_{phase}.png",
                             title=f"E_new spectrum ({phase})")
            )
    return out


def learning_curve_plots(records: Sequence[RunRecord], plot_dir: str | Path) -> dict[str, Path]:
    """One plot per curve metric (val_loss, val_mrr, val_recall@10, ...): x = SFT step, a line
    per arm (mean over seeds) with a min-max band; {caption: png path} (files curve_*.png)."""
    from gti.diagnostics.plots import plot_learning_curves

    out = {}
    for metric, arms in learning_curves(records).items():
        series = {arm: {"step": [p["step"] for p in pts], "mean": [p["mean"] for p in pts],
                        "lo": [p["min"] for p in pts], "hi": [p["max"] for p in pts]}
                  for arm, pts in arms.items()}
        slug = "".join(c if c.isalnum() or c in "._-" else "_" for c in metric)
        arrow = "higher" if higher_is_better(metric) else "lower"
        out[f"learning curve: {metric} ({arrow} is better)"] = plot_learning_curves(
            series, Path(plot_dir) / f"{CURVE_PLOT_PREFIX}{slug}.png", metric=metric,
            title=f"{metric} during SFT (mean over seeds, min-max band)",
        )
    return out
