"""Length-grouped micro-batches: one epoch's rows cut into batches of similar lengths.

What it is for: a right-padded micro-batch costs `rows * longest row` tokens, so a random mix of
short and long rows pays for padding. `length_grouped_batches` keeps the epoch random but puts
rows of similar length together ("bucketing" the way HF's `group_by_length` does it);
`padded_tokens` reports what a list of batches costs when right-padded, to compare against
random batching.

What it does NOT know: tokens, collation, padding sides, gradient accumulation, data-parallel
sharding (split the returned list across ranks yourself), torch or Ray. Pure numpy.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def length_grouped_batches(lengths: Sequence[int] | np.ndarray, micro: int, seed: int,
                           window: int = 64) -> list[np.ndarray]:
    """Row indices of one epoch as micro-batches of `micro` rows of similar length.

    1. a seeded permutation of the rows 0..n-1;
    2. cut into windows of `window * micro` consecutive rows (a local pool, so grouping stays
       random across the epoch rather than a global sort);
    3. inside each window a stable sort by length, cut into micro-batches of `micro` rows;
    4. a seeded shuffle of the batch order, so long and short batches alternate and training
       sees no length curriculum.
    The result depends only on (lengths, micro, seed, window). Returns a list of int64 arrays
    whose concatenation is a permutation of 0..len(lengths)-1 (every row exactly once); all have
    `micro` rows except possibly one (the epoch's remainder).
    """
    if isinstance(micro, bool) or int(micro) != micro or micro < 1:
        raise ValueError(f"micro must be an integer >= 1, got {micro!r}")
    if isinstance(window, bool) or int(window) != window or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")
    micro, window = int(micro), int(window)
    lens = np.asarray(lengths)
    if lens.ndim != 1:
        raise ValueError(f"lengths must be one-dimensional, got shape {lens.shape}")
    n = len(lens)
    if n == 0:
        return []
    rng = np.random.default_rng([int(seed), 0x6C656E])
    perm = rng.permutation(n)
    span = window * micro
    batches: list[np.ndarray] = []
    for start in range(0, n, span):
        rows = perm[start:start + span]
        rows = rows[np.argsort(lens[rows], kind="stable")]
        batches.extend(rows[i:i + micro].astype(np.int64) for i in range(0, len(rows), micro))
    order = rng.permutation(len(batches))
    return [batches[i] for i in order]


def padded_tokens(lengths: Sequence[int] | np.ndarray, batches: Sequence[Sequence[int] | np.ndarray]) -> int:
    """Tokens the batches cost when right-padded: sum of len(batch) * longest row in it."""
    lens = np.asarray(lengths)
    total = 0
    for b in batches:
        b = np.asarray(b, dtype=np.int64)
        if len(b):
            total += len(b) * int(lens[b].max())
    return total
