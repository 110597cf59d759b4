"""k-means in plain torch: k-means++ seeding, Lloyd iterations, optional balanced assignment.

What it is for: initialising each RQ-VAE codebook on real residuals (a codebook started from
noise collapses onto a few codes), and the residual k-means quantiser (`sid.method: rqkmeans`).
Distances are computed in chunks so that N x K never has to fit in memory at once.

What it does not know: which level or residual it is clustering, training, Ray. Randomness comes
only from the `torch.Generator` passed in, so the same seed gives the same centroids on every
worker.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from gti.sid.balance import sinkhorn_assign


@contextlib.contextmanager
def fixed_threads(n: int):
    """torch's intra-op threads set to n inside the block: reductions (and so near-tie
    assignments, which k-means then amplifies) must not depend on the machine's cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sq_dists(x: torch.Tensor, c: torch.Tensor, c_sq: torch.Tensor | None = None) -> torch.Tensor:
    """Squared euclidean distances [N, K] between rows of x [N, D] and c [K, D]."""
    if c_sq is None:
        c_sq = (c * c).sum(1)
    d = (x * x).sum(1, keepdim=True) - 2.0 * (x @ c.T) + c_sq.unsqueeze(0)
    return d.clamp_(min=0.0)


def nearest(x: torch.Tensor, c: torch.Tensor, chunk: int = 65536) -> tuple[torch.Tensor, torch.Tensor]:
    """Index [N] of the nearest row of c [K, D] for each row of x [N, D], and its squared distance [N]."""
    c_sq = (c * c).sum(1)
    idx = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    dist = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    for s in range(0, x.shape[0], chunk):
        d = sq_dists(x[s : s + chunk], c, c_sq)
        m = d.min(dim=1)
        idx[s : s + chunk], dist[s : s + chunk] = m.indices, m.values
    return idx, dist


def kmeans_plus_plus(x: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """k-means++ seeds [k, D] drawn from the rows of x [N, D].

    With fewer distinct points than k, the remaining seeds are copies of data points plus
    noise at 1e-3 of the data scale, so that no two codes start identical.
    """
    n, dim = x.shape
    if n == 0:
        raise ValueError("k-means on an empty set")
    centers = torch.empty(k, dim, dtype=x.dtype, device=x.device)
    first = int(torch.randint(n, (1,), generator=generator, device="cpu"))
    centers[0] = x[first]
    closest = ((x - centers[0]) ** 2).sum(1)
    filled = 1
    for i in range(1, k):
        total = float(closest.sum())
        if total <= 0.0:
            break  # every point already coincides with a centre
        j = int(torch.multinomial(closest.double().cpu(), 1, generator=generator))
        centers[i] = x[j]
        closest = torch.minimum(closest, ((x - centers[i]) ** 2).sum(1))
        filled = i + 1
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
    """Lloyd's k-means on x [N, D] (float32) with k-means++ seeding.

    Empty clusters are re-seeded from the points farthest from their centroid (so all k codes
    stay in use while N >= k). With `balanced`, each assignment step is a Sinkhorn-balanced
    assignment (clusters of roughly N/k points) instead of nearest-centroid.
    """
    x = x.float()
    n = x.shape[0]
    c = kmeans_plus_plus(x, k, generator)
    assign = torch.zeros(n, dtype=torch.long, device=x.device)
    prev = float("inf")
    it = 0
    for it in range(1, iters + 1):
        if balanced:
            assign = sinkhorn_assign(sq_dists(x, c), sinkhorn_epsilon, sinkhorn_iters)
            dist = ((x - c[assign]) ** 2).sum(1)
        else:
            assign, dist = nearest(x, c)
        counts = torch.bincount(assign, minlength=k)
        sums = torch.zeros_like(c).index_add_(0, assign, x)
        new_c = torch.where(counts.unsqueeze(1) > 0, sums / counts.clamp(min=1).unsqueeze(1), c)
        empty = (counts == 0).nonzero().flatten()
        if empty.numel() and n >= k:
            # Re-seed each empty cluster with one of the worst-served points.
            far = torch.topk(dist, min(int(empty.numel()), n)).indices
            new_c[empty[: far.numel()]] = x[far]
        c = new_c
        inertia = float(dist.mean())
        # Converged when inertia stopped falling. There is nothing to compare with on the first
        # iteration: `inf - x <= tol * inf` holds, so without the `it > 1` Lloyd's algorithm
        # stopped after one step.
        if it > 1 and empty.numel() == 0 and prev - inertia <= tol * max(prev, 1e-12):
            break
        prev = inertia
    if balanced:
        assign = sinkhorn_assign(sq_dists(x, c), sinkhorn_epsilon, sinkhorn_iters)
        dist = ((x - c[assign]) ** 2).sum(1)
    else:
        assign, dist = nearest(x, c)
    return KMeansResult(centroids=c, assign=assign, inertia=float(dist.mean()), iters=it)
