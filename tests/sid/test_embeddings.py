"""gti/sid/embeddings.py: random row access by row group, and the last level's residuals
encoded once per item within a cache budget."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gti.run.manifest import Manifest


def write_embed_stage(run_dir, vecs: np.ndarray, ids=None):
    """A finished `embed` stage (manifest + embeddings.parquet) holding `vecs` [N, dim]."""
    d = run_dir / "embed"
    d.mkdir(parents=True)
    n, dim = vecs.shape
    ids = ids or [f"item{i}" for i in range(n)]
    flat = pa.array(np.ascontiguousarray(vecs, dtype=np.float32).reshape(-1))
    pq.write_table(pa.table({"item_id": ids, "embedding": pa.FixedSizeListArray.from_arrays(flat, dim)}),
                   d / "embeddings.parquet")
    Manifest(stage="embed", fingerprint=f"test-{n}-{dim}", config={},
             facts={"dim": dim, "n_items": n, "encoder": "test"},
             outputs={"embeddings": "embeddings.parquet"}).write(d)


def clustered(n=240, dim=16, k=12, seed=0):
    g = np.random.default_rng(seed)
    centres = g.normal(size=(k, dim))
    return (centres[g.integers(k, size=n)] + 0.3 * g.normal(size=(n, dim))).astype(np.float32)


def test_embedding_rows_read_by_row_group_equals_take(tmp_path):
    from gti.sid.embeddings import EmbeddingRows

    vecs = clustered(n=1000, dim=8)
    flat = pa.array(vecs.reshape(-1))
    pq.write_table(pa.table({"item_id": [str(i) for i in range(1000)],
                             "embedding": pa.FixedSizeListArray.from_arrays(flat, 8)}),
                   tmp_path / "e.parquet", row_group_size=128)
    r = EmbeddingRows(tmp_path / "e.parquet")
    assert r.n == 1000 and len(r.starts) == 1000 // 128 + 2
    rows = np.array([999, 0, 127, 128, 500, 0, 640])  # unsorted, repeated, across groups
    assert torch.equal(r.read(rows), torch.from_numpy(vecs[rows]))
    assert r.read(np.array([], dtype=np.int64)).shape == (0, 8)
    with pytest.raises(IndexError, match="out of range"):
        r.read(np.array([1000]))


def test_last_residuals_encode_each_item_once(tmp_path):
    from gti.sid.rqkmeans import RQKMeansConfig, ResidualKMeans
    from gti.sid.embeddings import EmbeddingRows, LastResiduals

    vecs = clustered(n=300, dim=8)
    run_dir = tmp_path / "run"
    write_embed_stage(run_dir, vecs)
    q = ResidualKMeans(RQKMeansConfig(in_dim=8, levels=2, codebook_size=8, balanced=False))
    q.fit(torch.from_numpy(vecs), iters=5, generator=torch.Generator().manual_seed(0))
    calls = []
    orig = q.last_residual
    q.last_residual = lambda x: calls.append(len(x)) or orig(x)
    lr = LastResiduals(q, EmbeddingRows(run_dir / "embed" / "embeddings.parquet"), chunk=64)
    a = lr(np.arange(0, 200))
    b = lr(np.arange(100, 300))  # half cached
    assert sum(calls) == 300 and max(calls) <= 64 and lr.encoded == 300
    want = orig(torch.from_numpy(vecs))
    torch.testing.assert_close(a, want[:200])
    torch.testing.assert_close(b, want[100:300])

    # A cache of 100 rows (100 x 8 floats): the first 100 items stay cached, the rest are
    # encoded again on every call; answers are the same either way.
    calls.clear()
    small = LastResiduals(q, EmbeddingRows(run_dir / "embed" / "embeddings.parquet"), chunk=64,
                          cache_mb=100 * 8 * 4 / 2**20)
    rows = np.array([250, 5, 5, 120, 99, 0, 299, 250])  # unsorted, repeated: 6 distinct
    for _ in range(3):
        torch.testing.assert_close(small(rows), want[rows])
    assert small.encoded == 6 and small.used == 6  # cached on the first call
    torch.testing.assert_close(small(np.arange(300)), want)
    assert small.encoded == 300 and small.used == 100 and small.res.shape[0] == 100  # budget full
    torch.testing.assert_close(small(np.arange(300)), want)
    assert small.encoded == 500  # the 200 rows past the budget are encoded again


def test_last_residuals_cache_is_keyed_by_row(tmp_path):
    """Rows are the catalog's own (any of N, any order): the cache holds a key and a slot per
    cached item only, nothing per item of the catalog, and answers as encoding afresh."""
    from gti.sid.rqkmeans import RQKMeansConfig, ResidualKMeans
    from gti.sid.embeddings import EmbeddingRows, LastResiduals

    vecs = clustered(n=120, dim=8, seed=2)
    run_dir = tmp_path / "run"
    write_embed_stage(run_dir, vecs)
    q = ResidualKMeans(RQKMeansConfig(in_dim=8, levels=2, codebook_size=4, balanced=False))
    q.fit(torch.from_numpy(vecs), iters=3, generator=torch.Generator().manual_seed(0))
    want = q.last_residual(torch.from_numpy(vecs)).float()
    lr = LastResiduals(q, EmbeddingRows(run_dir / "embed" / "embeddings.parquet"), chunk=2,
                       cache_mb=6 * 8 * 4 / 2**20)  # six rows
    torch.testing.assert_close(lr(np.array([119, 3, 119])), want[[119, 3, 119]])
    torch.testing.assert_close(lr(np.array([57, 10, 3, 11, 0])), want[[57, 10, 3, 11, 0]])
    assert lr.keys.tolist() == [0, 3, 10, 11, 57, 119] and lr.used == 6 and lr.encoded == 6
    torch.testing.assert_close(lr.res[torch.from_numpy(lr.slots)], want[lr.keys])
    torch.testing.assert_close(lr(np.array([1, 119, 0, 2])), want[[1, 119, 0, 2]])
    assert lr.keys.size == 6 and lr.encoded == 8  # budget full: 1 and 2 are not kept


def test_assign_batch_leaves_no_temp_folder(tmp_path, monkeypatch):
    """Each actor loads the quantiser through a temp folder; it is removed once loaded (116
    of them were left in /tmp by one session's runs), and the loaded quantiser still encodes."""
    import tempfile

    from gti.sid.embeddings import AssignBatch
    from gti.sid.quantizer import save_quantizer
    from gti.sid.rqkmeans import RQKMeansConfig, ResidualKMeans

    vecs = clustered(n=200, dim=8)
    q = ResidualKMeans(RQKMeansConfig(in_dim=8, levels=2, codebook_size=8, balanced=False))
    q.fit(torch.from_numpy(vecs), iters=3, generator=torch.Generator().manual_seed(0))
    wpath, cpath = save_quantizer(q, tmp_path / "q")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assign = AssignBatch(wpath.read_bytes(), cpath.read_text())
    assert list(scratch.iterdir()) == []
    flat = pa.array(vecs.reshape(-1))
    got = assign(pa.table({"embedding": pa.FixedSizeListArray.from_arrays(flat, 8)}))["codes"]
    assert np.array_equal(got, q.encode(torch.from_numpy(vecs)).numpy())
