"""Tests of gti.sid.resolve (collisions, Sinkhorn spreading, de-duplication) and quality gates."""

from __future__ import annotations

import pytest
import torch

from gti.errors import GateError
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


def _sinkhorn_resolve_before_buckets(codes, last_cost, epsilon=0.003, iters=50, rounds=20, sample_rows=65536,
                                     chunk_rows=262144, seed=0, min_gain=0.0):
    """`sinkhorn_resolve` as it was before `sinkhorn_rounds` (issue 33 item 5), one loop on
    the array, kept to pin that the rounds on a `LastCodes` give the same codes."""
    from gti.sid.balance import priced_assign, sinkhorn_prices

    codes = codes.clone()
    gen = torch.Generator().manual_seed(seed)
    rows = colliding_rows(codes)
    done = 0
    while rows.numel() > 0 and done < rounds:
        m = rows.numel()
        fit = rows if m <= sample_rows else rows[torch.randperm(m, generator=gen)[:sample_rows].sort().values]
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
def test_sinkhorn_resolve_is_the_loop_before_buckets(n, k, sample_rows, min_gain):
    codes, table = _crowded(n, k) if k > 1 else (torch.zeros(n, 2, dtype=torch.long), torch.rand(n, 1))
    kw = dict(epsilon=0.003, iters=100, sample_rows=sample_rows, chunk_rows=150, seed=3, min_gain=min_gain)
    want, want_rounds = _sinkhorn_resolve_before_buckets(codes, lambda r: table[r], **kw)
    got, rounds = sinkhorn_resolve(codes, lambda r: table[r], **kw)
    assert torch.equal(got, want) and rounds == want_rounds
    assert rounds >= 1 or k == 1  # (one code: the first round is undone)
