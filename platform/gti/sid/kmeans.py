"""k-means for SID codebooks: k-means++ seeding, Lloyd iterations on faiss, optional balanced
(Sinkhorn) assignment.

What it is for: initialising each RQ-VAE codebook on real residuals (a codebook started from
noise collapses onto a few codes), and the residual k-means quantiser (`sid.method: rqkmeans`).
The nearest-code searches of each Lloyd step run on faiss (`IndexFlatL2`, the library
MiniOneRec and OpenOneRec build RQ-KMeans on); centroid updates, empty-cluster re-seeding and the
balanced assignment (Sinkhorn prices over each point's `candidates` nearest codes, warm-started
from the previous iteration, stopped on a tolerance) are ours. Lloyd stops once the inertia
falls by no more than `tol` (relative) in one step.

Reproducibility: randomness comes only from the `torch.Generator` passed in; sums that decide
anything are taken in float64 by numpy (fixed order); faiss's distances depend on its thread
count in the last bit, so callers that need the same codes on every machine run the fit inside
`fixed_threads(n)` (the `sid` stage does, with `sid.fit_threads`).

What it does not know: which level or residual it is clustering, training, Ray.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import faiss
import numpy as np
import torch

from gti.sid.balance import candidate_sinkhorn

# Codes each point may be assigned to in a balanced step (its nearest ones). Sinkhorn prices
# move a point by a fraction of the median code gap; the 33rd nearest of 256 codes is far past
# that, and 32 candidates make a step 8x cheaper than all 256.
BALANCE_CANDIDATES = 32
# Rows whose distances set the cost scale of a balanced step (a fixed, evenly spaced subset:
# the median of 1M distances is as good as that of 16M, at 1/16 of the cost).
SCALE_ROWS = 4096


@contextlib.contextmanager
def fixed_threads(n: int):
    """torch intra-op threads and faiss's OpenMP threads both set to n inside the block."""
    before_t, before_f = torch.get_num_threads(), faiss.omp_get_max_threads()
    torch.set_num_threads(n)
    faiss.omp_set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before_t)
        faiss.omp_set_num_threads(before_f)


def sq_dists(x: torch.Tensor, c: torch.Tensor, c_sq: torch.Tensor | None = None) -> torch.Tensor:
    """Squared euclidean distances [N, K] between rows of x [N, D] and c [K, D]."""
    if c_sq is None:
        c_sq = (c * c).sum(1)
    d = (x * x).sum(1, keepdim=True) - 2.0 * (x @ c.T) + c_sq.unsqueeze(0)
    return d.clamp_(min=0.0)


def nearest(x: torch.Tensor, c: torch.Tensor, chunk: int = 65536) -> tuple[torch.Tensor, torch.Tensor]:
    """Index [N] of the nearest row of c [K, D] for each row of x [N, D], and its squared distance [N].

    The torch path (any device, no faiss); `faiss_nearest` gives the same indices on CPU."""
    c_sq = (c * c).sum(1)
    idx = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    dist = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    for s in range(0, x.shape[0], chunk):
        d = sq_dists(x[s : s + chunk], c, c_sq)
        m = d.min(dim=1)
        idx[s : s + chunk], dist[s : s + chunk] = m.indices, m.values
    return idx, dist


def faiss_nearest(x: torch.Tensor, c: torch.Tensor, m: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The m nearest rows of c [K, D] for each row of x [N, D], nearest first, by faiss's exact
    L2 search: (indices LongTensor[N, m], squared distances float32 [N, m]), on x's device."""
    index = faiss.IndexFlatL2(c.shape[1])
    index.add(np.ascontiguousarray(c.detach().cpu().numpy(), dtype=np.float32))
    dist, idx = index.search(np.ascontiguousarray(x.detach().cpu().numpy(), dtype=np.float32), m)
    return torch.from_numpy(idx).to(x.device), torch.from_numpy(dist).to(x.device)


def kmeans_plus_plus(x: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """k-means++ seeds [k, D] drawn from the rows of x [N, D].

    With fewer distinct points than k, the remaining seeds are copies of data points plus
    noise at 1e-3 of the data scale, so that no two codes start identical. Distances to a new
    seed are one matrix-vector product (|x|^2 - 2 x.c + |c|^2): one pass over x per seed.
    """
    n, dim = x.shape
    if n == 0:
        raise ValueError("k-means on an empty set")
    x_sq = (x * x).sum(1)
    # The expanded form leaves ~1e-7 relative rounding where a point equals a seed: distances
    # below this count as 0, so a duplicate of a seed is never drawn as another seed.
    tiny = 1e-6 * float(np.mean(x_sq.cpu().numpy(), dtype=np.float64))

    def d2(c: torch.Tensor) -> torch.Tensor:
        d = x_sq - 2.0 * (x @ c) + (c * c).sum()
        return d.masked_fill_(d <= tiny, 0.0)

    centers = torch.empty(k, dim, dtype=x.dtype, device=x.device)
    first = int(torch.randint(n, (1,), generator=generator, device="cpu"))
    centers[0] = x[first]
    closest = d2(centers[0])
    filled = 1
    for i in range(1, k):
        if not bool((closest > 0).any()):
            break  # every point already coincides with a centre
        j = int(torch.multinomial(closest.double().cpu(), 1, generator=generator))
        centers[i] = x[j]
        closest = torch.minimum(closest, d2(centers[i]))
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
    iters: int  # Lloyd iterations run (< the cap when the inertia stopped falling)
    inertias: list[float] = field(default_factory=list)  # after each iteration's assignment
    sinkhorn_steps: int = 0  # over all balanced assignments


class _Balancer:
    """Balanced assignment for one k-means run; keeps the Sinkhorn prices between calls (codes
    keep their identity from one Lloyd iteration to the next, so last iteration's prices are
    a close start: measured 14x faster than 50 cold steps per iteration, same inertia and
    cluster sizes; an epsilon schedule across iterations and clipped prices both did worse)."""

    def __init__(self, k: int, epsilon: float, iters: int, tol: float, candidates: int) -> None:
        self.k, self.epsilon, self.iters, self.tol = k, epsilon, iters, tol
        self.m = min(candidates, k)
        self.v: torch.Tensor | None = None  # [k] Sinkhorn column potentials
        self.steps = 0

    def __call__(self, x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(assign [N], squared distance to the assigned code [N]) for x [N, D], codes c [K, D]."""
        idx, dist = faiss_nearest(x, c, self.m)
        # The scale: median of row-shifted distances to all codes over evenly spaced rows.
        rows = x[:: max(1, x.shape[0] // SCALE_ROWS)]
        full = sq_dists(rows, c)
        scale = float((full - full.min(dim=1, keepdim=True).values).median().clamp(min=1e-12))
        logits = -(dist - dist[:, :1]) / (scale * self.epsilon)
        self.v, steps = candidate_sinkhorn(logits, idx, self.k, self.iters, self.tol, self.v)
        self.steps += steps
        # The candidate maximising the plan: nearest code under the prices v.
        pick = (logits + self.v[idx]).argmax(dim=1, keepdim=True)
        return idx.gather(1, pick).squeeze(1), dist.gather(1, pick).squeeze(1)


def _update(x: torch.Tensor, c: torch.Tensor, assign: torch.Tensor, dist: torch.Tensor) -> tuple[torch.Tensor, int]:
    """New centroids [K, D] (means of their points) and the number of empty clusters, each
    re-seeded with one of the worst-served points (so all k codes stay in use while N >= k)."""
    n, k = x.shape[0], c.shape[0]
    counts = torch.bincount(assign, minlength=k)
    sums = torch.zeros_like(c).index_add_(0, assign, x)
    new_c = torch.where(counts.unsqueeze(1) > 0, sums / counts.clamp(min=1).unsqueeze(1), c)
    empty = (counts == 0).nonzero().flatten()
    if empty.numel() and n >= k:
        far = torch.topk(dist, min(int(empty.numel()), n)).indices
        new_c[empty[: far.numel()]] = x[far]
    return new_c, int(empty.numel())


def kmeans(
    x: torch.Tensor,
    k: int,
    iters: int = 25,
    generator: torch.Generator | None = None,
    balanced: bool = False,
    sinkhorn_epsilon: float = 0.003,
    sinkhorn_iters: int = 50,
    tol: float = 1e-4,
    sinkhorn_tol: float = 1e-2,
    candidates: int = BALANCE_CANDIDATES,
) -> KMeansResult:
    """Lloyd's k-means on x [N, D] (float32) with k-means++ seeding; at most `iters` steps.

    Stops once an iteration lowers the inertia by no more than `tol` x the previous one (and
    left no cluster empty). With `balanced`, each assignment is Sinkhorn-balanced (clusters of
    about N/k points) over each point's `candidates` nearest codes, at most `sinkhorn_iters`
    steps per assignment, stopping when every code's mass is within `sinkhorn_tol` (log) of N/k.
    """
    x = x.float().contiguous()
    c = kmeans_plus_plus(x, k, generator)
    balancer = _Balancer(k, sinkhorn_epsilon, sinkhorn_iters, sinkhorn_tol, candidates) if balanced else None

    def assign_step(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        if balancer is not None:
            a, d = balancer(x, c)
        else:
            a, d = faiss_nearest(x, c)
            a, d = a[:, 0], d[:, 0]
        # numpy's float64 sum: the same value whatever the thread count.
        return a, d, float(np.sum(d.cpu().numpy(), dtype=np.float64)) / max(x.shape[0], 1)

    inertias: list[float] = []
    it = 0
    for it in range(1, iters + 1):
        assign, dist, inertia = assign_step(c)
        c, n_empty = _update(x, c, assign, dist)
        # No stop on the first iteration: there is nothing to compare with yet.
        if inertias and n_empty == 0 and inertias[-1] - inertia <= tol * max(inertias[-1], 1e-12):
            inertias.append(inertia)
            break
        inertias.append(inertia)
    assign, _, inertia = assign_step(c)
    return KMeansResult(centroids=c, assign=assign, inertia=inertia, iters=it, inertias=inertias,
                        sinkhorn_steps=balancer.steps if balancer else 0)
