"""Tests of gti.sid.resolve (collisions, Sinkhorn spreading, de-duplication) and quality gates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gti.common.errors import GateError
from gti.sid.quality import check_gates, level_usage
from gti.sid.balance import sinkhorn_assign
from gti.sid.resolve import (collision_rate, colliding_rows, dedup_extra_level, dedup_reassign,
                             group_ids, sinkhorn_resolve)


def _colliding_codes(seed=0, n=400, k=8):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 3, (n, 3), generator=g)
    codes[:, 2] = torch.randint(0, k, (n,), generator=g)
    return codes


def _cost_fn(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    table = torch.rand(n, k, generator=g)
    return lambda rows: table[rows]


def test_group_ids_and_rate():
    codes = torch.tensor([[0, 1], [0, 1], [2, 3], [0, 1], [2, 4]])
    gid = group_ids(codes)
    assert gid[0] == gid[1] == gid[3] and len({int(gid[2]), int(gid[4]), int(gid[0])}) == 3
    assert collision_rate(codes) == pytest.approx(1 - 3 / 5)
    assert colliding_rows(codes).tolist() == [0, 1, 3]
    big = torch.tensor([[2**40, 2**40], [2**40, 2**40], [1, 0]])  # packing would overflow
    assert group_ids(big).tolist()[0] == group_ids(big).tolist()[1] != group_ids(big).tolist()[2]


def test_extra_level_makes_unique():
    codes = _colliding_codes()
    assert collision_rate(codes) > 0.3
    out = dedup_extra_level(codes)
    assert out.shape == (400, 4)
    assert collision_rate(out) == 0.0
    assert torch.equal(out[:, :3], codes)
    # Non-colliding items get 0; a group of n gets 0..n-1.
    gid = group_ids(codes)
    for g in gid.unique()[:20]:
        members = (gid == g).nonzero().flatten()
        assert sorted(out[members, 3].tolist()) == list(range(members.numel()))
    uniq = torch.unique(torch.tensor([[0, 1], [2, 3]]), dim=0)
    assert torch.equal(dedup_extra_level(uniq), uniq)  # nothing to do: no level added


def test_reassign_makes_unique_and_keeps_prefixes():
    codes = _colliding_codes(k=64)  # 9 prefixes x 64 codes > 400 items: room for everyone
    out = dedup_reassign(codes, _cost_fn(400, 64))
    assert out.shape == codes.shape
    assert collision_rate(out) == 0.0
    assert torch.equal(out[:, :2], codes[:, :2])
    # Items that did not collide keep their code.
    clean = torch.ones(400, dtype=torch.bool)
    clean[colliding_rows(codes)] = False
    assert torch.equal(out[clean], codes[clean])


def test_reassign_full_prefix_falls_back_to_extra_level():
    codes = torch.zeros(10, 2, dtype=torch.long)
    codes[:, 1] = torch.arange(10) % 2  # one prefix, 2 last codes, 10 items
    out = dedup_reassign(codes, _cost_fn(10, 2))
    assert out.shape == (10, 3) and collision_rate(out) == 0.0


def _crowded(n: int, prefixes: int, k: int = 64, seed: int = 1):
    """Codes [n, 2] (prefix, greedy last code) and a cost table [n, k] where everyone prefers
    last code 0 or 1 by a little, so greedy codes collide massively."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.zeros(n, 2, dtype=torch.long)
    codes[:, 0] = torch.randint(0, prefixes, (n,), generator=g)
    table = torch.rand(n, k, generator=g)
    table[:, :2] -= 1.0
    codes[:, 1] = table.argmin(1)
    return codes, table


def test_sinkhorn_resolve_reduces_collisions():
    codes, table = _crowded(100, 4)
    before = collision_rate(codes)
    out, rounds = sinkhorn_resolve(codes, lambda rows: table[rows], epsilon=0.003, iters=100)
    assert collision_rate(out) < before / 3
    assert torch.equal(out[:, 0], codes[:, 0]) and rounds >= 1


def test_level_usage():
    codes = torch.tensor([[0, 0], [1, 0], [2, 0], [3, 0]])
    util, perp = level_usage(codes, [4, 8])
    assert util == [1.0, 1 / 8]
    assert perp[0] == pytest.approx(4.0) and perp[1] == pytest.approx(1.0)


def test_gate_failure_message():
    with pytest.raises(GateError) as err:
        check_gates([0.9, 0.01, 0.5], 0.02, min_utilisation=0.05, max_collision_rate=0.0,
                    extra={"collision_rate_before": 0.3})
    msg = str(err.value)
    assert "\n" not in msg
    assert "level(s) 1 (0.010)" in msg and "sid.gates.min_utilisation=0.05" in msg
    assert "collision rate 0.0200" in msg and "collision_rate_before" in msg
    check_gates([0.9, 0.5], 0.0, min_utilisation=0.05, max_collision_rate=0.0)  # passes


def test_sampled_sinkhorn_resolve_still_spreads_collisions():
    """With more colliders than `sample_rows` (millions, in practice) the prices come from a
    sample and every collider is scored in chunks: no cost call exceeds either bound, and it
    resolves about as well as one Sinkhorn over all colliders."""
    n = 600
    codes, table = _crowded(n, 12)
    before = collision_rate(codes)
    seen = []

    def cost(rows):
        seen.append(rows.numel())
        return table[rows]

    whole, _ = sinkhorn_resolve(codes, cost, epsilon=0.003, iters=100)
    assert max(seen) > 100
    seen.clear()
    sampled, rounds = sinkhorn_resolve(codes, cost, epsilon=0.003, iters=100, sample_rows=100, chunk_rows=150)
    assert rounds >= 1 and max(seen) <= 150
    assert collision_rate(sampled) < before / 3
    assert collision_rate(sampled) <= 1.5 * collision_rate(whole) + 0.01
    # Seeded: the same call gives the same codes.
    again, _ = sinkhorn_resolve(codes, cost, epsilon=0.003, iters=100, sample_rows=100, chunk_rows=150)
    assert torch.equal(again, sampled)


def test_first_round_with_all_colliders_is_one_sinkhorn_over_them():
    """Under `sample_rows` colliders a round is LC-Rec's: one balanced assignment of all."""
    codes, table = _crowded(300, 5)
    rows = colliding_rows(codes)
    out, rounds = sinkhorn_resolve(codes, lambda r: table[r], epsilon=0.003, iters=100, rounds=1, chunk_rows=7)
    assert rounds == 1
    assert torch.equal(out[rows, -1], sinkhorn_assign(table[rows], epsilon=0.003, iters=100))


def test_a_round_that_does_not_help_is_undone():
    # One last-level code: nobody can move, so the round changes nothing useful and stops.
    codes = torch.zeros(20, 2, dtype=torch.long)
    codes[:, 0] = torch.arange(20) % 4
    logs = []
    out, rounds = sinkhorn_resolve(codes, lambda r: torch.rand(r.numel(), 1), log=logs.append)
    assert rounds == 0 and torch.equal(out, codes) and logs == []
    # When it helps, every round is logged with its colliders before and after.
    crowded, table = _crowded(200, 4)
    sinkhorn_resolve(crowded, lambda r: table[r], epsilon=0.003, iters=100, log=logs.append)
    assert logs and logs[0].startswith("Sinkhorn round 1: ") and "colliding items" in logs[0]


def test_min_gain_stops_after_a_round_that_frees_too_few():
    codes, table = _crowded(600, 12)
    full_logs, gain_logs = [], []
    full, full_rounds = sinkhorn_resolve(codes, lambda r: table[r], epsilon=0.003, iters=100, log=full_logs.append)
    gains = []
    for line in full_logs:  # "Sinkhorn round k: a -> b colliding items"
        a, b = (int(x.replace(",", "")) for x in line.split(": ")[1].split(" colliding")[0].split(" -> "))
        gains.append((a - b) / a)
    assert full_rounds >= 3 and gains[0] > 0.3
    # A threshold between round 2's gain and round 1's stops right after round 2.
    assert gains[1] < gains[0]
    threshold = (gains[1] + gains[0]) / 2
    out, rounds = sinkhorn_resolve(codes, lambda r: table[r], epsilon=0.003, iters=100,
                                   min_gain=threshold, log=gain_logs.append)
    assert rounds == 2 and gain_logs == full_logs[:2]
    assert collision_rate(out) < collision_rate(codes)


def _sinkhorn_loop_on_the_array(codes, last_cost, epsilon=0.003, iters=50, rounds=20, sample_rows=65536,
                                chunk_rows=65536, seed=0, min_gain=0.0):
    """`sinkhorn_resolve` written as one loop on the array, to pin what the rounds on a
    `LastCodes` do: the sample is the colliders with the smallest keys (a full sort here), the
    last codes are scored in count chunks (the same per row as `sinkhorn_rounds`' row windows
    when last_cost is a lookup). Below `sample_rows` colliders it is the loop before issue 33's
    keyed sample, so small catalogs keep their maps."""
    from gti.sid.balance import priced_assign, sinkhorn_prices
    from gti.sid.resolve import round_salt, sample_keys

    codes = codes.clone()
    rows = colliding_rows(codes)
    done = 0
    while rows.numel() > 0 and done < rounds:
        m = rows.numel()
        keys = sample_keys(rows.numpy(), round_salt(seed, done))
        fit = rows if m <= sample_rows else rows[torch.from_numpy(np.argsort(keys)[:sample_rows])].sort().values
        scale, v = sinkhorn_prices(last_cost(fit), epsilon, iters)
        new_last = torch.cat([priced_assign(last_cost(rows[s : s + chunk_rows]), scale, v, epsilon)
                              for s in range(0, m, chunk_rows)])
        old_last = codes[rows, -1].clone()
        codes[rows, -1] = new_last
        after = colliding_rows(codes)
        if after.numel() >= m:
            codes[rows, -1] = old_last
            break
        done += 1
        if m - after.numel() < min_gain * m:
            break
        rows = after
    return codes, done


@pytest.mark.parametrize("n,k,sample_rows,min_gain", [(600, 12, 100, 0.0), (300, 5, 65536, 0.0), (600, 12, 64, 0.2),
                                                      (20, 1, 65536, 0.0)])
def test_sinkhorn_resolve_is_the_loop_on_the_array(n, k, sample_rows, min_gain):
    codes, table = _crowded(n, k) if k > 1 else (torch.zeros(n, 2, dtype=torch.long), torch.rand(n, 1))
    kw = dict(epsilon=0.003, iters=100, sample_rows=sample_rows, chunk_rows=150, seed=3, min_gain=min_gain)
    want, want_rounds = _sinkhorn_loop_on_the_array(codes, lambda r: table[r], **kw)
    got, rounds = sinkhorn_resolve(codes, lambda r: table[r], **kw)
    assert torch.equal(got, want) and rounds == want_rounds
    assert rounds >= 1 or k == 1  # (one code: the first round is undone)


def test_sample_keys_are_distinct_seeded_and_bottom_k_merges_by_parts():
    from gti.sid.resolve import bottom_k, sample_keys

    rows = np.arange(0, 200_000, 3, dtype=np.int64)
    keys = sample_keys(rows, salt=7)
    assert np.unique(keys).size == rows.size  # a bijection: no ties to break
    assert np.array_equal(keys, sample_keys(rows, 7)) and not np.array_equal(keys, sample_keys(rows, 8))
    whole = np.sort(bottom_k(rows, 500, 7))
    assert np.array_equal(whole, np.sort(rows[np.argsort(keys)[:500]]))
    # bottom_k of a union is bottom_k of the parts' bottom_ks: the sample found bucket by bucket.
    parts = [rows[rows % 5 == j] for j in range(5)]
    merged = np.zeros(0, np.int64)
    for part in parts:
        merged = bottom_k(np.concatenate([merged, bottom_k(part, 500, 7)]), 500, 7)
    assert np.array_equal(np.sort(merged), whole)
    assert np.array_equal(np.sort(bottom_k(rows[:40], 500, 7)), rows[:40])  # all when few
    # Uniform over the rows: each third of the range gets about a third of the sample.
    thirds = np.bincount(whole * 3 // 200_000, minlength=3)
    assert thirds.min() > 120


def test_windows_hold_whole_bins_and_at_most_chunk_rows():
    from gti.sid.resolve import window_bins, window_slices

    # 3 + 4 (+ an empty bin) fill one window; 2 alone; 9 > 7 alone; empty bins open none.
    assert window_bins(np.array([0, 3, 4, 0, 2, 9, 0]), 7) == [(1, 4), (4, 5), (5, 6)]
    assert window_bins(np.zeros(4, np.int64), 7) == []
    g = np.random.default_rng(0)
    rows = np.sort(g.choice(100_000, 9_000, replace=False))
    sl = window_slices(rows, 1000)
    assert sl[0][0] == 0 and sl[-1][1] == rows.size
    assert all(b == c for (_, b), (c, _) in zip(sl, sl[1:]))  # consecutive, covering every row
    assert all(0 < b - a <= 1000 for a, b in sl)
    # A window ends at a bin edge (a multiple of chunk_rows): it depends on the rows, not on
    # how they are split into buckets.
    assert all(rows[b - 1] // 1000 < rows[b] // 1000 for _, b in sl[:-1])


def test_sinkhorn_rounds_ask_costs_for_at_most_a_sample_or_a_window():
    """What a round holds on the driver: the sample's cost and one window's, never all
    colliders' (issue 33 item 5)."""
    codes, table = _crowded(600, 12)
    seen = []
    sinkhorn_resolve(codes, lambda r: seen.append(r.numel()) or table[r], epsilon=0.003, iters=100,
                     sample_rows=64, chunk_rows=50)
    assert colliding_rows(codes).numel() > 200 and max(seen) <= 64
