"""Several SID maps in one comparison: which maps, and the figures over them.

What it is for: `gti compare --sid-seeds N` trains every arm x seed on N SID maps of the same
catalog, since one map can decide a result on its own. `sid_seeds` lists the maps (`[None]`:
one map, today's layout); `summarize` turns the runs' records into what compare.json keeps
under `maps`: per map, each arm's figures with user-bootstrap CIs and the paired difference of
every later arm minus every earlier one on the same users; over the maps, the mean of each
per-map figure with its spread and every map's figure beside it. `headline` prints those means.

What it does not know: how runs are planned, scheduled or reported (`gti.experiments.compare`,
`compare_report`); what a metric means (`gti.diagnostics`, `gti.eval`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from gti import config as C
from gti.experiments.shared_stages import CompareError, map_tag

# The headline figures of every map and of their mean (ranks give MRR only where runs scored
# exact ranks; a figure no run has is left out).
HEADLINE = ("recall@10", "ndcg@10", "mrr")


def sid_seeds(cfg: C.RunConfig, n: int) -> list[int | None]:
    """The `sid.seed` of each of `n` maps: [None] for one (the map as the config makes it, in
    today's folders), else base, base+1, ..., base+n-1 (base: `sid.seed`, else `seed`)."""
    if n < 1:
        raise CompareError(f"--sid-seeds must be >= 1, got {n}")
    if n == 1:
        return [None]
    base = cfg.seed if cfg.sid.seed is None else cfg.sid.seed
    return [base + i for i in range(n)]


def _spread(vals: Sequence[float]) -> dict[str, Any]:
    """mean, sd (ddof 1; None for one value), min, max and n of per-map values [M]."""
    v = np.asarray(vals, dtype=np.float64)
    return {"mean": float(v.mean()), "sd": float(v.std(ddof=1)) if v.size > 1 else None,
            "min": float(v.min()), "max": float(v.max()), "n_maps": int(v.size)}


def user_values(rec, split: str, metric: str) -> dict[str, float] | None:
    """{user id: value} of one run: `per_user[split][metric]`, or 1 / exact rank for `mrr`;
    None where the run kept no per-user values for it."""
    pu = (rec.metrics.get("per_user") or {}).get(split)
    if not isinstance(pu, dict) or "user_ids" not in pu:
        return None
    vals = pu.get(metric) if metric != "mrr" else (
        None if pu.get("exact_rank") is None else [1.0 / float(r) for r in pu["exact_rank"]])
    if not isinstance(vals, list) or len(vals) != len(pu["user_ids"]):
        return None
    return {str(u): float(v) for u, v in zip(pu["user_ids"], vals) if v is not None}


def arm_users(recs: Sequence, split: str, metric: str) -> dict[str, float] | None:
    """Per-user value averaged over runs `recs` (an arm's seeds, maybe over maps), on the users
    every run scored; None when any run lacks per-user values."""
    maps = [user_values(r, split, metric) for r in recs]
    if not maps or any(m is None for m in maps):
        return None
    common = sorted(set(maps[0]).intersection(*maps[1:]))
    return {u: float(np.mean([m[u] for m in maps])) for u in common}


def _paired(a: Mapping[str, float] | None, b: Mapping[str, float] | None, n_boot: int, seed: int):
    """mean(a - b) over their common users and its paired user-bootstrap CI; None without
    per-user values on both sides."""
    from gti.eval.metrics import paired_bootstrap_ci

    if not a or not b:
        return None
    users = sorted(set(a) & set(b))
    x, y = np.array([a[u] for u in users]), np.array([b[u] for u in users])
    lo, hi = paired_bootstrap_ci(x, y, n_boot=n_boot, seed=seed)
    return {"value": float((x - y).mean()) if users else 0.0, "ci": [lo, hi], "n_users": len(users)}


def _figures(recs: Sequence, arms: Sequence[str], split: str, n_boot: int, seed: int) -> dict:
    """{arm: {metric: {"value", "ci", "sd_over_seeds", "n_seeds"}}} of one set of runs: the
    report's metrics rows (mean over seeds, user-bootstrap CI), headline metrics only (Recall@10,
    NDCG@10 and MRR where the runs have them)."""
    from gti.diagnostics.tables import metrics_table

    out: dict[str, dict[str, Any]] = {a: {} for a in arms}
    for row in metrics_table(recs, split, arms[0], n_boot, seed):
        if row["name"] in HEADLINE and row["arm"] in out and row["mean"] is not None:
            ci = [row["ci_lo"], row["ci_hi"]] if row["ci_lo"] is not None else None
            out[row["arm"]][row["name"]] = {"value": row["mean"], "ci": ci, "sd_over_seeds": row["std"],
                                            "n_seeds": row["n"]}
    return out


def _pairs(arms: Sequence[str]) -> list[tuple[str, str]]:
    """(a, b) for every later arm a and earlier arm b of `--arms` (read as a - b)."""
    return [(a, b) for j, a in enumerate(arms) for b in arms[:j]]


def report_split(records: Sequence, split: str = "test") -> str:
    """`split` when some run has it, else the first split a run has (as the report falls back)."""
    have = [s for r in records for s in ((r.metrics.get("splits") or {}))]
    return split if split in have or not have else have[0]


def summarize(by_map: Mapping[int, Sequence], arms: Sequence[str], n_boot: int = 1000, seed: int = 0,
              split: str = "test") -> dict[str, Any]:
    """compare.json's `maps` from the runs' records per map ({sid_seed: [RunRecord]}):

    per_map[tag]: {"sid_seed", "arms": {arm: {metric: figure}}, "paired": {"a - b": {metric:
    {"value", "ci", "n_users"}}}}; mean: {"arms": {arm: {metric: {mean, sd, min, max, n_maps,
    per_map: {tag: value}, ci (users resampled over the arm's runs on every map; maps and seeds
    fixed)}}}, "paired": {"a - b": {metric: the same, ci over the per-user differences averaged
    over maps}}}. A figure is the mean over the arm's seeds on that map."""
    split = report_split([r for recs in by_map.values() for r in recs], split)
    per_map, pooled_users = {}, {}
    for m, recs in by_map.items():
        by_arm = {a: [r for r in recs if r.arm == a] for a in arms}
        paired = {}
        for a, b in _pairs(arms):
            block = {k: _paired(arm_users(by_arm[a], split, k), arm_users(by_arm[b], split, k), n_boot, seed)
                     for k in HEADLINE}
            paired[f"{a} - {b}"] = {k: v for k, v in block.items() if v is not None}
        per_map[map_tag(m)] = {"sid_seed": m, "arms": _figures(recs, arms, split, n_boot, seed), "paired": paired}
    everything = [r for recs in by_map.values() for r in recs]
    pooled = _figures(everything, arms, split, n_boot, seed)
    mean_arms: dict[str, dict[str, Any]] = {}
    for a in arms:
        mean_arms[a] = {}
        for k in HEADLINE:
            vals = {t: pm["arms"][a][k]["value"] for t, pm in per_map.items() if k in pm["arms"][a]}
            if vals:
                mean_arms[a][k] = {**_spread(list(vals.values())), "per_map": vals,
                                   "ci": (pooled[a].get(k) or {}).get("ci")}
    return {"split": split, "sid_seeds": list(by_map), "metrics": list(HEADLINE), "per_map": per_map,
            "mean": {"arms": mean_arms, "paired": _mean_paired(by_map, per_map, arms, split, n_boot, seed)}}


def _mean_paired(by_map: Mapping[int, Sequence], per_map: dict, arms: Sequence[str], split: str,
                 n_boot: int, seed: int) -> dict[str, dict[str, Any]]:
    """Each pair's per-map differences, their mean and spread, and a paired user-bootstrap CI
    of the per-user difference averaged over the maps (users every map scored)."""
    out: dict[str, dict[str, Any]] = {}
    for a, b in _pairs(arms):
        name, out[f"{a} - {b}"] = f"{a} - {b}", {}
        for k in HEADLINE:
            vals = {t: pm["paired"][name][k]["value"] for t, pm in per_map.items() if k in pm["paired"][name]}
            if len(vals) != len(per_map):
                continue
            sides = [[arm_users([r for r in recs if r.arm == arm], split, k) for recs in by_map.values()]
                     for arm in (a, b)]
            common = set.intersection(*(set(u) for side in sides for u in side))
            avg = [{u: float(np.mean([m[u] for m in side])) for u in common} for side in sides]
            both = _paired(avg[0], avg[1], n_boot, seed)
            out[name][k] = {**_spread(list(vals.values())), "per_map": vals,
                            "ci": both["ci"] if both else None, "n_users": both["n_users"] if both else 0}
    return out


def headline(summary: Mapping[str, Any]) -> list[str]:
    """One line per arm x metric: the mean over maps, its spread and every map's figure, e.g.
    'gti recall@10: 0.162 mean over 3 SID maps (sd 0.010, 0.150 to 0.175; sid0 0.150, sid1
    0.160, sid2 0.175)'."""
    lines = []
    n = len(summary["sid_seeds"])
    for arm, figs in summary["mean"]["arms"].items():
        for k, f in figs.items():
            maps = ", ".join(f"{t} {v:.3f}" for t, v in f["per_map"].items())
            sd = "n/a" if f["sd"] is None else f"{f['sd']:.3f}"
            lines.append(f"{arm} {k}: {f['mean']:.3f} mean over {n} SID maps "
                         f"(sd {sd}, {f['min']:.3f} to {f['max']:.3f}; {maps})")
    return lines
