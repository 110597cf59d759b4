"""Tests of gti.sid.balance (Sinkhorn-Knopp)."""

from __future__ import annotations

import math

import torch

import gti.sid.balance as balance
from gti.sid.balance import (
    normalise_cost, priced_assign, sinkhorn_assign, sinkhorn_plan, sinkhorn_potentials, sinkhorn_potentials_scaled,
    sinkhorn_prices,
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


def _costs(n: int, k: int, seed: int) -> torch.Tensor:
    """[n, k] normalised costs with structure: rows near one of k/4 centres."""
    g = torch.Generator().manual_seed(seed)
    pts, centres = torch.randn(n, 8, generator=g), torch.randn(k, 8, generator=g)
    return normalise_cost(torch.cdist(pts, centres) ** 2)


def test_scaled_sinkhorn_is_the_log_domain_one(monkeypatch):
    """The scaling-domain iterations give the log-domain potentials (to float32 rounding) and
    the same priced argmax, cold and warm-started, at the stage's small epsilon (where the
    scalings are absorbed back into the kernel several times) and a large one."""
    builds = []
    kernel = balance._kernel_
    monkeypatch.setattr(balance, "_kernel_", lambda *a: builds.append(1) or kernel(*a))
    for seed, (n, k, eps, iters) in enumerate([(600, 32, 0.003, 50), (600, 32, 0.003, 10), (400, 16, 0.05, 50)]):
        cost = _costs(n, k, seed)
        for v0 in (None, torch.randn(k, generator=torch.Generator().manual_seed(seed)) * 20):
            u1, v1 = sinkhorn_potentials(cost, eps, iters, tol=1e-2, v0=v0)
            torch.set_flush_denormal(True)
            try:
                u2, v2 = sinkhorn_potentials_scaled(cost, eps, iters, tol=1e-2, v0=v0)
            finally:
                torch.set_flush_denormal(False)
            torch.testing.assert_close(v2 - v2.mean(), v1 - v1.mean(), atol=2e-3, rtol=1e-4)
            torch.testing.assert_close(u2 + v2.mean(), u1 + v1.mean(), atol=2e-3, rtol=1e-4)
            assert torch.equal((v1 - cost / eps).argmax(1), (v2 - cost / eps).argmax(1))
    assert len(builds) > 6  # one per call, and absorptions


def test_scaled_sinkhorn_reaches_balanced_columns():
    """Run to convergence, the plan's columns carry 1/K each: the potentials are a solution,
    also with one code far from every row (its column's products underflow to 0 at first)."""
    cost = _costs(500, 10, 3)
    cost[:, 0] += 5.0  # code 0 is far from everyone
    _, v = sinkhorn_potentials_scaled(cost, 0.05, 2000, tol=1e-6)
    u = torch.logsumexp(-cost / 0.05 + v.unsqueeze(0), dim=1).neg() - math.log(500)
    plan = torch.exp(-cost / 0.05 + u.unsqueeze(1) + v.unsqueeze(0))
    torch.testing.assert_close(plan.sum(0), torch.full((10,), 0.1), atol=1e-4, rtol=1e-3)
    assert torch.isfinite(v).all() and int(v.argmax()) == 0  # the far code got the highest price


def test_scaled_sinkhorn_torch_ops_match_the_numpy_ones(monkeypatch):
    """The loop's torch operations (what a CUDA cost takes) give the CPU numpy path's
    potentials: run both on one CPU cost."""
    cost = _costs(300, 16, 5)
    want = sinkhorn_potentials_scaled(cost, 0.003, 50, tol=1e-2)
    monkeypatch.setattr(balance, "_NumpyOps", balance._TorchOps)
    got = sinkhorn_potentials_scaled(cost, 0.003, 50, tol=1e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
