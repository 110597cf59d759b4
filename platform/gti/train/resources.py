"""How much of a Ray cluster one pipeline run holds at once, and how many runs fit side by side.

What it is for: `gti tune` (trials) and `gti compare` (arm x seed runs) put several pipelines on
one cluster. Each run's Train worker group reserves its slots in a placement group, but the Ray
Data tasks beside it (parquet reads, the evaluate actor pool, a stage's rendering pool) ask for
CPUs *outside* that group. Counting only the workers lets N runs reserve every CPU and leaves
their data tasks pending forever (seen on 4 CPUs: two sft-objective tune trials, each SFT
waiting for a read that could never be scheduled). So every run is also given
`DATA_HEADROOM_CPU` when sizing how many run at once.

What it does not know: Ray. It does arithmetic on a RunConfig and a resources mapping such as
`ray.cluster_resources()`.
"""

from __future__ import annotations

import math

# CPUs one run keeps free for its Ray Data tasks while its Train workers hold their slots.
DATA_HEADROOM_CPU = 1.0


def workers_need(tc) -> dict[str, float]:
    """Resources a Train stage's worker group reserves: num_workers x resources_per_worker
    (1 CPU per worker by default, plus 1 GPU with use_gpu)."""
    per = dict(tc.resources_per_worker or {})
    per.setdefault("CPU", 1.0)
    if tc.use_gpu:
        per.setdefault("GPU", 1.0)
    return {k: float(v) * tc.num_workers for k, v in per.items() if v}


def run_need(cfg, stages: tuple[str, ...], headroom: bool = True) -> dict[str, float]:
    """The most one run of `stages` (names among ground, sft, rl, evaluate) holds at a time: the
    stages run one after another, so the max over them, plus the data headroom."""
    out: dict[str, float] = {}
    parts = []
    if "ground" in stages and cfg.ground.enabled:
        parts.append(workers_need(cfg.ground))
    if "sft" in stages and cfg.sft.enabled:
        parts.append(workers_need(cfg.sft))
    if "rl" in stages and cfg.rl.trains:
        parts.append(workers_need(cfg.rl))
    if "evaluate" in stages:
        ev = {"CPU": float(cfg.eval.concurrency)}
        if cfg.eval.num_gpus:
            ev["GPU"] = cfg.eval.num_gpus * cfg.eval.concurrency
        parts.append(ev)
    for part in parts:
        for k, v in part.items():
            out[k] = max(out.get(k, 0.0), v)
    out.setdefault("CPU", 1.0)
    if headroom:
        out["CPU"] += DATA_HEADROOM_CPU
    return out


def shortfall(need: dict[str, float], cluster: dict[str, float]) -> dict[str, tuple[float, float]]:
    """{resource: (needed, available)} for every resource the cluster cannot give even once."""
    return {k: (v, float(cluster.get(k, 0.0))) for k, v in need.items() if float(cluster.get(k, 0.0)) < v}


def runs_that_fit(need: dict[str, float], cluster: dict[str, float], cap: int | None = None) -> int:
    """min over resources of floor(cluster / need), capped by `cap`; at least 1 (runs queue)."""
    n = cap if cap is not None else 10**9
    for k, v in need.items():
        n = min(n, int(math.floor(float(cluster.get(k, 0.0)) / v + 1e-9)))
    return max(1, n)
