"""The report's tables, computed from run records (the statistics are documented in
`gti.diagnostics.report_files`).

What it is for: long-form rows of the metrics table (mean +- std over seeds, bootstrap CIs,
lift vs the baseline arm and its verdict), the cold-item slice, the embedding diagnostics
(with CIs from stored bootstrap replicates or over seeds) and per-level RSA; the learning
curves per metric x arm over seeds; the wall time of the ground and SFT stages per arm.

What it does not know: how runs were produced or how diagnostics are computed
(`gti.diagnostics.geometry`), plain-words readings (`gti.diagnostics.readings`), HTML, files.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from gti.diagnostics.runs import (
    PHASES,
    RANK_METRICS,
    RunRecord,
    _ordered_arms,
    _user_means,
    _values,
    metric_names,
)
from gti.diagnostics.stats import (
    _dig,
    _lift_ci,
    _mean_std,
    _nested_boot_ci,
    _num,
    _percentile_ci,
    higher_is_better,
    metric_entry,
    verdict,
)

# Diagnostics shown in the table: (column name, how to read it from geometry.diagnose output).
DIAG_QUANTITIES: list[tuple[str, Sequence[str]]] = [
    ("effective_rank", ("effective_rank",)),
    ("block_contrast", ("block", "contrast")),
    ("rsa_pearson", ("rsa", "overall", "pearson")),
    ("rsa_spearman", ("rsa", "overall", "spearman")),
    ("mean_cosine_new", ("mean_cosine_new",)),
    ("mean_cosine_new_text", ("mean_cosine_new_text",)),
]

# Learning curves shown first, in this order (others follow alphabetically).
CURVE_ORDER = ("val_loss", "val_mrr", "val_recall@10")

# Diagnostics with bootstrap replicates stored beside them by geometry.diagnose: (name ->
# path of the replicates, what was resampled).
DIAG_BOOT: dict[str, tuple[Sequence[str], str]] = {
    "rsa_pearson": (("rsa", "overall", "pearson_boot"), "codes"),
    "rsa_spearman": (("rsa", "overall", "spearman_boot"), "codes"),
}

# Diagnostics whose CI is the spread over seeds (no within-run resampling is unbiased for them).
SEED_CI_DIAGS = frozenset({"effective_rank"})


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


def pairwise_table(
    records: Sequence[RunRecord],
    split: str = "test",
    baseline_arm: str = "mean",
    n_boot: int = 1000,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Lift rows of each arm against every later non-baseline arm (e.g. gti vs random: what
    grounding adds over a start that is not collapsed), computed as `metrics_table` with that
    arm as the reference; rows tagged table "pairwise", group "<split> vs <reference arm>"."""
    arms = _ordered_arms(records)
    rows = []
    for ref in arms:
        if ref == baseline_arm:
            continue
        for row in metrics_table(records, split, ref, n_boot, seed):
            if row["arm"] != baseline_arm and arms.index(row["arm"]) < arms.index(ref):
                rows.append({**row, "table": "pairwise", "group": f"{split} vs {ref}"})
    return rows


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


def wall_time_table(records: Sequence[RunRecord], baseline_arm: str = "mean") -> dict[str, dict[str, Any]]:
    """{arm: {"ground_s", "sft_s", "rl_s", "total_s" (means over seeds; total = ground + sft +
    rl, the stages that train), "total_s_std", "n_runs", "grounding", "ground_compute_s",
    "sft_compute_s", "rl_compute_s", "extra_vs_baseline_s"}}; arms whose runs carry no timing
    are left out (old runs); rl_s is None for runs without RL."""
    out: dict[str, dict[str, Any]] = {}
    for arm in _ordered_arms(records):
        recs = [r for r in records if r.arm == arm and r.timing]
        if not recs:
            continue
        row: dict[str, Any] = {"n_runs": len(recs)}
        for key in ("ground_s", "sft_s", "rl_s", "ground_compute_s", "sft_compute_s", "rl_compute_s"):
            row[key] = _mean_std([_num(r.timing.get(key)) for r in recs])[0]
        parts = ("ground_s", "sft_s", "rl_s")
        totals = [None if all(_num(r.timing.get(k)) is None for k in parts)
                  else sum(_num(r.timing.get(k)) or 0.0 for k in parts) for r in recs]
        row["total_s"], row["total_s_std"] = _mean_std(totals)
        row["grounding"] = any(bool(r.timing.get("grounding")) for r in recs)
        out[arm] = row
    base = (out.get(baseline_arm) or {}).get("total_s")
    for row in out.values():
        row["extra_vs_baseline_s"] = (
            row["total_s"] - base if base is not None and row["total_s"] is not None else None
        )
    return out
