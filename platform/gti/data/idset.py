"""A set of string ids held compactly: how ingest's driver spots duplicate ids and unknown items.

What it is for: the catalog check "is this id new?" and the interactions check "is this item
known?" need every kept id at once, which on a 50M-item catalog is the driver's largest object;
a Python `set[str]` holds a str object per id, several times the id's bytes
(bench/scale_memory/RESULTS.md, "Collision resolution that finishes at 5M, and a compact ingest
id set"). `IdSet` keeps each id once, in Arrow, beside a 64-bit hash, and its answers are exact.

What it does not know: files, quarantine reasons, Ray.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc


def _hash(ids: pa.Array) -> np.ndarray:
    """uint64 [n]: a hash per id of a large_string array (nulls hash too; callers never store
    or look up nulls)."""
    return pl.Series(ids).hash(seed=0).to_numpy()


class IdSet:
    """Exact set of non-null string ids; batch `contains`, `add` and `first_new`.

    Each id is held once, in Arrow (8 B offset plus its bytes), beside a 64-bit hash (8 B). Both
    sit in sorted runs that merge like a binary counter, so adding N ids copies O(N log N) bytes
    and a lookup is a few `searchsorted` calls. A hash match is confirmed by comparing the ids
    themselves, so two ids that share a hash are never taken for each other."""

    def __init__(self) -> None:
        # Each run: (hashes uint64 [m] sorted, ids large_string [m] in the same order).
        self.runs: list[tuple[np.ndarray, pa.Array]] = []
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def contains(self, ids: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """bool [n]: which ids are in the set (null -> False)."""
        ids = _as_array(ids)
        h = _hash(ids)
        found = np.zeros(len(ids), dtype=bool)
        valid = ids.is_valid().to_numpy(zero_copy_only=False)
        for hs, run_ids in self.runs:
            lo = np.searchsorted(hs, h, side="left")
            hi = np.searchsorted(hs, h, side="right")
            cand = np.nonzero((hi > lo) & ~found & valid)[0]
            if cand.size == 0:
                continue
            # Usual case: one stored id per hash; compare it with the query, vectorised.
            stored = run_ids.take(pa.array(lo[cand]))
            same = pc.equal(stored, ids.take(pa.array(cand))).to_numpy(zero_copy_only=False)
            found[cand[same]] = True
            # Rare case: other stored ids with the same hash (a 64-bit collision).
            for i in cand[~same & (hi[cand] - lo[cand] > 1)]:
                q = ids[int(i)].as_py()
                found[i] = any(run_ids[j].as_py() == q for j in range(lo[i] + 1, hi[i]))
        return found

    def add(self, ids: pa.Array | pa.ChunkedArray) -> None:
        """Add ids that are distinct, non-null and not yet in the set (see `first_new`)."""
        ids = _as_array(ids)
        if len(ids) == 0:
            return
        if ids.null_count:
            raise ValueError("IdSet.add: null ids cannot be stored")
        h = _hash(ids)
        order = np.argsort(h, kind="stable")
        self.runs.append((h[order], ids.take(pa.array(order))))
        self.n += len(ids)
        # Merge while the newer run is at least half the older one: O(log N) runs.
        while len(self.runs) > 1 and len(self.runs[-2][0]) < 2 * len(self.runs[-1][0]):
            (h1, i1), (h2, i2) = self.runs[-2], self.runs[-1]
            hs = np.concatenate([h1, h2])
            order = np.argsort(hs, kind="stable")
            self.runs[-2:] = [(hs[order], pa.concat_arrays([i1, i2]).take(pa.array(order)))]

    def first_new(self, ids: pa.Array | pa.ChunkedArray, consider: np.ndarray | None = None) -> np.ndarray:
        """bool [n]: rows whose id is not in the set and does not occur in an earlier row.

        Only rows where `consider` (bool [n], default all) is True take part: the others are
        False and do not count as an earlier occurrence. Nulls are never new.
        """
        ids = _as_array(ids)
        n = len(ids)
        mask = ids.is_valid().to_numpy(zero_copy_only=False)
        if consider is not None:
            mask &= consider
        rows = np.nonzero(mask)[0]
        out = np.zeros(n, dtype=bool)
        if rows.size == 0:
            return out
        sub = ids.take(pa.array(rows))
        first = pl.Series(sub).is_first_distinct().to_numpy()
        out[rows] = first & ~self.contains(sub)
        return out


def _as_array(ids: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One large_string array (64-bit offsets: no 2 GB limit on the ids' bytes)."""
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks() if ids.num_chunks != 1 else ids.chunk(0)
    return ids.cast(pa.large_string())
