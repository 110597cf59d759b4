"""Quality figures of a SID assignment and the gates that stop a bad one.

What it is for: per-level utilisation (share of codes used) and perplexity (exp of the entropy
of code usage; K when usage is uniform, 1 when one code takes everything), collision rates,
and `check_gates`, which raises one GateError carrying all the figures when utilisation is
below `gates.min_utilisation` at any level or the final collision rate is above
`gates.max_collision_rate`. Collapsed codebooks then stop the pipeline instead of silently
producing IDs that cannot tell items apart.

What it does not know: how codes were produced; Ray.
"""

from __future__ import annotations

import math

import torch

from gti.common.errors import GateError


def level_usage(codes: torch.Tensor, sizes: list[int]) -> tuple[list[float], list[float]]:
    """(utilisation [L], perplexity [L]) of codes [N, L] with codebook sizes [L]."""
    return usage_from_counts([torch.bincount(codes[:, lv].long(), minlength=k) for lv, k in enumerate(sizes)], sizes)


def usage_from_counts(counts_per_level, sizes: list[int]) -> tuple[list[float], list[float]]:
    """`level_usage` from per-level code counts (int [max(K_l, max code + 1)] each, torch or
    numpy, as `bincount(minlength=K_l)` gives them), so counts summed over streamed batches give
    exactly the figures of the whole array."""
    util, perp = [], []
    for c, k in zip(counts_per_level, sizes):
        counts = torch.as_tensor(c).double()
        util.append(float((counts > 0).sum()) / k)
        p = counts / counts.sum().clamp(min=1)
        ent = -float((p[p > 0] * p[p > 0].log()).sum())
        perp.append(math.exp(ent))
    return util, perp


def check_gates(
    utilisation: list[float],
    collision_rate_after: float,
    min_utilisation: float,
    max_collision_rate: float,
    extra: dict | None = None,
) -> None:
    """Raise GateError (one line, all stats) when a gate fails; return None otherwise.

    `utilisation` is checked only for the quantiser's own levels (pass it without a dedup
    level: that level is by construction mostly code 0).
    """
    problems = []
    low = [(i, u) for i, u in enumerate(utilisation) if u < min_utilisation]
    if low:
        problems.append(
            "utilisation below sid.gates.min_utilisation="
            f"{min_utilisation:g} at level(s) " + ", ".join(f"{i} ({u:.3f})" for i, u in low)
        )
    if collision_rate_after > max_collision_rate:
        problems.append(
            f"collision rate {collision_rate_after:.4f} above sid.gates.max_collision_rate={max_collision_rate:g}"
        )
    if problems:
        stats = {"utilisation": [round(u, 4) for u in utilisation],
                 "collision_rate_after": round(collision_rate_after, 6), **(extra or {})}
        raise GateError("SID quality gate failed: " + "; ".join(problems) + f" | stats: {stats}")
