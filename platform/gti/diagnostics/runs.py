"""What the report needs from one finished run, and the values read out of it.

What it is for: `RunRecord` (one arm x seed: metrics.json, geometry diagnostics per phase,
config, versions, learning curves, stage timing), the arms in first-seen order, the metric
names of a split, and each run's value / CI of a metric -- including the exact-rank metrics
(MRR, mean percentile rank) and the per-user values (from `per_user`, exact ranks turned into
1/rank and (rank-1)/(N-1)) that the user bootstraps resample.

What it does not know: how runs were produced, Ray, files of other stages (callers pass plain
dicts), statistics across runs (`gti.diagnostics.tables`), HTML.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from gti.diagnostics.stats import _dig, _num, metric_entry

PHASES = ("init", "ground", "sft")
# Metrics derived from exact ranks (metrics.json "ranks"; per-user from per_user.exact_rank).
RANK_METRICS = ("mrr", "mean_percentile_rank")


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


def _ordered_arms(records: Sequence[RunRecord]) -> list[str]:
    seen: list[str] = []
    for r in records:
        if r.arm not in seen:
            seen.append(r.arm)
    return seen


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
