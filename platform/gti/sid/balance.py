"""Sinkhorn-Knopp balanced assignment (entropic optimal transport), in the log domain.

What it is for: assigning N points to K codes so that every code receives about N/K points
while each point still prefers near codes. The `sid` stage uses it on the last SID level to
spread items that collide (as LC-Rec does); balanced residual k-means uses it in the balanced
steps that end its Lloyd iterations (`gti.sid.kmeans.balanced_kmeans`). The costs are normalised
first (`normalise_cost`); `sinkhorn_potentials_scaled` is the faster scaling-domain form
(bench/sid/RESULTS.md, "Balanced k-means with a scaling-domain Sinkhorn").

What it does not know: where the cost comes from (codebooks, residuals), SIDs, Ray.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch


def _shift_rows(cost: torch.Tensor) -> torch.Tensor:
    """cost [N, K] minus each row's minimum (the plan and the argmax do not change)."""
    return cost - cost.min(dim=1, keepdim=True).values


def normalise_cost(cost: torch.Tensor) -> torch.Tensor:
    """Cost [N, K] shifted per row to start at 0 and scaled by its median.

    A per-row shift does not change the transport plan (the row potential absorbs it) but
    removes each point's own distance to the codes, which otherwise lets a few far points set
    the scale for everyone (the global [-1, 1] scaling LC-Rec uses). After this, `epsilon` is
    relative to the typical gap between a point's best and other codes.
    """
    c = _shift_rows(cost)
    return c / c.median().clamp(min=1e-12)


# exp of inputs below about -87 gives a float32 denormal or 0, and on x86 CPUs that path is
# many times slower than a normal result (bench/sid/RESULTS.md, "Sinkhorn without denormals"). Terms
# e^-80 times the row's largest term and below cannot move a float32 sum, which holds a 1.
EXP_FLOOR = -80.0


def _logsumexp_(x: torch.Tensor, dim: int) -> torch.Tensor:
    """torch.logsumexp(x, dim) for finite x, computed in x's storage (x is overwritten): the
    same max, shift, exp and sum, with the shifted values floored at EXP_FLOOR first."""
    m = x.amax(dim, keepdim=True)
    return x.sub_(m).clamp_(min=EXP_FLOOR).exp_().sum(dim).log_().add_(m.squeeze(dim))


def sinkhorn_potentials(
    cost: torch.Tensor, epsilon: float, iters: int, tol: float = 1e-4, v0: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-domain Sinkhorn on cost [N, K] (already normalised). Log-potentials keep
    exp(-cost/epsilon) from underflowing in float32, where the textbook form needs float64.

    Returns (u [N], v [K]) with plan log Q_ij = -cost_ij / epsilon + u_i + v_j, whose rows sum
    to 1/N and columns to 1/K. Stops early once the column marginals are within `tol`
    (relative) of uniform. `v0` [K] warm-starts the column potentials (a previous solution on
    a similar cost: balanced k-means passes the last Lloyd step's).
    """
    n, k = cost.shape
    logits = (-cost / epsilon).float()
    log_r, log_c = -math.log(n), -math.log(k)
    u = torch.zeros(n, dtype=logits.dtype, device=cost.device)
    v = torch.zeros(k, dtype=logits.dtype, device=cost.device) if v0 is None else v0.to(logits.dtype).clone()
    # One [N, K] buffer for both half-steps: allocating `logits + v` afresh each time cost
    # a large share of an iteration on CPU (bench/sid/RESULTS.md, "Balanced k-means in faiss's iterations,
    # v4"); the values, and so u and v, are bit for bit those of the allocating form.
    buf = torch.empty_like(logits)
    for _ in range(iters):
        u = log_r - _logsumexp_(torch.add(logits, v.unsqueeze(0), out=buf), dim=1)
        col = _logsumexp_(torch.add(logits, u.unsqueeze(1), out=buf), dim=0)
        # After the u step rows are exact; the columns then hold v + col (log mass).
        converged = float((v + col - log_c).abs().max()) < tol
        v = log_c - col
        if converged:
            break
    return u, v


def sinkhorn_plan(cost: torch.Tensor, epsilon: float = 0.003, iters: int = 50) -> torch.Tensor:
    """Transport plan Q [N, K] (rows sum to 1, i.e. soft assignments; columns to N/K)."""
    c = normalise_cost(cost)
    u, v = sinkhorn_potentials(c, epsilon, iters)
    return torch.exp(-c / epsilon + u.unsqueeze(1) + v.unsqueeze(0)) * cost.shape[0]


def sinkhorn_prices(cost: torch.Tensor, epsilon: float = 0.003, iters: int = 50) -> tuple[float, torch.Tensor]:
    """Balancing prices for K codes learned on cost [N, K]: (scale, v [K]).

    scale is the median gap `normalise_cost` divides by; v the Sinkhorn column potentials.
    `priced_assign(cost, scale, v, epsilon)` then assigns any rows with these prices, so the
    prices can be learned on a sample and applied to many more rows.
    """
    shifted = _shift_rows(cost)
    scale = float(shifted.median().clamp(min=1e-12))
    with flushed_denormals():
        _, v = sinkhorn_potentials_scaled(shifted / scale, epsilon, iters)
    return scale, v


def priced_assign(cost: torch.Tensor, scale: float, v: torch.Tensor, epsilon: float) -> torch.Tensor:
    """LongTensor[N]: the code maximising -cost/(scale*epsilon) + v for each row of cost [N, K].

    A per-row shift of the cost never changes the argmax, so this equals the argmax of the
    Sinkhorn plan on the rows the prices were learned on. The shift is still applied: it keeps
    the float32 gaps between codes exact when the distances themselves are large.
    """
    return (v.unsqueeze(0) - _shift_rows(cost) / (scale * epsilon)).argmax(dim=1)


def sinkhorn_assign(cost: torch.Tensor, epsilon: float = 0.003, iters: int = 50) -> torch.Tensor:
    """Balanced hard assignment LongTensor[N]: argmax of the Sinkhorn plan per row.

    Only the column potentials change the argmax, so this is nearest code under a per-code
    price v_j that makes crowded codes dearer.
    """
    scale, v = sinkhorn_prices(cost, epsilon, iters)
    return priced_assign(cost, scale, v, epsilon)


@contextlib.contextmanager
def flushed_denormals():
    """Denormal floats read as 0 inside the block, in this thread (`sinkhorn_potentials_scaled`'s
    products of floored kernel entries and small scalings would otherwise take x86's slow path)."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


# Scalings past e^ABSORB_AT are folded back into the kernel (a fresh exp): float32 holds
# e^+-88; a kernel entry (e^-80..1) times its two scalings must stay inside that.
ABSORB_AT = 30.0
TINY = 1e-30  # a row or column whose every product was flushed to 0: its scaling jumps, then is absorbed


def _kernel_(cost: torch.Tensor, epsilon: float, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A = exp(-cost/epsilon + v_j - max_j(...)) written into `out` [N, K], floored at
    e^EXP_FLOOR; -> u_A [N], the row shifts (A_ij = exp(-cost_ij/epsilon + u_A_i + v_j))."""
    a = torch.mul(cost, -1.0 / epsilon, out=out).add_(v.unsqueeze(0))
    m = a.amax(1)
    a.sub_(m.unsqueeze(1)).clamp_(min=EXP_FLOOR).exp_()
    return m.neg_()


def sinkhorn_potentials_scaled(
    cost: torch.Tensor, epsilon: float, iters: int, tol: float = 1e-4, v0: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sinkhorn_potentials` in the scaling domain: the same iterations and stopping rule, each a
    pair of matrix-vector products on a kernel instead of two log-sum-exps over cost [N, K]: no
    exp per iteration, so balanced k-means' fit takes about a quarter of the time.

    The kernel A_ij = exp(-cost_ij/epsilon + u_A_i + v_A_j) holds the potentials so far; the
    iterations update scalings a = e^(u - u_A) [N], b = e^(v - v_A) [K] and fold them back into A
    (one exp) when one leaves e^+-ABSORB_AT. Kernel entries are floored at e^EXP_FLOOR of their
    row's largest, as the log-domain form floors its terms. Returns (u [N], v [K]) with the
    log-domain form's meaning, equal to it up to float32 rounding. Call it with denormals flushed
    (`torch.set_flush_denormal`): a floored entry times a small scaling is denormal, and x86
    multiplies those many times slower."""
    n, k = cost.shape
    # Rows sum to 1 and columns to N/K (the plan times N): the scalings stay near 1, so a
    # floored entry times its scaling stays a normal float32.
    c = n / k
    v_a = torch.zeros(k, dtype=torch.float32, device=cost.device) if v0 is None else v0.float().clone()
    kernel = torch.empty(n, k, dtype=torch.float32, device=cost.device)
    u_a = _kernel_(cost, epsilon, v_a, kernel)
    # On CPU the products run in numpy (its BLAS's float32 matrix-vector product beats torch's
    # here; bench/sid/RESULTS.md, "Balanced k-means with a scaling-domain Sinkhorn"); `A` is a view
    # of `kernel`, so an absorption's new kernel is seen at once.
    ops = _NumpyOps(kernel) if cost.device.type == "cpu" else _TorchOps(kernel)
    A, b = ops.a, ops.ones(k)
    for it in range(iters):
        a = 1.0 / ops.floor(A @ b)  # the row step: every row now holds 1
        col = ops.floor(a @ A)  # [K] column masses over b
        converged = float(abs(ops.log(b * col) - math.log(c)).max()) < tol
        b = c / col  # the column step
        if converged or it + 1 == iters:
            break
        if float(abs(ops.log(b)).max()) > ABSORB_AT or float(abs(ops.log(a)).max()) > ABSORB_AT:
            v_a = v_a + ops.tensor(ops.log(b))
            u_a = _kernel_(cost, epsilon, v_a, kernel)
            b = ops.ones(k)
    return u_a + ops.tensor(ops.log(a)) - math.log(n), v_a + ops.tensor(ops.log(b))


class _NumpyOps:
    """The scaling loop's few operations on numpy views of CPU tensors."""

    def __init__(self, kernel: torch.Tensor) -> None:
        self.a = kernel.numpy()

    @staticmethod
    def ones(k: int):
        return np.ones(k, dtype=np.float32)

    @staticmethod
    def floor(x):
        return np.maximum(x, np.float32(TINY), out=x)

    log = staticmethod(np.log)
    tensor = staticmethod(torch.from_numpy)


class _TorchOps:
    """The same operations in torch (a CUDA kernel)."""

    def __init__(self, kernel: torch.Tensor) -> None:
        self.a, self._device = kernel, kernel.device

    def ones(self, k: int):
        return torch.ones(k, dtype=torch.float32, device=self._device)

    @staticmethod
    def floor(x):
        return x.clamp_(min=TINY)

    log = staticmethod(torch.log)

    @staticmethod
    def tensor(x):
        return x
