"""Making every item's SID unique: collision statistics, Sinkhorn spreading, de-duplication.

What it is for: after greedy quantisation several items can share a SID (a collision). The
`sid` stage resolves them in two steps:
1. `sinkhorn_resolve` (as LC-Rec does): the colliding items' last-level codes are re-chosen
   together by a Sinkhorn-balanced assignment, which forces near-identical items apart because
   no code may take more than its share; repeated while it helps. At millions of colliders the
   balancing prices are learned on a sample and applied to all of them in chunks. The rounds
   (`sinkhorn_rounds`) run on any `LastCodes`: the whole array in memory (`sinkhorn_resolve`),
   or the colliding prefix groups bucket by bucket (`gti.sid.buckets`).
2. De-duplication of whatever still collides: `dedup_extra_level` appends one level whose code
   numbers the members of each collision group 0..n-1 (every other item gets 0), or
   `dedup_reassign` moves all but one member of each group to the nearest last-level code that
   is free under the same prefix (falling back to an extra level where a prefix is full).
   Both decide within prefix groups only: a group's codes depend on its own rows alone (a
   group where nothing can move stays as it is, so stopping when nothing moves anywhere, or
   after `max_rounds`, leaves it as stopping for it alone would). So they give the same codes
   run on any set of whole prefix groups at a time; only whether an extra level is added at
   all is a decision over every row.

Re-scoring the last level needs distances from an item's last residual to the last codebook;
the caller passes them as `last_cost(rows) -> [n, K]`, so this module never sees embeddings
or models. Pure torch; no Ray.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from gti.sid.balance import priced_assign, sinkhorn_prices

LastCost = Callable[[torch.Tensor], torch.Tensor]


def group_ids(codes: torch.Tensor) -> torch.Tensor:
    """LongTensor[N]: equal rows of codes [N, L] get equal ids (0..n_unique-1)."""
    codes = codes.long()
    if codes.shape[1] == 0:
        return torch.zeros(codes.shape[0], dtype=torch.long)
    radix = (codes.max(dim=0).values + 1).clamp(min=1)
    # Pack each row into one int64 when it fits (much faster than unique over rows).
    if float(torch.prod(radix.double())) < 2.0**62:
        key = torch.zeros(codes.shape[0], dtype=torch.long, device=codes.device)
        for j in range(codes.shape[1]):
            key = key * radix[j] + codes[:, j]
        return torch.unique(key, return_inverse=True)[1]
    return torch.unique(codes, dim=0, return_inverse=True)[1]


def collision_rate(codes: torch.Tensor) -> float:
    """1 - unique/N: the share of items that would need another SID (0 = all unique)."""
    n = codes.shape[0]
    if n == 0:
        return 0.0
    return 1.0 - (int(group_ids(codes).max()) + 1) / n


def colliding_rows(codes: torch.Tensor) -> torch.Tensor:
    """Rows [m] whose SID is shared with at least one other row."""
    gid = group_ids(codes)
    counts = torch.bincount(gid)
    return (counts[gid] > 1).nonzero().flatten()


class LastCodes(Protocol):
    """Codes whose last level `sinkhorn_rounds` re-chooses, round by round: the whole array in
    memory (`ArrayCodes`) or the colliding prefix groups bucket by bucket
    (`gti.sid.buckets.BucketCodes`). Rows are global row ids."""

    def colliders(self) -> torch.Tensor:
        """LongTensor [m]: the rows whose SID is shared, ascending."""

    def try_last(self, rows: torch.Tensor, last: torch.Tensor) -> int:
        """Give the colliders `rows` [m] (ascending) the last codes `last` [m], tentatively;
        returns how many rows collide then."""

    def keep(self) -> None:
        """Keep the tentative codes; `colliders` then gives the rows that collide with them."""

    def undo(self) -> None:
        """Go back to the codes before the last `try_last`."""


class ArrayCodes:
    """`LastCodes` over codes LongTensor [N, L] in memory (changed in place: `codes`)."""

    def __init__(self, codes: torch.Tensor) -> None:
        self.codes = codes
        self._after: torch.Tensor | None = None
        self._undo: tuple[torch.Tensor, torch.Tensor] | None = None

    def colliders(self) -> torch.Tensor:
        if self._after is None:
            self._after = colliding_rows(self.codes)
        return self._after

    def try_last(self, rows: torch.Tensor, last: torch.Tensor) -> int:
        self._undo = (rows, self.codes[rows, -1].clone())
        self.codes[rows, -1] = last.to(self.codes.dtype)
        self._after = colliding_rows(self.codes)
        return self._after.numel()

    def keep(self) -> None:
        self._undo = None

    def undo(self) -> None:
        rows, old = self._undo
        self.codes[rows, -1] = old
        self._undo = self._after = None


def sinkhorn_resolve(codes: torch.Tensor, last_cost: LastCost, *args, **kwargs) -> tuple[torch.Tensor, int]:
    """`sinkhorn_rounds` on codes [N, L] in memory (not changed): (new codes [N, L], rounds
    run); `last_cost` takes row indices of codes. The other arguments are `sinkhorn_rounds`'s
    (epsilon, iters, rounds, sample_rows, chunk_rows, seed, min_gain, log), passed on as they
    are so that the two never disagree on a default."""
    store = ArrayCodes(codes.clone())
    done = sinkhorn_rounds(store, last_cost, *args, **kwargs)
    return store.codes, done


def sinkhorn_rounds(
    store: LastCodes,
    last_cost: LastCost,
    epsilon: float = 0.003,
    iters: int = 50,
    rounds: int = 20,
    sample_rows: int = 65536,
    chunk_rows: int = 262144,
    seed: int = 0,
    min_gain: float = 0.0,
    log: Callable[[str], None] | None = None,
) -> int:
    """Re-assign the last code of colliding items by balanced Sinkhorn, up to `rounds` times.

    Returns the rounds run; `store` holds the codes. In each round, the colliders' last-level
    costs (`last_cost(rows)`, rows as the store numbers them) give K column prices by one
    Sinkhorn, as LC-Rec does over all colliders. When there are more than `sample_rows`
    colliders, the prices come from a seeded uniform sample of that many, chosen by position
    in the ascending list of all colliders, because the prices of a uniform sample estimate
    those of the whole set. Every collider then takes its cheapest code after prices, scored
    `chunk_rows` rows at a time. This keeps the Sinkhorn work and the [rows, K] cost bounded
    at millions of items; what the loop itself holds is the colliders' rows (int64) and their
    new codes (int32), 12 B per collider.

    Stops when nothing collides, or when a round does not reduce the number of colliding
    items. That last round is undone, so the result is never worse than its input. It also
    stops after a round that frees fewer than `min_gain` of the colliders. That round is
    kept. Late rounds free a few tenths of a percent each (mostly near-duplicate items that
    no price can separate), and de-duplication handles what is left.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = store.colliders()
    done = 0
    while rows.numel() > 0 and done < rounds:
        m = rows.numel()
        fit = rows if m <= sample_rows else rows[torch.randperm(m, generator=gen)[:sample_rows].sort().values]
        scale, v = sinkhorn_prices(last_cost(fit), epsilon, iters)
        del fit
        new_last = torch.empty(m, dtype=torch.int32)  # codes < K; half the bytes of argmax's int64
        for s in range(0, m, chunk_rows):
            new_last[s : s + chunk_rows] = priced_assign(last_cost(rows[s : s + chunk_rows]), scale, v, epsilon)
        after = store.try_last(rows, new_last)
        if after >= m:
            store.undo()
            break
        store.keep()
        done += 1
        if log is not None:
            log(f"Sinkhorn round {done}: {m:,} -> {after:,} colliding items")
        if m - after < min_gain * m:
            break
        del rows, new_last  # the next round's colliders are gathered without these alive
        rows = store.colliders()
    return done


def dedup_extra_level(codes: torch.Tensor) -> torch.Tensor:
    """Append a level numbering the members of each collision group (0..n-1, in row order).

    Returns codes unchanged when all rows are already unique; otherwise [N, L+1] whose last
    column is 0 for every non-colliding item.
    """
    gid = group_ids(codes)
    n = codes.shape[0]
    if int(gid.max()) + 1 == n:
        return codes
    # Rank of each row inside its group: stable sort by group, position minus group start.
    order = torch.sort(gid, stable=True).indices
    sorted_gid = gid[order]
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = sorted_gid[1:] != sorted_gid[:-1]
    start_pos = torch.cummax(torch.where(starts, torch.arange(n), torch.zeros(n, dtype=torch.long)), 0).values
    rank = torch.empty(n, dtype=torch.long)
    rank[order] = torch.arange(n) - start_pos
    return torch.cat([codes, rank.unsqueeze(1)], dim=1)


def dedup_reassign(codes: torch.Tensor, last_cost: LastCost, max_rounds: int = 64) -> torch.Tensor:
    """Move colliders to the nearest last-level code free under their prefix.

    In each collision group the member nearest to its current code stays; the others take the
    cheapest code not used by any item with the same first L-1 codes (ties between movers
    wanting the same code go to the cheaper one, the rest retry next round). Items left over
    because their prefix has no free code get an extra level (`dedup_extra_level`).
    """
    codes = codes.clone()
    n, levels = codes.shape
    prefix = group_ids(codes[:, :-1]) if levels > 1 else torch.zeros(n, dtype=torch.long)
    for _ in range(max_rounds):
        rows = colliding_rows(codes)
        if rows.numel() == 0:
            return codes
        cost = last_cost(rows).float()
        k = cost.shape[1]
        own = cost.gather(1, codes[rows, -1:]).squeeze(1)
        # Keeper per full-SID group: the member with the lowest cost at its current code.
        gid = group_ids(codes[rows])
        keeper = torch.zeros(rows.numel(), dtype=torch.bool)
        best = torch.full((int(gid.max()) + 1,), float("inf"))
        best.scatter_reduce_(0, gid, own, reduce="amin")
        # Exact ties: the lowest row wins.
        cand = (own == best[gid]).nonzero().flatten()
        chosen = torch.full((int(gid.max()) + 1,), rows.numel(), dtype=torch.long)
        chosen.scatter_reduce_(0, gid[cand], cand, reduce="amin")
        keeper[chosen] = True
        movers = (~keeper).nonzero().flatten()
        m_rows = rows[movers]
        # Codes already used under each mover's prefix.
        pre = prefix[m_rows]
        uniq_pre, pre_local = torch.unique(pre, return_inverse=True)
        pmap = torch.full((int(prefix.max()) + 1,), -1, dtype=torch.long)
        pmap[uniq_pre] = torch.arange(uniq_pre.numel())
        holders = (pmap[prefix] >= 0).nonzero().flatten()
        used = torch.zeros(uniq_pre.numel(), k, dtype=torch.bool)
        used[pmap[prefix[holders]], codes[holders, -1]] = True
        mc = cost[movers].masked_fill(used[pre_local], float("inf"))
        best_cost, choice = mc.min(dim=1)
        movable = torch.isfinite(best_cost)
        if not movable.any():
            break
        # One mover per (prefix, code): the cheapest wins this round.
        key = pre_local * k + choice
        key = torch.where(movable, key, torch.full_like(key, -1))
        win_cost = torch.full((uniq_pre.numel() * k,), float("inf"))
        ok = movable.nonzero().flatten()
        win_cost.scatter_reduce_(0, key[ok], best_cost[ok], reduce="amin")
        is_win = movable & (best_cost == win_cost[key.clamp(min=0)])
        # Exact ties: keep the lowest index per key.
        win_idx = torch.full((uniq_pre.numel() * k,), movers.numel(), dtype=torch.long)
        w = is_win.nonzero().flatten()
        win_idx.scatter_reduce_(0, key[w], w, reduce="amin")
        final = w[win_idx[key[w]] == w]
        codes[m_rows[final], -1] = choice[final]
    return dedup_extra_level(codes)
