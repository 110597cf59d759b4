"""Making every item's SID unique: collision statistics, Sinkhorn spreading, de-duplication.

What it is for: after greedy quantisation several items can share a SID (a collision). The `sid`
stage resolves them in two steps: `sinkhorn_rounds` re-chooses the colliding items' last-level
codes by a Sinkhorn-balanced assignment (as LC-Rec does), on any `LastCodes` (the whole array in
memory, or the colliding prefix groups bucket by bucket: `gti.sid.buckets`); then
`dedup_extra_level` or `dedup_reassign` de-duplicates whatever still collides.

What it does not know: embeddings or models (the caller passes the distances from an item's last
residual to the last codebook as `last_cost(rows) -> [n, K]`), Ray. Pure torch and numpy.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np
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


# A splitmix64 finaliser: a bijection of uint64, so distinct rows never tie on their key.
_GOLDEN, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def sample_keys(rows: np.ndarray, salt: int) -> np.ndarray:
    """uint64 [m]: a seeded pseudo-random key per row of rows int64 [m], distinct for distinct
    rows; the rows with the k smallest keys are a uniform sample of any set they are in."""
    s = _mix64(np.array([salt & (2**64 - 1)], dtype=np.uint64))
    with np.errstate(over="ignore"):
        return _mix64(rows.astype(np.uint64) ^ s)


def bottom_k(rows: np.ndarray, k: int, salt: int) -> np.ndarray:
    """The rows (int64 [<= k], in no order) of rows [m] with the k smallest `sample_keys`; all of
    them when m <= k. bottom_k(A u B) = bottom_k(bottom_k(A) u bottom_k(B)), so a sample of all
    colliders is found a bucket at a time."""
    if rows.size <= k:
        return rows
    with np.errstate(over="ignore"):
        return rows[np.argpartition(sample_keys(rows, salt), k - 1)[:k]]


def window_bins(counts: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """Consecutive bins [a, b) of counts int [B] grouped so that each group holds at most
    `limit` (a bin above it alone), empty groups left out: the row windows in which
    `sinkhorn_rounds` scores colliders, from counts per `limit`-row bin of rows."""
    out, start, held = [], 0, 0
    for j, c in enumerate(counts.tolist()):
        if held and held + c > limit:
            out.append((start, j))
            start, held = j, 0
        if not held:
            start = j
        held += c
    if held:
        out.append((start, len(counts)))
    return out


def window_slices(rows: np.ndarray, chunk_rows: int) -> list[tuple[int, int]]:
    """[start, stop) slices of rows int64 [m] (ascending) by `window_bins` of `chunk_rows`-row
    bins: each slice holds at most `chunk_rows` rows."""
    if rows.size == 0:
        return []
    edges = [(a * chunk_rows, b * chunk_rows) for a, b in window_bins(np.bincount(rows // chunk_rows), chunk_rows)]
    return [(int(np.searchsorted(rows, lo)), int(np.searchsorted(rows, hi))) for lo, hi in edges]


ChooseLast = Callable[[torch.Tensor], torch.Tensor]


class LastCodes(Protocol):
    """Codes whose last level `sinkhorn_rounds` re-chooses, round by round: the whole array in
    memory (`ArrayCodes`) or the colliding prefix groups bucket by bucket
    (`gti.sid.buckets.BucketCodes`). Rows are global row ids; "the colliders" are the rows whose
    SID is shared."""

    def count(self) -> int:
        """How many rows collide now."""

    def sample(self, k: int, salt: int) -> torch.Tensor:
        """LongTensor [min(k, count)], ascending: the colliders with the k smallest
        `sample_keys(rows, salt)` (all of them when there are at most k)."""

    def try_last(self, choose: ChooseLast, chunk_rows: int) -> int:
        """Give every collider the last code `choose(rows)` (int [w] for LongTensor rows [w],
        ascending: the colliders of one `window_slices` window), tentatively; returns how
        many rows collide then."""

    def keep(self) -> None:
        """Keep the tentative codes."""

    def undo(self) -> None:
        """Go back to the codes before the last `try_last`."""


class ArrayCodes:
    """`LastCodes` over codes LongTensor [N, L] in memory (changed in place: `codes`)."""

    def __init__(self, codes: torch.Tensor) -> None:
        self.codes = codes
        self._after: torch.Tensor | None = None
        self._undo: tuple[torch.Tensor, torch.Tensor] | None = None

    def colliders(self) -> torch.Tensor:
        """LongTensor [m]: the colliders, ascending."""
        if self._after is None:
            self._after = colliding_rows(self.codes)
        return self._after

    def count(self) -> int:
        return self.colliders().numel()

    def sample(self, k: int, salt: int) -> torch.Tensor:
        return torch.from_numpy(np.sort(bottom_k(self.colliders().numpy(), k, salt)))

    def try_last(self, choose: ChooseLast, chunk_rows: int) -> int:
        rows = self.colliders()
        last = torch.empty(rows.numel(), dtype=self.codes.dtype)
        for a, b in window_slices(rows.numpy(), chunk_rows):
            last[a:b] = choose(rows[a:b]).to(self.codes.dtype)
        self._undo = (rows, self.codes[rows, -1].clone())
        self.codes[rows, -1] = last
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


def round_salt(seed: int, round_: int) -> int:
    """The `sample_keys` salt of Sinkhorn round `round_` (0-based) under `seed`."""
    return (int(seed) << 20) + int(round_)


def sinkhorn_rounds(
    store: LastCodes,
    last_cost: LastCost,
    epsilon: float = 0.003,
    iters: int = 50,
    rounds: int = 20,
    sample_rows: int = 65536,
    chunk_rows: int = 65536,
    seed: int = 0,
    min_gain: float = 0.0,
    log: Callable[[str], None] | None = None,
) -> int:
    """Re-assign the last code of colliding items by balanced Sinkhorn, up to `rounds` times:
    no code may take more than its share, which forces near-identical items apart.

    Returns the rounds run; `store` holds the codes. In each round, the colliders' last-level
    costs (`last_cost(rows)`, rows as the store numbers them) give K column prices by one
    Sinkhorn, as LC-Rec does over all colliders. When there are more than `sample_rows`
    colliders, the prices come from a seeded uniform sample of that many (the colliders with
    the smallest `sample_keys`, salted by seed and round, so the store finds it a bucket at a
    time), because the prices of a uniform sample estimate those of the whole set. Every
    collider then takes its cheapest code after prices, scored window by window in row order
    (`window_slices`: at most `chunk_rows` rows each). What a round holds is the sample's cost
    and Sinkhorn, one window's residuals and cost, and what the store holds (for
    `BucketCodes`, one bucket): nothing per collider of the whole set.

    Stops when nothing collides, or when a round does not reduce the number of colliding
    items. That last round is undone, so the result is never worse than its input. It also
    stops after a round that frees fewer than `min_gain` of the colliders. That round is
    kept. Late rounds free a few tenths of a percent each (mostly near-duplicate items that
    no price can separate), and de-duplication handles what is left.
    """
    m = store.count()
    done = 0
    while m > 0 and done < rounds:
        fit = store.sample(sample_rows, round_salt(seed, done))
        scale, v = sinkhorn_prices(last_cost(fit), epsilon, iters)
        del fit

        def choose(rows: torch.Tensor) -> torch.Tensor:  # codes < K: int32, half argmax's int64
            return priced_assign(last_cost(rows), scale, v, epsilon).to(torch.int32)

        after = store.try_last(choose, chunk_rows)
        if after >= m:
            store.undo()
            break
        store.keep()
        done += 1
        if log is not None:
            log(f"Sinkhorn round {done}: {m:,} -> {after:,} colliding items")
        if m - after < min_gain * m:
            break
        m = after
    return done


# Both de-duplications decide within prefix groups only: a group's codes depend on its own rows
# alone (a group where nothing can move stays as it is, so stopping when nothing moves anywhere,
# or after `max_rounds`, leaves it as stopping for it alone would). So they give the same codes
# run on any set of whole prefix groups at a time (`gti.sid.collide` runs them bucket by bucket);
# only whether an extra level is added at all is a decision over every row.
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
