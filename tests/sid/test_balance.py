"""Tests of gti.sid.balance (Sinkhorn-Knopp)."""

from __future__ import annotations

import math

import torch

from gti.sid.balance import (
    normalise_cost, priced_assign, sinkhorn_assign, sinkhorn_plan, sinkhorn_potentials, sinkhorn_prices,
)


def test_plan_marginals():
    cost = torch.rand(64, 8)
    q = sinkhorn_plan(cost, epsilon=0.05, iters=500)
    assert torch.allclose(q.sum(1), torch.ones(64), atol=1e-3)
    assert torch.allclose(q.sum(0), torch.full((8,), 8.0), atol=1e-2)


def test_balances_a_lopsided_assignment():
    g = torch.Generator().manual_seed(0)
    # All points prefer code 0: greedy puts everything there.
    cost = torch.rand(256, 16, generator=g) * 0.1
    cost[:, 0] -= 1.0
    assert torch.bincount(cost.argmin(1), minlength=16).max() == 256
    a = sinkhorn_assign(cost, epsilon=0.003, iters=200)
    counts = torch.bincount(a, minlength=16)
    assert counts.max() <= 24 and counts.min() >= 8


def test_small_epsilon_float32_stays_finite():
    cost = torch.rand(1000, 256) * 1e4
    a = sinkhorn_assign(cost, epsilon=0.001, iters=30)
    assert a.min() >= 0 and a.max() < 256
    counts = torch.bincount(a, minlength=256)
    assert counts.max() < 40  # ~4 per code when balanced; greedy argmin is not constrained


def test_prices_learned_on_a_sample_balance_the_whole_set():
    g = torch.Generator().manual_seed(2)
    # 20,000 points that all lean towards codes 0-3 of 32; prices from 2,000 of them.
    cost = torch.rand(20000, 32, generator=g)
    cost[:, :4] -= 1.0
    greedy = torch.bincount(cost.argmin(1), minlength=32)
    assert greedy[4:].sum() == 0
    scale, v = sinkhorn_prices(cost[:2000], epsilon=0.003, iters=200)
    counts = torch.bincount(priced_assign(cost, scale, v, epsilon=0.003), minlength=32)
    share = 20000 / 32
    assert counts.min() > 0.6 * share and counts.max() < 1.4 * share
    # On the rows they were learned on, prices reproduce sinkhorn_assign exactly.
    assert torch.equal(priced_assign(cost[:2000], scale, v, 0.003), sinkhorn_assign(cost[:2000], 0.003, 200))


def test_warm_start_from_a_converged_solution_needs_one_iteration():
    g = torch.Generator().manual_seed(0)
    cost = torch.rand(500, 16, generator=g) ** 3  # lopsided: codes differ in appeal
    _, v = sinkhorn_potentials(cost, 0.05, 500, tol=1e-6)
    _, cold = sinkhorn_potentials(cost, 0.05, 1, tol=1e-6)
    _, warm = sinkhorn_potentials(cost, 0.05, 1, tol=1e-6, v0=v)
    assert (warm - v).abs().max() < 1e-4 < (cold - v).abs().max()


def _reference_potentials(cost, epsilon, iters, tol, v0=None):
    """The textbook log-domain loop (a new tensor per half-step), as before the shared buffer."""
    n, k = cost.shape
    logits = (-cost / epsilon).float()
    u = torch.zeros(n)
    v = torch.zeros(k) if v0 is None else v0.clone()
    for _ in range(iters):
        u = -math.log(n) - torch.logsumexp(logits + v.unsqueeze(0), dim=1)
        col = torch.logsumexp(logits + u.unsqueeze(1), dim=0)
        converged = float((v + col + math.log(k)).abs().max()) < tol
        v = -math.log(k) - col
        if converged:
            break
    return u, v


def test_potentials_are_bit_for_bit_the_textbook_loop():
    """The shared buffer is a speed change only: same u and v to the last bit, so SID maps
    made before it stay up to date (no version bump)."""
    gen = torch.Generator().manual_seed(3)
    cost = normalise_cost(torch.rand(3000, 64, generator=gen) ** 2)
    for eps, v0 in ((0.05, None), (0.003, torch.randn(64, generator=gen))):
        u, v = sinkhorn_potentials(cost, eps, 40, tol=1e-6, v0=v0)
        ru, rv = _reference_potentials(cost, eps, 40, 1e-6, v0)
        assert torch.equal(u, ru) and torch.equal(v, rv)
