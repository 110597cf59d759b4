"""Top-K ranking metrics, per user, with bootstrap confidence intervals.

What it is for: given per user a ranked list of recommended item ids (best first) and the
held-out truth (one target, leave-one-out style, or graded relevance `{item: grade}`), compute
Recall@K, NDCG@K and Precision@K per row (numpy arrays, so callers can average, bootstrap or
pair them across arms), percentile-bootstrap CIs of the mean that resample users (seeded), and a
metrics table in the layout of docs/ARCHITECTURE.md (`{"recall@10": {"value": v, "ci": [lo,
hi]}, ...}`). A value is per ROW (one history, one target): leave-one-out has one row per user,
the global time split several, and every CI resamples USERS with all their rows (`groups`).

What it does NOT know: models, decoding, ids' meaning, Ray. Pure numpy.
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable, Mapping, Sequence

import numpy as np

METRICS = ("recall", "ndcg", "precision")
DEFAULT_KS = (5, 10, 20, 50)


def _check_k(k: int) -> None:
    if int(k) < 1:
        raise ValueError(f"K must be >= 1, got {k}")


def target_ranks(ranked: Sequence[Sequence[Hashable]], targets: Sequence[Hashable]) -> np.ndarray:
    """0-based rank of each user's target in their list; -1 when absent. -> int64 [U]."""
    if len(ranked) != len(targets):
        raise ValueError(f"{len(ranked)} ranked lists for {len(targets)} targets")
    out = np.full(len(targets), -1, dtype=np.int64)
    for u, (lst, tgt) in enumerate(zip(ranked, targets)):
        for r, item in enumerate(lst):
            if item == tgt:
                out[u] = r
                break
    return out


# --------------------------------------------------------------------------- single target
def recall_at_k(ranked, targets, k: int) -> np.ndarray:
    """[U] float: 1.0 where the target is in the top K (= HR@K for one relevant item)."""
    _check_k(k)
    r = target_ranks(ranked, targets)
    return ((r >= 0) & (r < k)).astype(np.float64)


def ndcg_at_k(ranked, targets, k: int) -> np.ndarray:
    """[U] float: 1/log2(rank+2) where the target is in the top K, else 0."""
    _check_k(k)
    r = target_ranks(ranked, targets)
    hit = (r >= 0) & (r < k)
    return np.where(hit, 1.0 / np.log2(np.maximum(r, 0) + 2.0), 0.0)


def precision_at_k(ranked, targets, k: int) -> np.ndarray:
    """[U] float: hit / K."""
    return recall_at_k(ranked, targets, k) / float(k)


# --------------------------------------------------------------------------- graded relevance
def _gains(grades: Iterable[float], gain: str) -> np.ndarray:
    g = np.asarray(list(grades), dtype=np.float64)
    if gain == "exp":
        return np.power(2.0, g) - 1.0
    if gain == "linear":
        return g
    raise ValueError(f"gain must be 'exp' or 'linear', got {gain!r}")


def _top_unique(lst: Sequence[Hashable], k: int) -> list[Hashable]:
    seen: set = set()
    out = []
    for item in lst[:k]:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


def graded_recall_at_k(ranked, relevance: Sequence[Mapping[Hashable, float]], k: int) -> np.ndarray:
    """[U]: relevant (grade > 0) items in the top K / relevant items (0 for users with none)."""
    _check_k(k)
    out = np.zeros(len(relevance))
    for u, (lst, rel) in enumerate(zip(ranked, relevance, strict=True)):
        pos = {i for i, g in rel.items() if g > 0}
        if pos:
            out[u] = sum(1 for i in _top_unique(lst, k) if i in pos) / len(pos)
    return out


def graded_precision_at_k(ranked, relevance: Sequence[Mapping[Hashable, float]], k: int) -> np.ndarray:
    """[U]: relevant (grade > 0) items in the top K / K."""
    _check_k(k)
    out = np.zeros(len(relevance))
    for u, (lst, rel) in enumerate(zip(ranked, relevance, strict=True)):
        out[u] = sum(1 for i in _top_unique(lst, k) if rel.get(i, 0) > 0) / k
    return out


def graded_ndcg_at_k(
    ranked, relevance: Sequence[Mapping[Hashable, float]], k: int, gain: str = "exp"
) -> np.ndarray:
    """[U]: DCG@K / ideal DCG@K with gains from the grades (0 for users with no relevant item):
    gain 2^grade - 1 (or `gain="linear"`: grade) over log2(rank + 2), normalised by the ideal
    DCG of the user's own grades. With one item of grade 1 it is `ndcg_at_k`."""
    _check_k(k)
    disc = 1.0 / np.log2(np.arange(k) + 2.0)
    out = np.zeros(len(relevance))
    for u, (lst, rel) in enumerate(zip(ranked, relevance, strict=True)):
        ideal_grades = sorted((g for g in rel.values() if g > 0), reverse=True)[:k]
        if not ideal_grades:
            continue
        idcg = float((_gains(ideal_grades, gain) * disc[: len(ideal_grades)]).sum())
        top = _top_unique(lst, k)
        # Ranks are positions in the original list (a repeated item keeps its first rank).
        ranks = []
        seen: set = set()
        for r, item in enumerate(lst[:k]):
            if item not in seen:
                seen.add(item)
                ranks.append(r)
        grades = [rel.get(i, 0.0) for i in top]
        gains = _gains(grades, gain) * (np.asarray(grades) > 0)
        out[u] = float((gains * disc[ranks]).sum()) / idcg
    return out


# --------------------------------------------------------------------------- tables
def per_user_metrics(
    ranked: Sequence[Sequence[Hashable]],
    targets: Sequence[Hashable] | None = None,
    ks: Sequence[int] = DEFAULT_KS,
    *,
    relevance: Sequence[Mapping[Hashable, float]] | None = None,
    metrics: Sequence[str] = METRICS,
    gain: str = "exp",
) -> dict[str, np.ndarray]:
    """{"recall@5": [U], "ndcg@5": [U], ...} in the order metric-major then K.

    Give `targets` (one held-out item per user) or `relevance` (graded, `{item: grade}` per user).
    A ranked list shorter than K (a user with fewer valid items) simply has fewer hits; an item
    repeated in a list counts once (at its first rank). Users are never dropped.
    """
    if (targets is None) == (relevance is None):
        raise ValueError("give exactly one of targets (single item) or relevance (graded)")
    unknown = set(metrics) - set(METRICS)
    if unknown:
        raise ValueError(f"unknown metric(s) {sorted(unknown)}; known: {list(METRICS)}")
    out: dict[str, np.ndarray] = {}
    for name in metrics:
        for k in ks:
            if targets is not None:
                fn = {"recall": recall_at_k, "ndcg": ndcg_at_k, "precision": precision_at_k}[name]
                out[f"{name}@{k}"] = fn(ranked, targets, k)
            elif name == "ndcg":
                out[f"{name}@{k}"] = graded_ndcg_at_k(ranked, relevance, k, gain=gain)
            else:
                fn = {"recall": graded_recall_at_k, "precision": graded_precision_at_k}[name]
                out[f"{name}@{k}"] = fn(ranked, relevance, k)
    return out


def _user_sums(v: np.ndarray, groups: Sequence[Hashable] | None) -> tuple[np.ndarray, np.ndarray] | None:
    """(sum, row count) per user, users in first-seen order; None when every row is its own
    user (the plain bootstrap, kept draw for draw)."""
    if groups is None:
        return None
    if len(groups) != v.size:
        raise ValueError(f"{len(groups)} groups for {v.size} values")
    first: dict = {}
    inv = np.fromiter((first.setdefault(g, len(first)) for g in groups), dtype=np.int64, count=v.size)
    if len(first) == v.size:
        return None
    return np.bincount(inv, weights=v), np.bincount(inv).astype(np.float64)


def bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
    chunk: int = 256,
    groups: Sequence[Hashable] | None = None,
) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of per-row `values` [R], resampling users with
    replacement `n_boot` times from `np.random.default_rng(seed)` (same seed, same CI).
    `groups` [R]: each row's user; a user drawn brings all their rows, and a replicate's value is
    the mean over the rows drawn (None, or all distinct: each row is a user).
    n_boot == 0 or one user gives the degenerate interval (mean, mean); no rows gives (0, 0)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return 0.0, 0.0
    mean = float(v.mean())
    sums = _user_sums(v, groups)
    n_units = v.size if sums is None else sums[0].size
    if n_boot <= 0 or n_units == 1:
        return mean, mean
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    # Chunks bound memory at chunk x U indices (8k users x 256 = 16 MB).
    for start in range(0, n_boot, chunk):
        n = min(chunk, n_boot - start)
        idx = rng.integers(0, n_units, size=(n, n_units))
        if sums is None:
            means[start : start + n] = v[idx].mean(axis=1)
        else:
            means[start : start + n] = sums[0][idx].sum(axis=1) / sums[1][idx].sum(axis=1)
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def paired_bootstrap_ci(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
    groups: Sequence[Hashable] | None = None,
) -> tuple[float, float]:
    """CI of mean(a) - mean(b) for per-row values of two arms on the SAME rows (same order):
    users (`groups`, as in `bootstrap_ci`) are resampled jointly, so the user-to-user variance
    common to both arms cancels."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired values need the same users: shapes {a.shape} and {b.shape}")
    return bootstrap_ci(a - b, n_boot=n_boot, alpha=alpha, seed=seed, groups=groups)


def stratified_bootstrap_ci(
    strata: Sequence[Sequence[float] | np.ndarray],
    weights: Sequence[float],
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(value, lo, hi) of sum_s weights[s] * mean(strata[s]): the mean over a population whose
    users were sampled per stratum (e.g. a fixed number of users whose target is a new item and
    as many whose target is old) and whose strata have the population shares `weights` (summing
    to 1). Each bootstrap replicate resamples every stratum on its own, with replacement. For a
    paired difference pass each stratum's per-user differences. An empty stratum is refused."""
    w = np.asarray(weights, dtype=np.float64)
    vs = [np.asarray(v, dtype=np.float64) for v in strata]
    if len(vs) != w.size:
        raise ValueError(f"{len(vs)} strata but {w.size} weights")
    if any(v.size == 0 for v in vs):
        raise ValueError(f"every stratum needs users: sizes {[v.size for v in vs]}")
    if np.any(w < 0) or abs(float(w.sum()) - 1.0) > 1e-9:
        raise ValueError(f"weights must be shares summing to 1: {w.tolist()}")
    value = float(sum(wi * v.mean() for wi, v in zip(w, vs)))
    if n_boot <= 0:
        return value, value, value
    rng = np.random.default_rng(seed)
    reps = sum(wi * v[rng.integers(0, v.size, size=(n_boot, v.size))].mean(axis=1) for wi, v in zip(w, vs))
    lo, hi = np.quantile(reps, [alpha / 2, 1 - alpha / 2])
    return value, float(lo), float(hi)


def metrics_table(
    ranked: Sequence[Sequence[Hashable]],
    targets: Sequence[Hashable] | None = None,
    ks: Sequence[int] = DEFAULT_KS,
    *,
    relevance: Sequence[Mapping[Hashable, float]] | None = None,
    metrics: Sequence[str] = METRICS,
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
    return_per_user: bool = False,
    groups: Sequence[Hashable] | None = None,
) -> dict[str, Any] | tuple[dict[str, Any], dict[str, list[float]]]:
    """{"hr@10": {"value": mean, "ci": [lo, hi]}, "recall@10": ..., ...} (+ per-row lists if
    asked). Means over rows; CIs resample `groups` (each row's user; None: rows are users).
    With `targets` (one per row) every recall@K is also given as hr@K (the same cell, the
    field's name), first; the per-row lists keep recall@K only."""
    per_user = per_user_metrics(ranked, targets, ks, relevance=relevance, metrics=metrics)
    table = {}
    for name, vals in per_user.items():
        lo, hi = bootstrap_ci(vals, n_boot=n_boot, alpha=alpha, seed=seed, groups=groups)
        table[name] = {"value": float(vals.mean()) if vals.size else 0.0, "ci": [lo, hi]}
    if targets is not None and "recall" in metrics:
        table = {**{f"hr@{k}": dict(table[f"recall@{k}"]) for k in ks}, **table}
    if return_per_user:
        return table, {name: vals.tolist() for name, vals in per_user.items()}
    return table


def format_table(rows: Mapping[str, Mapping[str, Mapping[str, Any]]], columns: Sequence[str] | None = None,
                 ci: bool = False) -> str:
    """Plain-text table: one row per name in `rows` ({name: metrics_table(...)}), one column per
    metric@k (default: the columns of the first row), optionally with the CI under each value."""
    if not rows:
        return ""
    columns = list(columns or next(iter(rows.values())).keys())
    width = max(12, *(len(c) + 1 for c in columns)) if not ci else 22
    name_w = max(8, *(len(n) for n in rows))
    lines = [f"{'':<{name_w}} " + " ".join(f"{c:>{width}}" for c in columns)]
    for name, table in rows.items():
        cells = []
        for c in columns:
            cell = table.get(c)
            if cell is None:
                cells.append(f"{'-':>{width}}")
            elif ci:
                lo, hi = cell["ci"]
                cells.append(f"{cell['value']:.4f} [{lo:.4f},{hi:.4f}]".rjust(width))
            else:
                cells.append(f"{cell['value']:>{width}.4f}")
        lines.append(f"{name:<{name_w}} " + " ".join(cells))
    return "\n".join(lines)
