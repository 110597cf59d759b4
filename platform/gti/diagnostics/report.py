"""The run/comparison report: one self-contained HTML file plus the same numbers as JSON and CSV.

What it is for: turning per-run records (evaluation metrics, geometry diagnostics, configs,
package versions) of one or many arms x seeds into
- `report.json`: every table, per-run summaries, configs and versions;
- `report.csv`: the metrics and diagnostics tables in long form (one row per arm x split/phase x
  quantity), the very numbers the HTML shows;
- `report.html`: inline CSS, plots embedded as base64 `data:` URIs, no scripts, no external
  assets -- it opens from disk without a server.

Statistics (documented in the report itself):
- mean +- std over seeds (sample std, ddof=1; empty with one seed);
- relative lift against the baseline arm (default `mean`): mean_arm / mean_baseline - 1;
- 95% bootstrap CIs. When every run's metrics.json carries `per_user` values (see
  docs/ARCHITECTURE.md, evaluate row), users are resampled: the arm CI resamples users of the
  per-user mean over seeds, and the lift CI is a *paired* bootstrap over the users both arms
  evaluated. Otherwise the arm CI averages the per-seed user-bootstrap bounds that the
  evaluate stage reported, and the lift CI resamples seeds (only with >= 2 seeds per arm).
  The method used is written next to every CI (`ci_method`).
- Exact-rank metrics (evaluate with `eval.exact_rank`): MRR and mean percentile rank rows per
  arm, from metrics.json `ranks[split]`; their per-user values (1/rank and (rank-1)/(N-1)) are
  derived from `per_user[split].exact_rank`, so the same user/paired bootstraps apply.
- Direction: every metric row says whether higher is better (`direction`); for
  mean_percentile_rank and invalid_sid_rate lower is better, so a negative lift is an
  improvement. `verdict` (better / worse / no clear difference) reads the lift CI with the
  direction; the "Reading" section of the HTML says the same in words.
- Cold slice (metrics.json `slices.cold`): per arm x split, mean +- std over seeds of the
  slice's values, CI = per-seed bounds averaged, lift CI = seed bootstrap (no per-user slice
  values are stored), with n_users per seed and the definition.
- Learning curves (RunRecord.curves, e.g. val_loss / val_mrr / val_recall@10 of SFT): mean over
  the seeds that logged each step, min-max band in the plots; report.json "learning_curves".
- Wall time (RunRecord.timing): ground and SFT stage seconds per arm (mean over seeds) and
  their total; report.json "wall_time".

What it does not know: how runs were produced, Ray, files of other stages (callers pass plain
dicts), or how diagnostics are computed (`gti.diagnostics.geometry`).
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from gti.files import atomic_write_bytes

PHASES = ("init", "ground", "sft")
# Diagnostics shown in the table: (column name, how to read it from geometry.diagnose output).
DIAG_QUANTITIES: list[tuple[str, Sequence[str]]] = [
    ("effective_rank", ("effective_rank",)),
    ("block_contrast", ("block", "contrast")),
    ("rsa_pearson", ("rsa", "overall", "pearson")),
    ("rsa_spearman", ("rsa", "overall", "spearman")),
    ("mean_cosine_new", ("mean_cosine_new",)),
    ("mean_cosine_new_text", ("mean_cosine_new_text",)),
]
CSV_COLUMNS = [
    "table", "arm", "group", "name", "n", "mean", "std", "ci_lo", "ci_hi",
    "lift", "lift_ci_lo", "lift_ci_hi", "ci_method", "direction", "verdict",
]
# Metrics derived from exact ranks (metrics.json "ranks"; per-user from per_user.exact_rank).
RANK_METRICS = ("mrr", "mean_percentile_rank")
# Quantities where a smaller value is the better one (everything else: higher is better).
LOWER_IS_BETTER = frozenset({"mean_percentile_rank", "invalid_sid_rate", "median_rank", "mean_rank"})
# Learning curves shown first, in this order (others follow alphabetically).
CURVE_ORDER = ("val_loss", "val_mrr", "val_recall@10")


@dataclass
class RunRecord:
    """Everything the report needs from one finished run (one arm, one seed).

    metrics: the evaluate stage's metrics.json ({"splits": {split: {metric: {"value", "ci"}}},
    "baselines": ..., "invalid_sid_rate": ..., optional "per_user", "ranks", "slices"});
    diagnostics: {phase: geometry.diagnose(...) dict} for the phases that exist.
    curves: {metric: [[step, value], ...]} validation curves of SFT (val_loss, val_mrr, ...).
    timing: wall seconds {"ground_s", "sft_s"} (stage durations; optional "ground_compute_s",
    "sft_compute_s", and "grounding": whether grounding trained).
    """

    arm: str
    seed: int
    metrics: dict[str, Any] = field(default_factory=dict)
    diagnostics: dict[str, dict[str, Any]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    run_dir: str = ""
    curves: dict[str, list[list[float]]] = field(default_factory=dict)
    timing: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- helpers
def _num(x: Any) -> float | None:
    """A finite float or None (JSON has no NaN)."""
    if x is None:
        return None
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _clean(obj: Any) -> Any:
    """Copy of a nested structure with NaN/inf -> None and numpy scalars -> Python."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        return _num(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.ndarray):
        return _clean(obj.tolist())
    return obj


def _dig(d: Any, path: Sequence[str]) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def metric_entry(entry: Any) -> tuple[float | None, tuple[float, float] | None]:
    """(value, ci) from a metrics.json entry: {"value": v, "ci": [lo, hi]} or a bare number."""
    if isinstance(entry, dict):
        ci = entry.get("ci")
        ci_t = (float(ci[0]), float(ci[1])) if isinstance(ci, (list, tuple)) and len(ci) == 2 else None
        return _num(entry.get("value")), ci_t
    return _num(entry), None


def _mean_std(vals: Sequence[float]) -> tuple[float | None, float | None]:
    v = [x for x in vals if x is not None]
    if not v:
        return None, None
    mean = float(np.mean(v))
    std = float(np.std(v, ddof=1)) if len(v) >= 2 else None
    return mean, std


def _percentile_ci(samples: np.ndarray) -> tuple[float | None, float | None]:
    s = samples[np.isfinite(samples)]
    if s.size == 0:
        return None, None
    lo, hi = np.percentile(s, [2.5, 97.5])
    return float(lo), float(hi)


def _ordered_arms(records: Sequence[RunRecord]) -> list[str]:
    seen: list[str] = []
    for r in records:
        if r.arm not in seen:
            seen.append(r.arm)
    return seen


def higher_is_better(name: str) -> bool:
    """Direction of a metric / curve: False for ranks, rates of failure and losses."""
    return name not in LOWER_IS_BETTER and not name.endswith("loss")


def _n_items(rec: RunRecord, split: str) -> int | None:
    """Catalog size the exact ranks of `split` were taken over."""
    for path in (("ranks", split, "n_items"), ("slices", "cold", "definition", "n_items")):
        n = _num(_dig(rec.metrics, path))
        if n is not None and n >= 1:
            return int(n)
    return None


def _rank_values(ranks: Sequence[Any], metric: str, n_items: int | None) -> list[float | None]:
    """Per-user MRR terms (1/rank) or percentile ranks ((rank-1)/(N-1)) from exact ranks."""
    out: list[float | None] = []
    for r in ranks:
        v = _num(r)
        if v is None or v < 1:
            out.append(None)
        elif metric == "mrr":
            out.append(1.0 / v)
        elif n_items is None:
            out.append(None)
        else:
            out.append((v - 1.0) / (n_items - 1) if n_items > 1 else 0.0)
    return out


def _per_user(rec: RunRecord, split: str, metric: str) -> dict[str, float] | None:
    pu = _dig(rec.metrics, ("per_user", split))
    if not isinstance(pu, dict) or "user_ids" not in pu:
        return None
    ids = pu["user_ids"]
    if metric in RANK_METRICS:
        if not isinstance(pu.get("exact_rank"), list):
            return None
        vals = _rank_values(pu["exact_rank"], metric, _n_items(rec, split))
    elif metric in pu:
        vals = pu[metric]
    else:
        return None
    if len(ids) != len(vals):
        return None
    got = {str(u): float(v) for u, v in zip(ids, vals) if _num(v) is not None}
    return got or None


def _user_means(recs: Sequence[RunRecord], split: str, metric: str) -> dict[str, float] | None:
    """Per-user metric averaged over the seeds of one arm (users every seed evaluated)."""
    maps = [_per_user(r, split, metric) for r in recs]
    if not maps or any(m is None for m in maps):
        return None
    common = set(maps[0]).intersection(*maps[1:])
    return {u: float(np.mean([m[u] for m in maps])) for u in sorted(common)}


# --------------------------------------------------------------------------- tables
def metric_names(records: Sequence[RunRecord], split: str) -> list[str]:
    """Metric names of `split` in first-seen order, plus invalid_sid_rate when reported."""
    names: list[str] = []
    for r in records:
        for m in (_dig(r.metrics, ("splits", split)) or {}):
            if m not in names:
                names.append(m)
    for m in RANK_METRICS:
        if any(_dig(r.metrics, ("ranks", split, m)) is not None or _per_user(r, split, m) for r in records):
            names.append(m)
    if any(_num(r.metrics.get("invalid_sid_rate")) is not None for r in records):
        names.append("invalid_sid_rate")
    return names


def _values(recs: Sequence[RunRecord], split: str, metric: str):
    vals, cis = [], []
    for r in recs:
        if metric == "invalid_sid_rate":
            v, ci = _num(r.metrics.get("invalid_sid_rate")), None
        elif metric in RANK_METRICS:
            v, ci = metric_entry(_dig(r.metrics, ("ranks", split, metric)))
            if v is None and (pu := _per_user(r, split, metric)):
                v = float(np.mean(list(pu.values())))
        else:
            v, ci = metric_entry(_dig(r.metrics, ("splits", split, metric)))
        vals.append(v)
        cis.append(ci)
    return vals, cis


def metrics_table(
    records: Sequence[RunRecord],
    split: str = "test",
    baseline_arm: str = "mean",
    n_boot: int = 1000,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Long-form metrics rows: one per arm x metric, with mean, std, CI and lift vs baseline."""
    rng = np.random.default_rng(seed)
    arms = _ordered_arms(records)
    by_arm = {a: [r for r in records if r.arm == a] for a in arms}
    base = by_arm.get(baseline_arm)
    rows = []
    for metric in metric_names(records, split):
        base_vals = _values(base, split, metric)[0] if base else None
        base_mean = _mean_std(base_vals)[0] if base_vals else None
        base_users = _user_means(base, split, metric) if base else None
        for arm in arms:
            recs = by_arm[arm]
            vals, cis = _values(recs, split, metric)
            mean, std = _mean_std(vals)
            row: dict[str, Any] = {
                "table": "metrics", "arm": arm, "group": split, "name": metric,
                "n": sum(v is not None for v in vals), "mean": mean, "std": std,
                "ci_lo": None, "ci_hi": None, "lift": None, "lift_ci_lo": None, "lift_ci_hi": None,
                "ci_method": "", "direction": "higher" if higher_is_better(metric) else "lower",
                "verdict": None,
            }
            users = _user_means(recs, split, metric)
            if users and n_boot > 0:
                x = np.array(list(users.values()))
                idx = rng.integers(0, x.size, size=(n_boot, x.size))
                row["ci_lo"], row["ci_hi"] = _percentile_ci(x[idx].mean(axis=1))
                row["ci_method"] = "user bootstrap"
            elif any(c is not None for c in cis):
                got = [c for c in cis if c is not None]
                row["ci_lo"] = float(np.mean([c[0] for c in got]))
                row["ci_hi"] = float(np.mean([c[1] for c in got]))
                row["ci_method"] = "per-seed user bootstrap, bounds averaged"
            if base_mean not in (None, 0.0) and mean is not None:
                row["lift"] = mean / base_mean - 1.0
                if arm != baseline_arm and n_boot > 0:
                    row["lift_ci_lo"], row["lift_ci_hi"], how = _lift_ci(
                        users, base_users, vals, base_vals, n_boot, rng
                    )
                    row["ci_method"] += f"; lift: {how}" if how else ""
                    row["verdict"] = verdict(row)
            rows.append(row)
    return rows


def verdict(row: Mapping[str, Any]) -> str | None:
    """'better' / 'worse' than the baseline arm when the lift CI excludes 0 (read with the
    metric's direction), 'no clear difference' when it contains 0; without a lift CI the
    point estimate with '(no CI)'; None without a lift."""
    lift = _num(row.get("lift"))
    if lift is None:
        return None
    up = (row.get("direction") or "higher") == "higher"
    lo, hi = _num(row.get("lift_ci_lo")), _num(row.get("lift_ci_hi"))
    if lo is not None and hi is not None:
        if lo > 0 or hi < 0:
            return "better" if (lo > 0) == up else "worse"
        return "no clear difference"
    if lift == 0:
        return "equal (no CI)"
    return ("better" if (lift > 0) == up else "worse") + " (no CI)"


def _lift_ci(users, base_users, vals, base_vals, n_boot, rng):
    if users and base_users:
        common = sorted(set(users) & set(base_users))
        if len(common) >= 2:
            a = np.array([users[u] for u in common])
            b = np.array([base_users[u] for u in common])
            idx = rng.integers(0, len(common), size=(n_boot, len(common)))
            with np.errstate(divide="ignore", invalid="ignore"):
                lifts = a[idx].mean(1) / b[idx].mean(1) - 1.0
            lo, hi = _percentile_ci(lifts)
            return lo, hi, "paired user bootstrap"
    a = np.array([v for v in vals if v is not None])
    b = np.array([v for v in (base_vals or []) if v is not None])
    if a.size >= 2 and b.size >= 2:
        ia = rng.integers(0, a.size, size=(n_boot, a.size))
        ib = rng.integers(0, b.size, size=(n_boot, b.size))
        with np.errstate(divide="ignore", invalid="ignore"):
            lifts = a[ia].mean(1) / b[ib].mean(1) - 1.0
        lo, hi = _percentile_ci(lifts)
        return lo, hi, "seed bootstrap"
    return None, None, ""


# Diagnostics with bootstrap replicates stored beside them by geometry.diagnose: (name ->
# path of the replicates, what was resampled).
DIAG_BOOT: dict[str, tuple[Sequence[str], str]] = {
    "rsa_pearson": (("rsa", "overall", "pearson_boot"), "codes"),
    "rsa_spearman": (("rsa", "overall", "spearman_boot"), "codes"),
}


# Diagnostics whose CI is the spread over seeds (no within-run resampling is unbiased for them).
SEED_CI_DIAGS = frozenset({"effective_rank"})


def _nested_boot_ci(
    per_seed: Sequence[Sequence[float]], n_boot: int, rng: np.random.Generator
) -> tuple[float | None, float | None]:
    """95% CI of a mean over seeds from each seed's own bootstrap replicates [n_seed][B_s]:
    each draw picks seeds with replacement and one replicate of each picked seed (a two-level
    bootstrap, so both the spread between seeds and the resampling within a run count)."""
    reps = [np.asarray([v for v in r if v is not None and np.isfinite(v)], dtype=float) for r in per_seed]
    reps = [r for r in reps if r.size]
    if not reps:
        return None, None
    picks = rng.integers(0, len(reps), size=(n_boot, len(reps)))
    draws = np.empty((n_boot, len(reps)))
    for j in range(len(reps)):
        for i, r in enumerate(reps):
            rows = picks[:, j] == i
            draws[rows, j] = r[rng.integers(0, r.size, int(rows.sum()))]
    return _percentile_ci(draws.mean(axis=1))


def diagnostics_table(
    records: Sequence[RunRecord], n_boot: int = 1000, seed: int = 0
) -> list[dict[str, Any]]:
    """Long-form diagnostics rows: one per arm x phase x quantity, mean and std over seeds; a
    95% CI where the runs stored bootstrap replicates (`DIAG_BOOT`, `_nested_boot_ci`), and a
    seed bootstrap CI for `SEED_CI_DIAGS` with two or more seeds."""
    rng = np.random.default_rng(seed)
    rows = []
    for arm in _ordered_arms(records):
        recs = [r for r in records if r.arm == arm]
        for phase in PHASES:
            have = [r.diagnostics[phase] for r in recs if phase in r.diagnostics]
            if not have:
                continue
            for name, path in DIAG_QUANTITIES:
                vals = [_num(_dig(d, path)) for d in have]
                if all(v is None for v in vals) and name.startswith("mean_cosine_new_text"):
                    continue  # no text rows were sampled for this run
                mean, std = _mean_std(vals)
                lo = hi = None
                method = ""
                if name in DIAG_BOOT:
                    path_boot, what = DIAG_BOOT[name]
                    boots = [_dig(d, path_boot) or [] for d in have]
                    lo, hi = _nested_boot_ci(boots, n_boot, rng)
                    if lo is not None:
                        n_with = sum(bool(b) for b in boots)
                        method = f"{what} bootstrap" if n_with == 1 else f"seed x {what} bootstrap"
                elif name in SEED_CI_DIAGS:
                    got = np.array([v for v in vals if v is not None], dtype=float)
                    if got.size >= 2:  # the mean over seeds, seeds resampled
                        lo, hi = _percentile_ci(got[rng.integers(0, got.size, (n_boot, got.size))].mean(1))
                        method = "seed bootstrap"
                rows.append({
                    "table": "diagnostics", "arm": arm, "group": phase, "name": name,
                    "n": sum(v is not None for v in vals), "mean": mean, "std": std,
                    "ci_lo": lo, "ci_hi": hi, "lift": None, "lift_ci_lo": None,
                    "lift_ci_hi": None, "ci_method": method,
                })
    return rows


def rsa_level_table(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """Per-level RSA (Pearson, Spearman) per arm x phase, mean over seeds."""
    rows = []
    for arm in _ordered_arms(records):
        recs = [r for r in records if r.arm == arm]
        for phase in PHASES:
            levels: dict[int, list[tuple[float | None, float | None]]] = {}
            for r in recs:
                for lv in _dig(r.diagnostics.get(phase, {}), ("rsa", "per_level")) or []:
                    levels.setdefault(int(lv["level"]), []).append(
                        (_num(lv.get("pearson")), _num(lv.get("spearman")))
                    )
            for lvl, pairs in sorted(levels.items()):
                rows.append({
                    "arm": arm, "phase": phase, "level": lvl,
                    "pearson": _mean_std([p for p, _ in pairs])[0],
                    "spearman": _mean_std([s for _, s in pairs])[0],
                })
    return rows


def _cold_splits(records: Sequence[RunRecord]) -> list[str]:
    splits: list[str] = []
    for r in records:
        for sp, block in (_dig(r.metrics, ("slices", "cold")) or {}).items():
            if sp != "definition" and isinstance(block, dict) and block.get("n_users") and sp not in splits:
                splits.append(sp)
    return splits


def _cold_entry(rec: RunRecord, split: str, metric: str):
    block = _dig(rec.metrics, ("slices", "cold", split)) or {}
    if not block.get("n_users"):
        return None, None
    src = block.get("ranks") if metric in RANK_METRICS else block.get("model")
    return metric_entry((src or {}).get(metric))


def cold_table(
    records: Sequence[RunRecord], baseline_arm: str = "mean", n_boot: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """The cold-item slice (metrics.json slices.cold) per arm x split.

    -> {"definition": {...} of the first run that has one, "n_users": {arm: {split: [n per
    seed]}}, "baselines": {split: {name: table}} (first run's), "rows": long-form rows like
    metrics_table's (table "cold", group "cold/<split>"): mean +- std over seeds, CI = the
    per-seed bounds averaged, lift vs the baseline arm with a seed-bootstrap CI}. Empty
    rows when no run has a cold slice (old runs).
    """
    rng = np.random.default_rng(seed)
    definition = next((d for r in records if (d := _dig(r.metrics, ("slices", "cold", "definition")))), {})
    out: dict[str, Any] = {"definition": definition, "n_users": {}, "baselines": {}, "rows": []}
    arms = _ordered_arms(records)
    by_arm = {a: [r for r in records if r.arm == a] for a in arms}
    for split in _cold_splits(records):
        names: list[str] = []
        for r in records:
            block = _dig(r.metrics, ("slices", "cold", split)) or {}
            for m in list(block.get("model") or {}) + [m for m in RANK_METRICS if m in (block.get("ranks") or {})]:
                if m not in names:
                    names.append(m)
        first = next(r for r in records if _dig(r.metrics, ("slices", "cold", split, "n_users")))
        out["baselines"][split] = _dig(first.metrics, ("slices", "cold", split, "baselines")) or {}
        for arm in arms:
            out["n_users"].setdefault(arm, {})[split] = [
                _dig(r.metrics, ("slices", "cold", split, "n_users")) for r in by_arm[arm]
            ]
        base = by_arm.get(baseline_arm) or []
        for metric in names:
            base_vals = [_cold_entry(r, split, metric)[0] for r in base]
            base_mean = _mean_std(base_vals)[0]
            for arm in arms:
                got = [_cold_entry(r, split, metric) for r in by_arm[arm]]
                vals = [v for v, _ in got]
                cis = [c for _, c in got if c is not None]
                mean, std = _mean_std(vals)
                if mean is None:
                    continue
                row: dict[str, Any] = {
                    "table": "cold", "arm": arm, "group": f"cold/{split}", "name": metric,
                    "n": sum(v is not None for v in vals), "mean": mean, "std": std,
                    "ci_lo": float(np.mean([c[0] for c in cis])) if cis else None,
                    "ci_hi": float(np.mean([c[1] for c in cis])) if cis else None,
                    "lift": None, "lift_ci_lo": None, "lift_ci_hi": None,
                    "ci_method": "per-seed user bootstrap, bounds averaged" if cis else "",
                    "direction": "higher" if higher_is_better(metric) else "lower", "verdict": None,
                }
                if base_mean not in (None, 0.0):
                    row["lift"] = mean / base_mean - 1.0
                    if arm != baseline_arm and n_boot > 0:
                        row["lift_ci_lo"], row["lift_ci_hi"], how = _lift_ci(
                            None, None, vals, base_vals, n_boot, rng
                        )
                        row["ci_method"] += f"; lift: {how}" if how else ""
                        row["verdict"] = verdict(row)
                out["rows"].append(row)
    return out


def _curve_order(names: Iterable[str]) -> list[str]:
    names = list(dict.fromkeys(names))
    return [n for n in CURVE_ORDER if n in names] + sorted(n for n in names if n not in CURVE_ORDER)


def learning_curves(records: Sequence[RunRecord]) -> dict[str, dict[str, list[dict[str, float]]]]:
    """{metric: {arm: [{"step", "mean", "min", "max", "n"}, ...]}} over the seeds of each arm that
    logged the step (steps ascending)."""
    names = _curve_order(m for r in records for m, pts in (r.curves or {}).items() if pts)
    out: dict[str, dict[str, list[dict[str, float]]]] = {}
    for metric in names:
        for arm in _ordered_arms(records):
            at: dict[float, list[float]] = {}
            for r in records:
                if r.arm != arm:
                    continue
                for pt in (r.curves or {}).get(metric) or []:
                    step, val = _num(pt[0]), _num(pt[1])
                    if step is not None and val is not None:
                        at.setdefault(step, []).append(val)
            if at:
                out.setdefault(metric, {})[arm] = [
                    {"step": int(st) if float(st).is_integer() else st, "mean": float(np.mean(v)),
                     "min": float(np.min(v)), "max": float(np.max(v)), "n": len(v)}
                    for st, v in sorted(at.items())
                ]
    return out


def _standing(p: Mapping[str, float], b: Mapping[str, float], up: bool) -> str:
    """'ahead of' / 'behind' / 'level with' for curve point p against baseline point b."""
    if p["mean"] == b["mean"]:
        return "level with"
    ahead = (p["mean"] > b["mean"]) == up
    apart = p["min"] > b["max"] or p["max"] < b["min"]
    overlap = not apart and (p["n"] > 1 or b["n"] > 1)
    return ("ahead of" if ahead else "behind") + (" (seed ranges overlap)" if overlap else "")


def curve_reading(curves: Mapping[str, Mapping[str, Sequence[Mapping[str, float]]]],
                  baseline_arm: str) -> list[str]:
    """Plain-words reading of each arm's curve against the baseline arm's: ahead / behind at
    the first and the last validation step both logged (mean over seeds; "seed ranges
    overlap" when the min-max bands touch), and who catches up in between."""
    out = []
    for metric, arms in curves.items():
        base = {p["step"]: p for p in arms.get(baseline_arm) or []}
        up = higher_is_better(metric)
        for arm, pts in arms.items():
            common = [p for p in pts if p["step"] in base]
            if arm == baseline_arm or not common:
                continue
            first, last = common[0], common[-1]
            s0, s1 = _standing(first, base[first["step"]], up), _standing(last, base[last["step"]], up)
            text = (f"{metric}: {arm} starts {s0} {baseline_arm} at step {first['step']} "
                    f"({fmt_plain(first['mean'])} vs {fmt_plain(base[first['step']]['mean'])})")
            if last is not first:
                text += (f" and is {s1} it at step {last['step']} "
                         f"({fmt_plain(last['mean'])} vs {fmt_plain(base[last['step']]['mean'])})")
                if s0.startswith("ahead") and not s1.startswith("ahead"):
                    text += f"; {baseline_arm} catches up"
                elif s0.startswith("behind") and not s1.startswith("behind"):
                    text += f"; {arm} catches up" + (" and overtakes" if s1.startswith("ahead") else "")
            text += f" [{'higher' if up else 'lower'} is better]."
            out.append(text)
    return out


def wall_time_table(records: Sequence[RunRecord], baseline_arm: str = "mean") -> dict[str, dict[str, Any]]:
    """{arm: {"ground_s", "sft_s", "total_s" (means over seeds), "total_s_std", "n_runs",
    "grounding", "ground_compute_s", "sft_compute_s", "extra_vs_baseline_s"}}; arms whose runs
    carry no timing are left out (old runs)."""
    out: dict[str, dict[str, Any]] = {}
    for arm in _ordered_arms(records):
        recs = [r for r in records if r.arm == arm and r.timing]
        if not recs:
            continue
        row: dict[str, Any] = {"n_runs": len(recs)}
        for key in ("ground_s", "sft_s", "ground_compute_s", "sft_compute_s"):
            row[key] = _mean_std([_num(r.timing.get(key)) for r in recs])[0]
        totals = [None if _num(r.timing.get("ground_s")) is None and _num(r.timing.get("sft_s")) is None
                  else (_num(r.timing.get("ground_s")) or 0.0) + (_num(r.timing.get("sft_s")) or 0.0)
                  for r in recs]
        row["total_s"], row["total_s_std"] = _mean_std(totals)
        row["grounding"] = any(bool(r.timing.get("grounding")) for r in recs)
        out[arm] = row
    base = (out.get(baseline_arm) or {}).get("total_s")
    for row in out.values():
        row["extra_vs_baseline_s"] = (
            row["total_s"] - base if base is not None and row["total_s"] is not None else None
        )
    return out


def reading(doc: Mapping[str, Any]) -> list[str]:
    """The report's numbers in plain words: per arm, which metrics are better / worse than the
    baseline arm (lift CI excluding 0, direction-aware), on all users and on the cold slice;
    then the learning-curve reading."""
    base = doc["baseline_arm"]
    lines = []
    for label, rows in (("", doc["metrics"]), (" on the cold slice", (doc.get("cold") or {}).get("rows") or [])):
        groups: dict[tuple[str, str], dict[str, list[str]]] = {}
        for r in rows:
            if r["arm"] == base or not r.get("verdict"):
                continue
            v = r["verdict"].replace(" (no CI)", "")
            key = "better" if v == "better" else "worse" if v == "worse" else "unclear"
            if r.get("lift_ci_lo") is None:
                key += "_noci"
            lift = _pct_plain(r["lift"])
            if r.get("lift_ci_lo") is not None:
                lift += f" [{_pct_plain(r['lift_ci_lo'])}, {_pct_plain(r['lift_ci_hi'])}]"
            arrow = "" if r.get("direction", "higher") == "higher" else ", lower is better"
            groups.setdefault((r["arm"], r["group"]), {}).setdefault(key, []).append(
                f"{r['name']} ({lift}{arrow})"
            )
        for (arm, group), g in groups.items():
            parts = []
            if g.get("better"):
                parts.append("better on " + "; ".join(g["better"]))
            if g.get("worse"):
                parts.append("worse on " + "; ".join(g["worse"]))
            if g.get("unclear"):
                parts.append("no clear difference (95% CI of the lift contains 0) on "
                             + ", ".join(x.split(" (")[0] for x in g["unclear"]))
            for k, word in (("better_noci", "better by the point estimate only (no CI)"),
                            ("worse_noci", "worse by the point estimate only (no CI)"),
                            ("unclear_noci", "equal (no CI)")):
                if g.get(k):
                    parts.append(f"{word} on " + ", ".join(x.split(" (")[0] for x in g[k]))
            grp = group.split("/", 1)[-1]
            lines.append(f"{arm} vs {base} ({grp}){label}: " + "; ".join(parts) + ".")
    lines += doc.get("curve_reading") or []
    wt = doc.get("wall_time") or {}
    for arm, w in wt.items():
        if arm != base and w.get("extra_vs_baseline_s") is not None and base in wt:
            lines.append(
                f"wall time: {arm} takes {fmt_plain(w['total_s'])} s (ground + SFT stages), "
                f"{fmt_plain(w['extra_vs_baseline_s'])} s {'more' if w['extra_vs_baseline_s'] >= 0 else 'less'}"
                f" than {base}."
            )
    return lines


# --------------------------------------------------------------------------- rendering
def _number_text(x: Any, digits: int, missing: str) -> str:
    v = _num(x)
    if v is None:
        return missing
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
        return f"{v:.{digits - 1}e}"
    return f"{v:.{digits}g}"


def fmt(x: Any, digits: int = 4) -> str:
    """Human number: 4 significant digits, '-' for missing."""
    return _number_text(x, digits, "&ndash;")


def _pct(x: Any) -> str:
    v = _num(x)
    return "&ndash;" if v is None else f"{v * 100:+.1f}%"


def fmt_plain(x: Any, digits: int = 4) -> str:
    """fmt() without HTML entities (for plain-text readings)."""
    return _number_text(x, digits, "-")


def _pct_plain(x: Any) -> str:
    v = _num(x)
    return "-" if v is None else f"{v * 100:+.1f}%"


def _data_attrs(row: Mapping[str, Any]) -> str:
    """data-* attributes carrying the exact JSON numbers of a cell (repr, round-trips)."""
    keys = ("arm", "group", "name", "mean", "std", "ci_lo", "ci_hi", "lift")
    parts = []
    for k in keys:
        v = row.get(k)
        s = "" if v is None else (repr(float(v)) if isinstance(v, (int, float)) else str(v))
        parts.append(f'data-{k.replace("_", "-")}="{html.escape(s, quote=True)}"')
    return " ".join(parts)


def _metric_cell(row: Mapping[str, Any]) -> str:
    txt = fmt(row["mean"])
    if row.get("std") is not None:
        txt += f" &plusmn; {fmt(row['std'])}"
    if row.get("ci_lo") is not None:
        txt += f'<br><span class="ci">[{fmt(row["ci_lo"])}, {fmt(row["ci_hi"])}]</span>'
    if row.get("lift") is not None:
        v = (row.get("verdict") or "").replace(" (no CI)", "")
        cls = "lift good" if v == "better" else "lift bad" if v == "worse" else "lift"
        title = f' title="{html.escape(row["verdict"], quote=True)}"' if row.get("verdict") else ""
        lift = f'<br><span class="{cls}"{title}>{_pct(row["lift"])}'
        if row.get("lift_ci_lo") is not None:
            lift += f' [{_pct(row["lift_ci_lo"])}, {_pct(row["lift_ci_hi"])}]'
        txt += lift + "</span>"
    return f'<td class="num" {_data_attrs(row)}>{txt}</td>'


def _pivot(rows: Sequence[Mapping[str, Any]], row_key, col_key) -> tuple[list, list, dict]:
    rkeys, ckeys, cells = [], [], {}
    for r in rows:
        rk, ck = row_key(r), col_key(r)
        if rk not in rkeys:
            rkeys.append(rk)
        if ck not in ckeys:
            ckeys.append(ck)
        cells[(rk, ck)] = r
    return rkeys, ckeys, cells


def _col_label(name: Any) -> str:
    """Column header: the metric name, with a down arrow when lower is better."""
    n = html.escape(str(name))
    return n if higher_is_better(str(name)) else f'{n} <span title="lower is better">&darr;</span>'


def _table_html(rows, row_key, col_key, row_headers: Sequence[str], cls: str, col_label=None) -> str:
    if not rows:
        return "<p><em>nothing to show</em></p>"
    rkeys, ckeys, cells = _pivot(rows, row_key, col_key)
    out = [f'<table class="{cls}"><thead><tr>']
    out += [f"<th>{html.escape(h)}</th>" for h in row_headers]
    out += [f"<th>{col_label(c) if col_label else html.escape(str(c))}</th>" for c in ckeys]
    out.append("</tr></thead><tbody>")
    for rk in rkeys:
        rk_t = rk if isinstance(rk, tuple) else (rk,)
        out.append("<tr>" + "".join(f"<th>{html.escape(str(x))}</th>" for x in rk_t))
        for ck in ckeys:
            r = cells.get((rk, ck))
            out.append(_metric_cell(r) if r else "<td></td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _kv_table(d: Mapping[str, Any]) -> str:
    rows = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in d.items()
    )
    return f'<table class="kv">{rows}</table>'


def _baselines_html(baselines: Mapping[str, Any], split: str) -> str:
    if not baselines:
        return "<p><em>no baselines reported</em></p>"
    rows, names = [], []
    for b, m in baselines.items():
        src = m.get(split, m) if isinstance(m, dict) else {}
        for k in src:
            if k not in names:
                names.append(k)
        rows.append((b, src))
    out = ["<table><thead><tr><th>baseline</th>"]
    out += [f"<th>{html.escape(n)}</th>" for n in names] + ["</tr></thead><tbody>"]
    for b, src in rows:
        out.append(f"<tr><th>{html.escape(str(b))}</th>")
        for n in names:
            v, ci = metric_entry(src.get(n))
            cell = fmt(v) + (f'<br><span class="ci">[{fmt(ci[0])}, {fmt(ci[1])}]</span>' if ci else "")
            out.append(f'<td class="num">{cell}</td>')
        out.append("</tr>")
    return "".join(out) + "</tbody></table>"


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1200px;
color:#222;padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:.8em 0;font-size:.85em}
th,td{border:1px solid #ddd;padding:.35em .6em;vertical-align:top}
thead th{background:#f3f3f3}td.num{text-align:right;white-space:nowrap}
.ci{color:#666;font-size:.85em}.lift{color:#555;font-size:.85em}
.lift.good{color:#1a6d2f;font-weight:600}.lift.bad{color:#a61b1b;font-weight:600}
.kv th{text-align:left;background:#fafafa}
figure{display:inline-block;margin:.5em;vertical-align:top}
figure img{max-width:560px;border:1px solid #eee}figcaption{font-size:.8em;color:#555}
pre{background:#f7f7f7;padding:.6em;overflow:auto;font-size:.8em;max-height:30em}
.note{color:#555;font-size:.85em}
"""


def _img_tag(path: Path, caption: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    cap = html.escape(caption)
    return (
        f'<figure><img alt="{cap}" src="data:image/png;base64,{data}">'
        f"<figcaption>{cap}</figcaption></figure>"
    )


CURVE_PLOT_PREFIX = "curve_"


def _is_curve_plot(path: Path) -> bool:
    return Path(path).name.startswith(CURVE_PLOT_PREFIX)


def _reading_html(lines: Sequence[str]) -> str:
    if not lines:
        return ""
    items = "".join(f"<li>{html.escape(x)}</li>" for x in lines)
    return f'<h3>Reading</h3><ul class="reading">{items}</ul>'


def _cold_html(cold: Mapping[str, Any]) -> str:
    rows = cold.get("rows") or []
    if not rows:
        return ""
    d = cold.get("definition") or {}
    n_users = cold.get("n_users") or {}

    def users(arm: str, split: str) -> str:
        ns = [int(n) for n in (n_users.get(arm) or {}).get(split) or [] if _num(n) is not None]
        if not ns:
            return ""
        return str(ns[0]) if min(ns) == max(ns) else f"{min(ns)}-{max(ns)}"

    out = [
        "<h2>Cold-item slice</h2>",
        '<p class="note">Users whose held-out target is the target of at most '
        f"<b>{html.escape(str(d.get('max_sft_targets', '?')))}</b> SFT training windows "
        f"({html.escape(str(d.get('n_cold_items', '?')))} of {html.escape(str(d.get('n_items', '?')))} "
        "catalog items are cold). Each cell: mean &plusmn; std over seeds; [per-seed 95% user-bootstrap "
        "CI bounds, averaged]; lift vs the baseline arm [seed-bootstrap CI]. users: cold users "
        "evaluated per seed (range when seeds differ).</p>",
        _table_html(
            rows, lambda r: (r["arm"], r["group"].split("/", 1)[-1], users(r["arm"], r["group"].split("/", 1)[-1])),
            lambda r: r["name"], ["arm", "split", "users"], "cold", _col_label,
        ),
    ]
    for split, bl in (cold.get("baselines") or {}).items():
        if bl:
            out.append(f"<h3>Reference baselines on the cold slice ({html.escape(split)}, first run)</h3>")
            out.append(_baselines_html(bl, split))
    return "".join(out)


def _curves_html(curves: Mapping[str, Any], plots: Mapping[str, Path]) -> str:
    pics = {c: p for c, p in plots.items() if _is_curve_plot(p)}
    if not curves and not pics:
        return ""
    out = ["<h2>Learning curves (SFT validation)</h2>",
           '<p class="note">Validation metrics every <code>sft.val_every</code> SFT steps: mean over '
           "seeds, shaded band = min&ndash;max over seeds. x = SFT step (grounding, where an arm has "
           "it, happened before step 0). Raw points: report.json <code>learning_curves</code>.</p>"]
    out += [_img_tag(p, cap) for cap, p in pics.items()]
    if curves and not pics:
        for metric, arms in curves.items():
            out.append(f"<h3>{html.escape(metric)}</h3><table><thead><tr><th>arm</th>"
                       "<th>(step, mean)</th></tr></thead><tbody>")
            for arm, pts in arms.items():
                cells = ", ".join(f"({p[0]}, {fmt(p[1])})" for p in pts)
                out.append(f"<tr><th>{html.escape(arm)}</th><td>{cells}</td></tr>")
            out.append("</tbody></table>")
    return "".join(out)


def _wall_time_html(wall: Mapping[str, Mapping[str, Any]], baseline_arm: str) -> str:
    if not wall:
        return ""
    out = [
        "<h2>Wall time</h2>",
        '<p class="note">Stage wall seconds, mean over seeds: the ground stage (initialisation, plus '
        "grounding training where the arm grounds) and the SFT stage; total = their sum. compute = "
        "seconds inside forward/backward/optimizer steps of the training loop. Evaluation and "
        "shared stages are not counted.</p>",
        '<table class="wall"><thead><tr><th>arm</th><th>grounding</th><th>ground s</th>'
        "<th>ground compute s</th><th>SFT s</th><th>SFT compute s</th><th>total s</th>"
        f"<th>vs {html.escape(baseline_arm)}</th><th>runs</th></tr></thead><tbody>",
    ]
    for arm, w in wall.items():
        extra = _num(w.get("extra_vs_baseline_s"))
        extra_s = "&ndash;" if extra is None else f"{extra:+.1f} s"
        total = fmt(w.get("total_s"))
        if w.get("total_s_std") is not None:
            total += f" &plusmn; {fmt(w['total_s_std'])}"
        out.append(
            f"<tr><th>{html.escape(arm)}</th><td>{'yes' if w.get('grounding') else 'no'}</td>"
            + "".join(f'<td class="num">{fmt(w.get(k))}</td>'
                      for k in ("ground_s", "ground_compute_s", "sft_s", "sft_compute_s"))
            + f'<td class="num">{total}</td><td class="num">{extra_s}</td>'
            f'<td class="num">{w.get("n_runs", "")}</td></tr>'
        )
    out.append("</tbody></table>")
    return "".join(out)


def render_html(doc: Mapping[str, Any], plots: Mapping[str, Path]) -> str:
    """The HTML page for a report document (as written to report.json) and its plot files."""
    split = doc["split"]
    metrics, diags = doc["metrics"], doc["diagnostics"]
    h = [
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>{html.escape(doc['title'])}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(doc['title'])}</h1>",
        _kv_table({
            "created": doc["created"], "arms": ", ".join(doc["arms"]),
            "seeds per arm": ", ".join(f"{a}: {n}" for a, n in doc["seeds_per_arm"].items()),
            "split": split, "baseline arm (lift)": doc["baseline_arm"],
        }),
        f"<h2>Metrics ({html.escape(split)})</h2>",
        '<p class="note">Each cell: mean &plusmn; std over seeds; [95% bootstrap CI]; '
        f"relative lift vs <b>{html.escape(doc['baseline_arm'])}</b> [95% CI] "
        "(green: better, red: worse, i.e. the lift CI excludes 0). "
        "&darr; = lower is better (mean_percentile_rank, invalid_sid_rate): there a negative lift "
        "is an improvement. mrr = mean of 1/rank of the target among all catalog items; "
        "mean_percentile_rank = mean of (rank&minus;1)/(items&minus;1) (0 = first, 0.5 = chance). "
        "CI methods per cell are in report.csv / report.json (<code>ci_method</code>).</p>",
        _table_html(metrics, lambda r: r["arm"], lambda r: r["name"], ["arm"], "metrics", _col_label),
        _reading_html(doc.get("reading") or []),
        "<h2>Reference baselines</h2>",
        _baselines_html(doc.get("baselines") or {}, split),
        _cold_html(doc.get("cold") or {}),
        _curves_html(doc.get("learning_curves") or {}, plots),
        _wall_time_html(doc.get("wall_time") or {}, doc["baseline_arm"]),
        "<h2>Embedding diagnostics</h2>",
        '<p class="note">effective_rank: exp(entropy of normalised singular values) of E_new; '
        "block_contrast: mean within-level minus mean across-level SID&ndash;SID cosine; "
        "rsa_*: correlation of within-level cosine upper triangles of RQ-VAE code vectors vs "
        "SID embeddings (block diagonal, all levels); mean_cosine_new(_text): mean cosine among "
        "SID rows (and vs sampled text rows). &ndash; = undefined (e.g. RSA of identical rows).</p>",
        _table_html(
            diags, lambda r: (r["arm"], r["group"]), lambda r: r["name"], ["arm", "phase"], "diagnostics"
        ),
    ]
    if doc.get("rsa_levels"):
        h.append("<h3>RSA per level</h3><table><thead><tr><th>arm</th><th>phase</th><th>level</th>"
                 "<th>pearson</th><th>spearman</th></tr></thead><tbody>")
        for r in doc["rsa_levels"]:
            h.append(
                f"<tr><th>{html.escape(r['arm'])}</th><td>{r['phase']}</td><td>{r['level']}</td>"
                f'<td class="num">{fmt(r["pearson"])}</td><td class="num">{fmt(r["spearman"])}</td></tr>'
            )
        h.append("</tbody></table>")
    other = {c: p for c, p in plots.items() if not _is_curve_plot(p)}
    if other:
        h.append("<h2>Plots</h2>")
        h += [_img_tag(p, cap) for cap, p in other.items()]
    h.append("<h2>Runs</h2><table><thead><tr><th>arm</th><th>seed</th><th>run dir</th>"
             "<th>facts</th></tr></thead><tbody>")
    for r in doc["runs"]:
        facts = ", ".join(f"{k}={fmt(v) if isinstance(v, (int, float)) else v}"
                          for k, v in (r.get("facts") or {}).items())
        h.append(f"<tr><th>{html.escape(r['arm'])}</th><td>{r['seed']}</td>"
                 f"<td><code>{html.escape(r['run_dir'])}</code></td><td>{facts}</td></tr>")
    h.append("</tbody></table>")
    h.append("<h2>Configs</h2>")
    for arm, cfg in doc["configs"].items():
        h.append(f"<details><summary>{html.escape(arm)}</summary><pre>"
                 f"{html.escape(json.dumps(cfg, indent=2))}</pre></details>")
    h.append("<h2>Package versions</h2>" + _kv_table(doc["versions"]))
    h.append("</body></html>\n")
    return "".join(h)


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
    atomic_write_bytes(paths["csv"], _csv_text(doc["metrics"] + doc["cold"]["rows"] + doc["diagnostics"]).encode())
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
