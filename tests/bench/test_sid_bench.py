"""bench/sid/sid.py (bench): the k-means fit ratios of its last line, and our plain residual
k-means timed at exactly faiss's 25 Lloyd steps per level (no early stop that would flatter
ours)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("sid_bench", ROOT / "bench" / "sid" / "sid.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sid_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_plain_fit_runs_every_lloyd_step(monkeypatch):
    b = _bench()
    seen = []
    real = b.kmeans

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out.iters)
        return out

    monkeypatch.setattr(b, "kmeans", spy)
    monkeypatch.setattr(b, "K", 8)
    g = np.random.default_rng(0)
    x = (g.normal(size=(6, 16))[g.integers(6, size=400)] + 0.05 * g.normal(size=(400, 16))).astype(np.float32)
    books, secs = b.fit_plain(x, fit_n=300)
    assert seen == [25] * b.LEVELS  # separated blobs converge in a few steps; all 25 still run
    assert [tuple(c.shape) for c in books] == [(8, 16)] * b.LEVELS and secs > 0


def test_fit_ratios_sum_the_interleaved_rounds(monkeypatch):
    b = _bench()
    monkeypatch.setattr(b, "same_map_across_threads", lambda x: True)
    fits = {"ours": [2.0, 4.0], "faiss": [2.0, 2.0], "plain": [1.0, 1.0]}
    results = {"minilm": {"ours_rqkmeans": {}, "fit_rounds": fits},
               "synthetic": {"ours_rqkmeans": {}, "fit_rounds": {**fits, "ours": [1.0, 1.0]}}}
    out = b.kmeans_summary(results, {"minilm": (None, 0)})
    assert out == {"fit_over_faiss": 1.5, "synthetic_fit_over_faiss": 0.5, "plain_fit_over_faiss": 0.5,
                   "synthetic_plain_fit_over_faiss": 0.5, "same_map_across_threads": True}


def test_plain_row_encodes_every_item_with_its_own_codebooks(monkeypatch):
    """The `plain_rqkmeans` row: every item encoded level by level against the plain fit's
    codebooks, its reconstruction the sum of the codes' centroids (recon below the data's
    spread on separated blobs), and the bench's usual figures."""
    b = _bench()
    monkeypatch.setattr(b, "K", 8)
    g = np.random.default_rng(0)
    x = (5 * g.normal(size=(6, 16))[g.integers(6, size=400)] + 0.05 * g.normal(size=(400, 16))).astype(np.float32)
    f = b.plain_rqkmeans(x, fit_n=300)
    assert f["recon_mse"] < 0.05**2 and f["recon_mse"] < 1e-3 * float(np.var(x))
    assert len(f["utilisation"]) == b.LEVELS and f["utilisation"][0] >= 6 / 8
    assert 0.0 <= f["collision_rate"] < 1.0 and f["assign_items_per_s"] > 0


def test_plain_ab_loads_a_commits_kmeans_and_fits_both_sides():
    """`--plain-ab REF`: gti.sid.kmeans at a git ref, loaded as its own module, fits beside this
    checkout's (in the every-row regime of small fits both give the same codebooks), and the
    encoded figures come from each side's own codebooks."""
    import torch

    b = _bench()
    base = b.base_kmeans("HEAD")
    assert base.__name__ == "kmeans_base" and base.kmeans is not b.kmeans
    g = np.random.default_rng(1)
    x = (3 * g.normal(size=(12, 16))[g.integers(12, size=600)] + 0.1 * g.normal(size=(600, 16))).astype(np.float32)
    sample = torch.from_numpy(x)
    new, _ = b.plain_levels(b.kmeans, sample.clone(), torch.Generator().manual_seed(0))
    old, _ = b.plain_levels(base.kmeans, sample.clone(), torch.Generator().manual_seed(0))
    assert all(torch.equal(n, o) for n, o in zip(new, old))
    # Each level's code is the nearest centroid to that level's residual, the reconstruction
    # the sum of the codes' centroids, and the recon figure its mean squared error.
    codes = b.encode_nearest(new, x)
    r = sample.clone()
    for lv, cb in enumerate(new):
        assert np.array_equal(codes[:, lv], torch.cdist(r, cb).argmin(1).numpy())
        r = r - cb[torch.from_numpy(codes[:, lv])]
    recon = b.decode_books(new, codes)
    np.testing.assert_allclose(recon, x - r.numpy(), atol=1e-5)
    q = b.encoded_quality(x, new)
    assert abs(q["recon_mse"] - float(np.mean((recon - x) ** 2))) < 1e-9 and len(q["utilisation"]) == b.LEVELS
