"""Tests of gti.sid.trie: allowed sets and item lookup equal a brute-force answer."""

from __future__ import annotations

import random

import pytest
import torch

from gti.sid.trie import SidTrie


def _random_sids(rng: random.Random, n: int, sizes: list[int], start: int, dup: bool):
    """[n, L] global token ids; level l uses ids offsets[l] + code (like SidCodec)."""
    offs = [start + sum(sizes[:i]) for i in range(len(sizes))]
    rows = [[offs[lv] + rng.randrange(k) for lv, k in enumerate(sizes)] for _ in range(n)]
    if not dup:
        rows = [list(r) for r in dict.fromkeys(tuple(r) for r in rows)]
    return torch.tensor(rows), offs


def _brute_allowed(rows: list[list[int]], prefix: list[int], start: int, v: int) -> torch.Tensor:
    m = torch.zeros(v, dtype=torch.bool)
    t = len(prefix)
    for r in rows:
        if r[:t] == prefix:
            m[r[t] - start] = True
    return m


@pytest.mark.parametrize("dense_max_bytes", [0, 64 * 2**20])
def test_allowed_equals_brute_force(dense_max_bytes):
    rng = random.Random(1234)
    for trial in range(12):
        levels = rng.randint(1, 4)
        sizes = [rng.randint(1, 6) for _ in range(levels)]
        start = rng.randint(0, 50)
        sids, offs = _random_sids(rng, rng.randint(1, 60), sizes, start, dup=trial % 3 == 0)
        v = sum(sizes) + rng.randint(0, 3)  # the new slice may hold extra tokens (markers)
        trie = SidTrie(sids, start, start + v, dense_max_bytes=dense_max_bytes)
        rows = sids.tolist()
        for t in range(levels):
            # Prefixes: true prefixes of items plus random (often invalid) ones, incl. ids
            # outside the new slice.
            pref = [r[:t] for r in rows]
            for _ in range(20):
                pref.append([rng.randint(start - 2, start + v + 1) for _ in range(t)])
            pref_t = torch.tensor(pref, dtype=torch.long).reshape(len(pref), t)
            got = trie.allowed(pref_t)
            assert got.shape == (len(pref), v) and got.dtype == torch.bool
            want = torch.stack([_brute_allowed(rows, p, start, v) for p in pref])
            assert torch.equal(got, want), (trial, t)


def test_item_index_equals_brute_force():
    rng = random.Random(7)
    for trial in range(10):
        sizes = [rng.randint(2, 8) for _ in range(3)]
        sids, offs = _random_sids(rng, 80, sizes, 1000, dup=trial % 2 == 0)
        trie = SidTrie(sids, 1000, 1000 + sum(sizes))
        rows = sids.tolist()
        queries = rows + [[o + rng.randrange(k) for o, k in zip(offs, sizes)] for _ in range(50)]
        queries.append([0, 0, 0])
        got = trie.item_index(torch.tensor(queries)).tolist()
        want = [rows.index(q) if q in rows else -1 for q in queries]
        assert got == want
        assert trie.has_duplicates == (len({tuple(r) for r in rows}) != len(rows))
        assert trie.num_items == len(rows) and trie.levels == 3


def test_incremental_api_matches_allowed():
    rng = random.Random(3)
    sids, _ = _random_sids(rng, 200, [8, 8, 8, 8], 10, dup=False)
    trie = SidTrie(sids, 10, 42)
    b = 16
    nodes = trie.root(b)
    prefix = torch.zeros(b, 0, dtype=torch.long)
    for d in range(4):
        m = trie.allowed_at(nodes, d)
        assert torch.equal(m, trie.allowed(prefix))
        # Pick an allowed token for every row (first one), like a greedy decoder would.
        tok = m.float().argmax(dim=1) + 10
        nodes = trie.advance(nodes, d, tok)
        prefix = torch.cat([prefix, tok[:, None]], dim=1)
    assert (trie.item_index(prefix) >= 0).all()


def test_bad_inputs():
    with pytest.raises(ValueError, match="outside"):
        SidTrie(torch.tensor([[5, 20]]), 5, 10)
    trie = SidTrie(torch.tensor([[5, 7]]), 5, 10)
    with pytest.raises(ValueError):
        trie.allowed(torch.zeros(1, 2, dtype=torch.long))  # t == L
    with pytest.raises(ValueError):
        trie.item_index(torch.zeros(1, 1, dtype=torch.long))
