"""Tests of gti.sid.kmeans."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gti.sid.kmeans as km
from gti.sid.kmeans import fixed_threads, kmeans, kmeans_plus_plus, nearest


def test_seeds_are_data_points(clusters):
    x, _ = clusters(300, 8, 5)
    c = kmeans_plus_plus(x, 10, torch.Generator().manual_seed(0))
    assert (c[:, None, :] == x[None, :, :]).all(-1).any(1).all()


def test_finds_the_true_clusters(clusters):
    x, lab = clusters(500, 6, 4, seed=1)
    res = kmeans(x, 4, iters=20, generator=torch.Generator().manual_seed(0))
    # Each found cluster is exactly one true cluster.
    for j in range(4):
        assert lab[res.assign == j].unique().numel() == 1
    assert res.inertia < 0.05**2 * 6 * 1.5


def test_deterministic_for_a_seed(clusters):
    x, _ = clusters(200, 4, 8)
    a = kmeans(x, 8, generator=torch.Generator().manual_seed(3)).centroids
    b = kmeans(x, 8, generator=torch.Generator().manual_seed(3)).centroids
    assert torch.equal(a, b)


def test_no_empty_clusters_and_fewer_points_than_k():
    x = torch.randn(100, 3)
    res = kmeans(x, 32, generator=torch.Generator().manual_seed(0))
    assert torch.bincount(res.assign, minlength=32).min() > 0
    small = torch.randn(5, 3)
    c = kmeans(small, 8, generator=torch.Generator().manual_seed(0)).centroids
    assert c.shape == (8, 3) and torch.isfinite(c).all()
    assert torch.unique(c, dim=0).shape[0] == 8  # no two identical codes


def _uneven_mixture(n: int = 2000, dim: int = 8, k: int = 16) -> torch.Tensor:
    """[n, dim]: k gaussian blobs whose weights fall off geometrically (0.8^j)."""
    g = torch.Generator().manual_seed(0)
    centers = 4 * torch.randn(k, dim, generator=g)
    w = 0.8 ** torch.arange(float(k))
    comp = torch.multinomial(w / w.sum(), n, replacement=True, generator=g)
    return centers[comp] + torch.randn(n, dim, generator=g)


def test_balanced_option_flattens_sizes():
    x = _uneven_mixture()
    plain = torch.bincount(kmeans(x, 16, generator=torch.Generator().manual_seed(0)).assign, minlength=16)
    bal = torch.bincount(kmeans(x, 16, generator=torch.Generator().manual_seed(0), balanced=True,
                                sinkhorn_epsilon=0.05, sinkhorn_iters=50).assign, minlength=16)
    assert plain.max() > 250 and plain.float().std() > 60  # ~125 per code when balanced
    assert bal.max() <= 160 and bal.min() >= 80 and bal.float().std() < plain.float().std() / 4


def test_balanced_kmeans_stops_on_its_tolerance():
    """Lloyd steps stop once inertia stops falling (then the fixed balanced steps follow): on
    separated blobs that is well before the cap, and a lower cap is obeyed."""
    x = _uneven_mixture(k=8, dim=16)
    free = kmeans(x, 8, iters=200, generator=torch.Generator().manual_seed(0), balanced=True, sinkhorn_epsilon=0.05)
    assert free.iters - km.BALANCE_STEPS < 50
    capped = kmeans(x, 8, iters=1, generator=torch.Generator().manual_seed(0), balanced=True, sinkhorn_epsilon=0.05)
    assert capped.iters == 1 + km.BALANCE_STEPS


def test_balanced_kmeans_same_codes_with_one_or_two_threads():
    x = _uneven_mixture(n=3000)
    out = []
    for n in (1, 2):
        with fixed_threads(n):
            out.append(kmeans(x, 16, generator=torch.Generator().manual_seed(3), balanced=True,
                              sinkhorn_epsilon=0.05).assign)
    assert torch.equal(out[0], out[1])


def test_nearest_chunks_agree():
    x, c = torch.randn(1000, 5), torch.randn(7, 5)
    a, da = nearest(x, c, chunk=64)
    assert torch.equal(a, torch.cdist(x, c).argmin(1))
    assert torch.allclose(da, torch.cdist(x, c).min(1).values ** 2, atol=1e-4)


def test_iterates_while_inertia_falls():
    """Lloyd's algorithm must not stop after its first step while the inertia still falls
    (it did: the convergence test compared with prev = inf). Each run with `iters=n` is the
    same trajectory cut at n, so inertia is non-increasing in n and must fall after step 1."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 8, generator=g)
    runs = {n: kmeans(x, 16, iters=n, generator=torch.Generator().manual_seed(0)) for n in (1, 2, 5, 50)}
    assert runs[1].iters == 1
    assert runs[5].iters == 5  # unstructured data: 5 steps are not enough to converge
    assert 5 < runs[50].iters < 50  # converged on its own, and said so
    inertias = [runs[n].inertia for n in (1, 2, 5, 50)]
    assert all(b <= a + 1e-7 for a, b in zip(inertias, inertias[1:]))
    assert inertias[-1] < 0.97 * inertias[0]


def test_chunked_biased_nearest_is_the_whole_product_argmin():
    g = torch.Generator().manual_seed(1)
    x, c, b = torch.randn(1000, 5, generator=g), torch.randn(7, 5, generator=g), torch.randn(7, generator=g)
    idx, val = km._nearest_biased(x, c, b, chunk=64)
    whole = b.unsqueeze(0) - 2 * x @ c.T
    assert torch.equal(idx, whole.argmin(1))
    torch.testing.assert_close(val, whole.min(1).values)


def test_balanced_kmeans_with_prices_from_a_row_sample(monkeypatch):
    """More rows than PRICE_SAMPLE: the prices are learned on the sample and every row is
    assigned with them (the chunked priced product), and the sizes still flatten."""
    monkeypatch.setattr(km, "PRICE_SAMPLE", 500)
    monkeypatch.setattr(km, "ASSIGN_CHUNK", 128)
    x = _uneven_mixture()
    bal = torch.bincount(kmeans(x, 16, generator=torch.Generator().manual_seed(0), balanced=True,
                                sinkhorn_epsilon=0.05).assign, minlength=16)
    # A 500-row sample prices the 2,000 rows a little less evenly than all of them do (<= 160).
    assert bal.max() <= 180 and bal.min() >= 80 and bal.float().std() < 30  # plain k-means: std > 60


def test_balanced_kmeans_leaves_denormals_as_they_were():
    """The fit flushes denormals while it runs (the scaling-domain Sinkhorn) and not after."""
    kmeans(_uneven_mixture(n=300), 4, generator=torch.Generator().manual_seed(0), balanced=True)
    assert torch.tensor(1e-40).item() != 0.0


def test_row_argmin_is_torch_argmin():
    """numpy's argmin gives torch.argmin's index everywhere: ties (the first one), NaN rows,
    float64, a tensor that requires grad, and bf16 (which takes torch's own path)."""
    g = torch.Generator().manual_seed(0)
    m = torch.randint(0, 4, (500, 37), generator=g).float()  # many ties
    m[7, 5] = float("nan")
    for t in (m, m.double(), torch.randn(300, 256, generator=g), m.clone().requires_grad_(True)):
        assert torch.equal(km.row_argmin(t), t.argmin(dim=1))
    b = torch.randn(50, 9, generator=g).bfloat16()
    assert torch.equal(km.row_argmin(b), b.argmin(dim=1))
    idx, val = km.row_min(m[:5])
    assert torch.equal(val, m[:5].min(1).values) and torch.equal(idx, m[:5].argmin(1))


def test_lloyd_matches_faiss_from_the_same_seeds():
    """Our plain k-means against faiss.Kmeans (what MiniOneRec / OpenOneRec build RQ-KMeans
    on), both from the same k-means++ seeds and for the same number of Lloyd steps: the same
    centroids to float32 rounding and the same codes, on unstructured data where k-means
    amplifies any near-tie it decides differently."""
    import faiss

    x = torch.randn(4000, 16, generator=torch.Generator().manual_seed(0))
    for k, iters in ((16, 10), (64, 25)):
        ours = kmeans(x, k, iters=iters, generator=torch.Generator().manual_seed(1), tol=0.0)
        seeds = kmeans_plus_plus(x, k, torch.Generator().manual_seed(1))
        ref = faiss.Kmeans(16, k, niter=ours.iters, seed=1, max_points_per_centroid=1 << 20)
        ref.train(x.numpy(), init_centroids=seeds.numpy())
        assert ours.iters > 5
        assert np.abs(ref.centroids - ours.centroids.numpy()).max() < 1e-5
        assert np.array_equal(ref.index.search(x.numpy(), 1)[1][:, 0], ours.assign.numpy())


def test_nearest_codes_match_faiss_where_exact():
    """`nearest` (every SID assignment) against faiss's exact IndexFlatL2: the same code for
    every row whose best and second-best distances are apart by more than float32 rounding."""
    import faiss

    g = torch.Generator().manual_seed(2)
    x, c = torch.randn(5000, 32, generator=g), torch.randn(256, 32, generator=g)
    idx, dist = nearest(x, c, chunk=1024)
    index = faiss.IndexFlatL2(32)
    index.add(c.numpy())
    d2, i2 = index.search(x.numpy(), 2)
    clear = (d2[:, 1] - d2[:, 0]) > 1e-4 * d2[:, 0]
    assert clear.mean() > 0.99
    assert np.array_equal(i2[clear, 0], idx.numpy()[clear])
    assert np.allclose(d2[:, 0], dist.numpy(), rtol=1e-4, atol=1e-4)


def test_nearest_gives_the_same_floats_in_any_chunk():
    """`nearest` works a cache-sized chunk of rows at a time; each row's arithmetic does not
    depend on the chunk, so neither do the codes and distances, nor any SID map built on them."""
    g = torch.Generator().manual_seed(4)
    x, c = torch.randn(5000, 48, generator=g), torch.randn(64, 48, generator=g)
    a, d = nearest(x, c, chunk=5000)
    for chunk in (13, 1024, 2048):
        a2, d2 = nearest(x, c, chunk=chunk)
        assert torch.equal(a, a2) and torch.equal(d, d2)


def test_kmeans_plus_plus_spreads_seeds_from_its_candidates():
    """Seeds come from KPP_CANDIDATES_PER_CODE * k random rows (not all N), and are still spread:
    one per blob on well-separated blobs, where random rows would double up."""
    g = torch.Generator().manual_seed(0)
    centres = 20 * torch.randn(8, 6, generator=g)
    lab = torch.arange(8).repeat_interleave(1000)
    x = centres[lab] + torch.randn(8000, 6, generator=g)
    seeds = kmeans_plus_plus(x, 8, torch.Generator().manual_seed(1), candidates=32)
    rows = (seeds[:, None, :] == x[None, :, :]).all(-1).float().argmax(1)
    assert (seeds == x[rows]).all()  # data points
    assert lab[rows].unique().numel() == 8  # one per blob
    # The candidates are a seeded sample: another seed, other rows; the same seed, the same rows.
    again = kmeans_plus_plus(x, 8, torch.Generator().manual_seed(1), candidates=32)
    other = kmeans_plus_plus(x, 8, torch.Generator().manual_seed(2), candidates=32)
    assert torch.equal(seeds, again) and not torch.equal(seeds, other)


def test_kmeans_plus_plus_does_not_draw_a_copy_twice():
    """On 5 distinct points (each 100 times) and k = 8, the first 5 seeds are the 5 points and
    the other 3 are noisy copies: rounding leaves |x|^2 - 2 x.c + |c|^2 a little above 0 for a
    copy of a seed, which must not make it drawable again."""
    pts = torch.randn(5, 16, generator=torch.Generator().manual_seed(0)) * 3 + 1
    x = pts.repeat(100, 1)
    for s in range(5):
        seeds = kmeans_plus_plus(x, 8, torch.Generator().manual_seed(s), candidates=500)
        assert torch.unique(seeds[:5], dim=0).shape[0] == 5
        assert torch.unique(seeds, dim=0).shape[0] == 8


@pytest.mark.parametrize("n,k", [(40, 8), (1000, 32), (3000, 16), (70000, 16)])
def test_one_seeding_algorithm_at_every_size(n, k):
    """No size threshold picks the algorithm (issue 50): at 320 to 1.1M row-code pairs (below
    and above the 2^20 where two algorithms used to meet) the default seeding is the candidate
    k-means++ over KPP_CANDIDATES_PER_CODE * k random rows, and the seeds are data points."""
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(n))
    seeds = kmeans_plus_plus(x, k, torch.Generator().manual_seed(0))
    explicit = kmeans_plus_plus(x, k, torch.Generator().manual_seed(0), candidates=km.KPP_CANDIDATES_PER_CODE * k)
    assert torch.equal(seeds, explicit)
    rows = (seeds[:, None, :] == x[None, :, :]).all(-1).float().argmax(1)
    assert torch.equal(seeds, x[rows])
