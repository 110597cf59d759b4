"""Tests of gti.data.idset: the compact exact id set ingest's driver uses."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

import gti.data.idset as idset_mod
from gti.data.idset import IdSet


def _batches(seed: int, n_batches: int = 30, size: int = 200, universe: int = 3000):
    rnd = random.Random(seed)
    for _ in range(n_batches):
        yield [rnd.choice([None, *[str(rnd.randrange(universe))] * 20]) for _ in range(size)]


def _check_against_python_set(store: IdSet, seed: int) -> None:
    seen: set[str] = set()
    for raw in _batches(seed):
        arr = pa.array(raw, pa.string())
        want_new = []
        batch_seen: set[str] = set()
        for x in raw:
            want_new.append(x is not None and x not in seen and x not in batch_seen)
            if x is not None:
                batch_seen.add(x)
        new = store.first_new(arr)
        assert new.tolist() == want_new
        assert store.contains(arr).tolist() == [x is not None and x in seen for x in raw]
        store.add(arr.filter(pa.array(new)))
        seen.update(x for x, k in zip(raw, want_new) if k)
        assert len(store) == len(seen)
    # Runs merge: each at least twice the size of the next, so at most log2(N) + 1 of them.
    assert len(store.runs) <= int(np.log2(len(seen))) + 1


def test_matches_a_python_set():
    _check_against_python_set(IdSet(), seed=0)


def test_exact_when_distinct_ids_share_a_hash(monkeypatch):
    # A hash with only 7 values: almost every lookup meets other ids with its hash.
    real = idset_mod._hash
    monkeypatch.setattr(idset_mod, "_hash", lambda ids: real(ids) % np.uint64(7))
    _check_against_python_set(IdSet(), seed=1)


def test_consider_mask_and_chunked_input():
    store = IdSet()
    store.add(pa.array(["a"]))
    ids = pa.chunked_array([["a", "b"], ["b", "c", "c"]])
    # Row 1 ("b") is not considered, so row 2 is the first "b".
    consider = np.array([True, False, True, True, True])
    assert store.first_new(ids, consider).tolist() == [False, False, True, True, False]
    assert store.contains(ids).tolist() == [True, False, False, False, False]


def test_add_refuses_nulls():
    with pytest.raises(ValueError, match="null"):
        IdSet().add(pa.array(["x", None]))


def test_compact_per_id():
    store = IdSet()
    for s in range(0, 200_000, 20_000):
        store.add(pa.array([f"item-{i:07d}" for i in range(s, s + 20_000)]))
    held = sum(h.nbytes + ids.nbytes for h, ids in store.runs)
    # 8 B hash + 8 B offset + 12 B of text per id (a set of str needs ~100+ B).
    assert held / len(store) < 30
