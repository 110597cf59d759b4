"""k-means in plain torch: k-means++ seeding, Lloyd iterations, optional balanced assignment.

What it is for: initialising each RQ-VAE codebook on real residuals (a codebook started from
noise collapses onto a few codes), and the residual k-means quantiser (`sid.method: rqkmeans`).
Distances are computed in chunks so that N x K never has to fit in memory at once.
`balanced_kmeans` ends plain Lloyd steps with a few balanced ones (bench/sid/RESULTS.md,
"Balanced k-means at faiss speed").

What it does not know: which level or residual it is clustering, training, Ray. Randomness comes
only from the `torch.Generator` passed in, so the same seed gives the same centroids on every
worker.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from gti.sid.balance import flushed_denormals, sinkhorn_potentials_scaled


@contextlib.contextmanager
def fixed_threads(n: int):
    """torch's intra-op threads, and numpy's BLAS threads, set to n inside the block:
    reductions (and so near-tie assignments, which k-means then amplifies) must not depend on
    the machine's cores."""
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with threadpool_limits(limits=n, user_api="blas"):
            yield
    finally:
        torch.set_num_threads(before)


def sq_dists(x: torch.Tensor, c: torch.Tensor, c_sq: torch.Tensor | None = None) -> torch.Tensor:
    """Squared euclidean distances [N, K] between rows of x [N, D] and c [K, D]."""
    if c_sq is None:
        c_sq = (c * c).sum(1)
    d = (x * x).sum(1, keepdim=True) - 2.0 * (x @ c.T) + c_sq.unsqueeze(0)
    return d.clamp_(min=0.0)


def row_argmin(m: torch.Tensor) -> torch.Tensor:
    """LongTensor [N]: the first index of each row's minimum of m [N, K], as torch.argmin gives
    it. On CPU float32 / float64 numpy's SIMD argmin finds it (several times faster than
    torch's row argmin: bench/sid/RESULTS.md, "Balanced k-means with a scaling-domain
    Sinkhorn"); elsewhere torch's."""
    if m.device.type != "cpu" or m.dtype not in (torch.float32, torch.float64):
        return m.argmin(dim=1)
    return torch.from_numpy(m.detach().numpy().argmin(1))


def row_min(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [N], value [N]) of each row's first minimum of m [N, K]."""
    idx = row_argmin(m)
    return idx, m.gather(1, idx.unsqueeze(1)).squeeze(1)


# k-means++ draws its seeds from at most KPP_CANDIDATES_PER_CODE * k rows, chosen at random: its
# k sequential passes then cost the same on a small catalog as on the whole sample, where over
# every row they took as long as all the Lloyd steps (bench/sid/RESULTS.md, "Plain k-means at
# faiss speed": no measurable change in reconstruction). faiss seeds from k random rows;
# k-means++ over 4k of them still spreads the seeds out.
KPP_CANDIDATES_PER_CODE = 4


def nearest(x: torch.Tensor, c: torch.Tensor, x_sq: torch.Tensor | None = None,
            chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Index [N] of the nearest row of c [K, D] for each row of x [N, D], and its squared
    distance [N]. The argmin is taken before |x_i|^2 (`x_sq` [N], computed if not given) is
    added: it does not change a row's order, and leaving it out saves a pass over [N, K]."""
    if x_sq is None:
        x_sq = (x * x).sum(1)
    idx, val = _nearest_biased(x, c, (c * c).sum(1), chunk or ASSIGN_CHUNK)
    return idx, val.add_(x_sq).clamp_(min=0.0)


def kmeans_plus_plus(x: torch.Tensor, k: int, generator: torch.Generator | None = None,
                     candidates: int | None = None) -> torch.Tensor:
    """k-means++ seeds [k, D] drawn from `candidates` (default KPP_CANDIDATES_PER_CODE * k)
    rows of x [N, D] chosen at random, or from every row when there are no more than that: one
    algorithm for every catalog size.

    Each seed is drawn with probability proportional to its squared distance to the nearest
    seed so far (|x|^2 - 2 x.c + |c|^2, then the cumulative sum searched at one uniform draw).
    With fewer distinct candidates than k, the remaining seeds are copies of data points plus
    noise at 1e-3 of the data scale, so that no two codes start identical.
    """
    n, dim = x.shape
    if n == 0:
        raise ValueError("k-means on an empty set")
    m = KPP_CANDIDATES_PER_CODE * k if candidates is None else candidates
    cand = x if n <= m else x[torch.randperm(n, generator=generator, device="cpu")[:m].to(x.device)]
    nc = cand.shape[0]
    c_sq = (cand * cand).sum(1)
    draws = torch.rand(k, generator=generator, dtype=torch.float64, device="cpu")
    centers = torch.empty(k, dim, dtype=x.dtype, device=x.device)
    chosen = int(draws[0] * nc)
    centers[0] = cand[chosen]
    closest = torch.full((nc,), float("inf"), dtype=x.dtype, device=x.device)
    filled = 0
    for i in range(k):
        if i:
            cum = closest.cumsum(0, dtype=torch.float64)
            total = float(cum[-1])
            if total <= 0.0:
                break  # every candidate already coincides with a seed
            chosen = min(int(torch.searchsorted(cum, draws[i : i + 1].to(cum.device) * total, right=True)), nc - 1)
            centers[i] = cand[chosen]
        d = torch.addmv(c_sq, cand, centers[i], alpha=-2.0)
        d.add_(c_sq[chosen]).clamp_(min=0.0)
        # Rounding leaves a point's distance to its own copy a little above 0; below 1e-5 of
        # |x|^2 + |c|^2 it is a copy, and must not be drawn again.
        d[d <= 1e-5 * (c_sq + c_sq[chosen])] = 0.0
        closest = torch.minimum(closest, d)
        filled = i + 1
    return _pad_seeds(x, centers, filled, generator)


def _pad_seeds(x: torch.Tensor, centers: torch.Tensor, filled: int,
               generator: torch.Generator | None) -> torch.Tensor:
    """centers [k, D] with rows filled.. set to random rows of x [N, D] plus noise at 1e-3 of
    the data scale (fewer distinct points than k: no two codes start identical)."""
    k, dim = centers.shape
    n = x.shape[0]
    if filled < k:
        scale = float(x.std()) if n > 1 else 1.0
        scale = scale if scale > 0 else 1.0
        pick = torch.randint(n, (k - filled,), generator=generator, device="cpu").to(x.device)
        noise = torch.randn(k - filled, dim, generator=generator, device="cpu").to(x.device, x.dtype)
        centers[filled:] = x[pick] + 1e-3 * scale * noise
    return centers


@dataclass
class KMeansResult:
    centroids: torch.Tensor  # [K, D]
    assign: torch.Tensor  # [N] long
    inertia: float  # mean squared distance of a point to its centroid
    iters: int


def kmeans(
    x: torch.Tensor,
    k: int,
    iters: int = 25,
    generator: torch.Generator | None = None,
    balanced: bool = False,
    sinkhorn_epsilon: float = 0.003,
    sinkhorn_iters: int = 50,
    tol: float = 1e-6,
) -> KMeansResult:
    """Lloyd's k-means on x [N, D] (float32) with k-means++ seeding (`kmeans_plus_plus`).

    Empty clusters are re-seeded from the points farthest from their centroid (so all k codes
    stay in use while N >= k). With `balanced`, `balanced_kmeans` (clusters of roughly N/k
    points; its own stopping tolerance, `tol` is the plain path's).
    """
    if balanced:
        return balanced_kmeans(x, k, iters, generator, sinkhorn_epsilon, sinkhorn_iters)
    x = x.float().contiguous()
    x_sq = (x * x).sum(1)
    near = lambda c: nearest(x, c, x_sq)  # noqa: E731
    c = kmeans_plus_plus(x, k, generator)
    prev = float("inf")
    it = 0
    for it in range(1, iters + 1):
        assign, dist = near(c)
        c, n_empty = _lloyd_update(x, assign, dist, c)
        inertia = float(dist.mean())
        # Converged when inertia stopped falling. There is nothing to compare with on the first
        # iteration: `inf - x <= tol * inf` holds, so without the `it > 1` Lloyd's algorithm
        # stopped after one step.
        if it > 1 and n_empty == 0 and prev - inertia <= tol * max(prev, 1e-12):
            break
        prev = inertia
    assign, dist = near(c)
    return KMeansResult(centroids=c, assign=assign, inertia=float(dist.mean()), iters=it)


def _lloyd_update(x: torch.Tensor, assign: torch.Tensor, dist: torch.Tensor,
                  c: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Centroids [K, D] = the means of their points x [N, D] under `assign` [N]; an empty
    cluster keeps its centroid, or (N >= K) is re-seeded with one of the points farthest from
    theirs (`dist` [N]). -> (centroids, number of empty clusters)."""
    k, n = c.shape[0], x.shape[0]
    counts = torch.bincount(assign, minlength=k)
    sums = torch.zeros_like(c).index_add_(0, assign, x)
    new_c = torch.where(counts.unsqueeze(1) > 0, sums / counts.clamp(min=1).unsqueeze(1), c)
    empty = (counts == 0).nonzero().flatten()
    if empty.numel() and n >= k:
        # Re-seed each empty cluster with one of the worst-served points.
        far = torch.topk(dist, min(int(empty.numel()), n)).indices
        new_c[empty[: far.numel()]] = x[far]
    return new_c, int(empty.numel())


# Balanced k-means. The Lloyd steps stop once inertia falls by less than BALANCED_TOL
# (relative); then BALANCE_STEPS balanced steps, whose Sinkhorn runs at most
# BALANCE_SINKHORN_ITERS iterations (warm-started: the prices move little between steps) or
# until the column masses are within SINKHORN_TOL of uniform, on PRICE_SAMPLE evenly spaced
# rows; the final assignment gets the config's `sinkhorn_iters`. Chosen on the bundled catalog
# and the 1M synthetic set (bench/sid/RESULTS.md, "Balanced k-means at faiss speed"). The Sinkhorn
# runs in the scaling domain (two matrix-vector products per iteration, not two log-sum-exps:
# bench/sid/RESULTS.md, "Balanced k-means with a scaling-domain Sinkhorn").
BALANCED_TOL = 1e-4
BALANCE_STEPS = 8
BALANCE_SINKHORN_ITERS = 10
SINKHORN_TOL = 1e-2
PRICE_SAMPLE = 16384
# Rows per product in the full assignments: the [chunk, K] block is still in cache for the
# argmin that follows (faster than one [N, K] product, then its argmin).
ASSIGN_CHUNK = 1024


def _nearest_biased(x: torch.Tensor, c: torch.Tensor, bias: torch.Tensor,
                    chunk: int = ASSIGN_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """argmin_j (bias_j - 2 x_i.c_j) for x [N, D], c [K, D], bias [K], in row chunks.
    -> (index [N], the minimum [N]). With bias = |c|^2 the minimum plus |x_i|^2 is the squared
    distance to the nearest code; with prices subtracted from it, the priced assignment."""
    n, k = x.shape[0], c.shape[0]
    idx = torch.empty(n, dtype=torch.long, device=x.device)
    val = torch.empty(n, dtype=x.dtype, device=x.device)
    buf = torch.empty(min(chunk, n), k, dtype=x.dtype, device=x.device)
    c_t, b = c.T, bias.unsqueeze(0)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        idx[s:e], val[s:e] = row_min(torch.addmm(b, x[s:e], c_t, alpha=-2.0, out=buf[: e - s]))
    return idx, val


def _random_seeds(x: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """k distinct rows of x [N, D] (as faiss seeds); k-means++ when N < k (it pads)."""
    if x.shape[0] < k:
        return kmeans_plus_plus(x, k, generator)
    return x[torch.randperm(x.shape[0], generator=generator, device="cpu")[:k].to(x.device)].clone()


def _priced_step(x: torch.Tensor, x_sq: torch.Tensor, c: torch.Tensor, rows: torch.Tensor | None,
                 v: torch.Tensor | None, scale: float | None, epsilon: float, iters: int):
    """One balanced assignment of x [N, D] to c [K, D]: Sinkhorn prices v [K] on the sample
    `rows` (None: every row; warm-started from `v`; `scale` fixed at the first step), then every
    row's priced argmax. -> (assign [N], squared distance to the assigned centroid [N], v, scale).

    The priced argmax, argmax_j(v_j - (d_ij - min_j d_ij) / (scale * epsilon)), is the argmin
    of c_sq_j - 2 x_i.c_j - scale * epsilon * v_j: the row's own terms (its minimum and |x_i|^2)
    do not change it. When the sample is every row, its product is reused for the assignment;
    otherwise one chunked product with the prices in its bias assigns all rows."""
    c_sq = (c * c).sum(1)
    g = torch.addmm(c_sq.unsqueeze(0), x if rows is None else x[rows], c.T, alpha=-2.0)  # [S, K]
    shifted = g - g.amin(1, keepdim=True)
    if scale is None:
        scale = float(shifted.median().clamp(min=1e-12))
    # cost / epsilon with cost = shifted / scale, as gti.sid.balance.normalise_cost scales it
    _, v = sinkhorn_potentials_scaled(shifted, scale * epsilon, iters, tol=SINKHORN_TOL, v0=v)
    price = scale * epsilon * v
    if rows is None:
        assign, dist = row_min(g.sub_(price.unsqueeze(0)))
    else:
        assign, dist = _nearest_biased(x, c, c_sq - price)
    dist = dist.add_(price[assign]).add_(x_sq).clamp_(min=0.0)
    return assign, dist, v, scale


def balanced_kmeans(x: torch.Tensor, k: int, iters: int = 25, generator: torch.Generator | None = None,
                    epsilon: float = 0.003, sinkhorn_iters: int = 50) -> KMeansResult:
    """k-means on x [N, D] whose clusters hold about N/k points each (see the constants above).

    Plain Lloyd steps from k random rows (at most `iters` - BALANCE_STEPS), then the balanced
    Lloyd steps: the assignment is argmax_j(v_j - cost_ij / (scale * epsilon)), cost the squared distances
    shifted to 0 per row, scale their median on the price sample, v the Sinkhorn column
    potentials (`gti.sid.balance`) of the sample, learned on a fixed row sample and warm-started
    from the step before. `iters` of the result counts both kinds. As fast as faiss's plain
    k-means at equal iterations, with lower reconstruction error and fewer SID collisions than
    25 fully balanced steps.
    """
    x = x.float().contiguous()
    n = x.shape[0]
    x_sq = (x * x).sum(1)
    c = _random_seeds(x, k, generator)
    prev, it = float("inf"), 0
    # The balanced steps are part of the `iters` budget (faiss's niter counts every step).
    for it in range(1, max(1, iters - BALANCE_STEPS) + 1):
        assign, dist = nearest(x, c, x_sq)
        c, n_empty = _lloyd_update(x, assign, dist, c)
        inertia = float(dist.double().mean())
        if it > 1 and n_empty == 0 and prev - inertia <= BALANCED_TOL * max(prev, 1e-12):
            break
        prev = inertia
    rows = torch.arange(0, n, max(1, n // PRICE_SAMPLE), device=x.device)[:PRICE_SAMPLE]
    rows = None if rows.numel() == n else rows
    v, scale = None, None
    with flushed_denormals():
        for _ in range(BALANCE_STEPS):
            assign, dist, v, scale = _priced_step(x, x_sq, c, rows, v, scale, epsilon, BALANCE_SINKHORN_ITERS)
            c, _ = _lloyd_update(x, assign, dist, c)
            it += 1
        assign, dist, _, _ = _priced_step(x, x_sq, c, rows, v, scale, epsilon, sinkhorn_iters)
    return KMeansResult(centroids=c, assign=assign, inertia=float(dist.mean()), iters=it)
