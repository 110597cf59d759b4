"""The numbers of the report: cleaning them, their statistics, and how they are written.

What it is for: the small numeric pieces every report table and the page share -- a finite
float or None (`_num`; JSON has no NaN), a JSON-safe copy of a nested structure (`_clean`),
reading a nested key (`_dig`) or a metrics.json entry (`metric_entry`), mean +- sample std,
95% percentile CIs of bootstrap samples, the lift CI (paired user or seed bootstrap) and the
nested seed x replicate bootstrap, the direction of a metric (`higher_is_better`) and the
verdict a lift CI gives (`verdict`), and a number as text (`fmt` for HTML, `fmt_plain`).

What it does not know: run records, which tables exist, HTML layout, files.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

# Quantities where a smaller value is the better one (everything else: higher is better).
LOWER_IS_BETTER = frozenset({"mean_percentile_rank", "invalid_sid_rate", "median_rank", "mean_rank"})


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


def higher_is_better(name: str) -> bool:
    """Direction of a metric / curve: False for ranks, rates of failure and losses."""
    return name not in LOWER_IS_BETTER and not name.endswith("loss")


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
