"""gti.train.batching: length-grouped micro-batches cover the epoch once and save padding."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from gti.train import batching
from gti.train.batching import length_grouped_batches, padded_tokens


def _lengths(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(40, 91, n)


def _check_epoch(batches, n: int, micro: int) -> None:
    rows = np.concatenate(batches) if batches else np.array([], dtype=np.int64)
    assert sorted(rows.tolist()) == list(range(n))  # every row exactly once
    sizes = [len(b) for b in batches]
    short = [s for s in sizes if s != micro]
    assert len(short) <= 1 and all(0 < s < micro for s in short)
    assert len(short) == (1 if n % micro else 0)


def test_deterministic_for_a_seed_and_different_for_another():
    lens = _lengths(1000)
    a = length_grouped_batches(lens, 8, seed=1, window=4)
    b = length_grouped_batches(list(lens), 8, seed=1, window=4)
    c = length_grouped_batches(lens, 8, seed=2, window=4)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("n,micro,window", [(1000, 8, 4), (1003, 8, 4), (37, 5, 64), (7, 8, 2), (1, 1, 1)])
def test_every_row_exactly_once_and_at_most_one_short_batch(n, micro, window):
    _check_epoch(length_grouped_batches(_lengths(n), micro, seed=0, window=window), n, micro)


def test_empty_epoch_is_no_batches():
    assert length_grouped_batches([], 4, seed=0) == []
    assert padded_tokens([], []) == 0


def test_grouped_pads_far_less_than_random_batches():
    lens = _lengths(4096, seed=5)
    micro = 16
    grouped = padded_tokens(lens, length_grouped_batches(lens, micro, seed=0))
    perm = np.random.default_rng(0).permutation(len(lens))
    random = padded_tokens(lens, [perm[i:i + micro] for i in range(0, len(lens), micro)])
    assert grouped >= int(lens.sum())  # never less than the real tokens
    assert grouped < 0.8 * random


def test_batches_are_length_sorted_inside_a_window_and_order_is_shuffled():
    lens = _lengths(2048, seed=3)
    batches = length_grouped_batches(lens, 8, seed=0, window=16)
    spreads = [int(lens[b].max() - lens[b].min()) for b in batches]
    assert np.mean(spreads) < 10  # random batches of 8 from 40..90 spread ~ 40
    # No length curriculum: batch max lengths are not monotone over the epoch.
    maxes = np.array([lens[b].max() for b in batches])
    assert abs(np.corrcoef(np.arange(len(maxes)), maxes)[0, 1]) < 0.2


def test_window_one_groups_nothing_but_still_covers_the_epoch():
    lens = _lengths(1001)
    batches = length_grouped_batches(lens, 4, seed=9, window=1)
    _check_epoch(batches, 1001, 4)
    # window=1: each window is one micro-batch, so "grouping" only sorts inside a batch and
    # saves nothing against random batches of the same size.
    assert all((np.diff(lens[b]) >= 0).all() for b in batches)
    perm = np.random.default_rng(1).permutation(len(lens))
    random = padded_tokens(lens, [perm[i:i + 4] for i in range(0, len(lens), 4)])
    one = padded_tokens(lens, batches)
    assert 0.9 * random < one < 1.1 * random
    # A real window does group: near the unpadded token count (random batches of 4 from 40..90
    # pay ~80 per row against a mean of 65, so 0.81x is the floor here).
    grouped = padded_tokens(lens, length_grouped_batches(lens, 4, seed=9, window=64))
    assert grouped < 1.03 * int(lens.sum()) and grouped < 0.85 * one


def test_padded_tokens_counts_rows_times_longest():
    lens = [3, 5, 2, 7]
    assert padded_tokens(lens, [np.array([0, 1]), np.array([2, 3])]) == 2 * 5 + 2 * 7
    assert padded_tokens(lens, [[0, 1, 2, 3]]) == 4 * 7


@pytest.mark.parametrize("kwargs,name", [
    ({"micro": 0}, "micro"), ({"micro": -2}, "micro"), ({"micro": 1.5}, "micro"),
    ({"window": 0}, "window"), ({"window": -1}, "window"),
])
def test_bad_arguments_raise_naming_the_argument(kwargs, name):
    args = {"lengths": [1, 2, 3], "micro": 2, "seed": 0, "window": 4} | kwargs
    with pytest.raises(ValueError, match=name):
        length_grouped_batches(**args)


def test_module_imports_neither_torch_nor_ray():
    tree = ast.parse(Path(batching.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert not names & {"torch", "ray"}
