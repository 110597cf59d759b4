"""Rewards for one group of candidate SIDs against the user's target SID (pure python; torch only
for the batch tensor, imported there, so the config can check `rl.reward` without it).

What it is for: the `rl.reward` setting of the RL stage. A group is the G candidates the policy
produced for one prompt, best first; each reward maps (candidates, target) to G floats: `hit`,
`rank` (after MiniOneRec's NDCG-like ranking reward) and `prefix` (partial credit per SID level).
`parse_reward_spec` reads `rl.reward`, `combined_rewards` gives the weighted sum for one group
and `group_rewards` the [B, G] tensor of a batch. A SID is any sequence of L per-level values:
code tuples and SID token-id tuples give the same rewards (levels map one-to-one to tokens).

What it does not know: models, decoding, advantages, item ids, config files, or Ray.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

Sid = Sequence[int]
RewardFn = Callable[[Sequence[Sid], Sid], list[float]]


def _check_group(candidates: Sequence[Sid], target: Sid) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """Candidates and target as int tuples; ValueError on an empty group or a length mismatch."""
    cands = [tuple(int(x) for x in c) for c in candidates]
    tgt = tuple(int(x) for x in target)
    if not cands:
        raise ValueError("a reward group needs at least one candidate")
    if not tgt:
        raise ValueError("the target SID is empty")
    bad = [i for i, c in enumerate(cands) if len(c) != len(tgt)]
    if bad:
        raise ValueError(f"candidate {bad[0]} has {len(cands[bad[0]])} levels, the target {len(tgt)}")
    return cands, tgt


def hit_rewards(candidates: Sequence[Sid], target: Sid) -> list[float]:
    """1.0 for every candidate equal to `target` (all levels), 0.0 for the others. [G]"""
    cands, tgt = _check_group(candidates, target)
    return [1.0 if c == tgt else 0.0 for c in cands]


def rank_discounts(group_size: int) -> list[float]:
    """The rank penalty weights of `rank_rewards`: D(r) / sum_{j=1..G} D(j) with
    D(r) = 1 / log2(r + 1), for ranks r = 1..G (a list of G positive floats summing to 1)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    d = [1.0 / math.log2(r + 1) for r in range(1, group_size + 1)]
    total = sum(d)
    return [x / total for x in d]


def rank_rewards(candidates: Sequence[Sid], target: Sid) -> list[float]:
    """Rank-aware reward of a group ranked best first (rank r = 1..G). [G]

    If the target is not in the group, every candidate gets 0 (no hit, no signal). Otherwise,
    with r* the rank of the first candidate equal to the target, the candidate at rank r gets

        +1                              if it is the target,
        -D(r) / sum_{j=1..G} D(j)       if it is wrong and r < r*, with D(r) = 1 / log2(r + 1),
        0                               if it is wrong and r > r*.

    So the wrong items the policy puts above the target are pushed down, the top one hardest
    (the NDCG discount), and a group's penalties sum to more than -1. Duplicates of the target
    (sampling) all get +1. Compared with MiniOneRec's ranking reward (penalty -D(r)/sum D at
    every wrong rank of a group with a hit, 0 in groups without one, the hit scored by the
    separate rule reward): the hit's +1 is included, and wrong candidates below the target are
    not penalised. Groups without a hit stay at 0 on purpose: penalising them by rank would,
    after group normalisation, give the lower wrong candidates positive advantages, which only
    reshuffles the wrong top-G (tried on a tiny model with the target ranked far below the
    group: it seldom brought the target in); `prefix` is the reward that gives
    all-miss groups a signal.
    """
    cands, tgt = _check_group(candidates, target)
    first = next((i for i, c in enumerate(cands) if c == tgt), None)
    if first is None:
        return [0.0] * len(cands)
    penalty = rank_discounts(len(cands))
    return [1.0 if c == tgt else (-penalty[i] if i < first else 0.0) for i, c in enumerate(cands)]


def prefix_rewards(candidates: Sequence[Sid], target: Sid) -> list[float]:
    """Share of leading levels matched: (number of levels l such that candidate[:l] equals
    target[:l], i.e. the length of the common prefix) / L. 1.0 for the target itself, 0.0 for a
    candidate whose first level already differs. [G]"""
    cands, tgt = _check_group(candidates, target)
    out = []
    for c in cands:
        n = 0
        while n < len(tgt) and c[n] == tgt[n]:
            n += 1
        out.append(n / len(tgt))
    return out


REWARDS: dict[str, RewardFn] = {"hit": hit_rewards, "rank": rank_rewards, "prefix": prefix_rewards}


def parse_reward_spec(spec: str | Mapping[str, float]) -> dict[str, float]:
    """`rl.reward` as {reward name: weight}: a name ("hit") means {name: 1.0}; a mapping is
    checked. ValueError naming an unknown reward key (and the known ones), a non-finite weight,
    or a spec whose weights are all zero."""
    weights = {spec: 1.0} if isinstance(spec, str) else dict(spec)
    if not weights:
        raise ValueError(f"the reward spec is empty; name at least one of {sorted(REWARDS)}")
    for key, w in weights.items():
        if key not in REWARDS:
            raise ValueError(f"unknown reward {key!r} in the reward spec; known rewards: {sorted(REWARDS)}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"reward weight of {key!r} must be a finite number, got {w!r}")
    if all(w == 0 for w in weights.values()):
        raise ValueError(f"every weight of the reward spec {weights} is zero")
    return {k: float(w) for k, w in weights.items()}


def combined_rewards(candidates: Sequence[Sid], target: Sid, spec: str | Mapping[str, float]) -> list[float]:
    """sum_k weight_k * reward_k(candidates, target) for the rewards of `spec`. [G]"""
    weights = parse_reward_spec(spec)
    total = [0.0] * len(candidates)
    for key, w in weights.items():
        for i, r in enumerate(REWARDS[key](candidates, target)):
            total[i] += w * r
    return total


def group_rewards(
    groups: Sequence[Sequence[Sid]], targets: Sequence[Sid], spec: str | Mapping[str, float]
) -> "torch.Tensor":
    """Rewards of B groups of G candidates each: FloatTensor [B, G] (float32), row b the
    `combined_rewards` of groups[b] against targets[b]. ValueError when the groups differ in
    size or the counts of groups and targets differ."""
    if len(groups) != len(targets):
        raise ValueError(f"{len(groups)} candidate groups but {len(targets)} targets")
    weights = parse_reward_spec(spec)
    sizes = {len(g) for g in groups}
    if len(sizes) > 1:
        raise ValueError(f"every group must hold the same number of candidates, got sizes {sorted(sizes)}")
    import torch

    rows = [combined_rewards(g, t, weights) for g, t in zip(groups, targets)]
    g_size = sizes.pop() if sizes else 0
    return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), g_size)
