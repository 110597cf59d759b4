"""gti/sid/collide.py: collision resolution from a codes file gives exactly the whole-array result."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from gti.sid.buckets import ROWS
from gti.sid.collide import (CodesWriter, closed_groups, closed_rows, fixed_batches, iter_codes, iter_resolved,
                             prefix_bucket, resolve_subset, scan_codes)
from gti.sid.quality import level_usage
from gti.sid.resolve import collision_rate, colliding_rows, dedup_extra_level, dedup_reassign, sinkhorn_resolve, \
    sinkhorn_rounds


def _codes(n: int, sizes: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, k, (n,), generator=g) for k in sizes], dim=1)


def _write(path, codes: torch.Tensor, batch: int = 64):
    with CodesWriter(path) as w:
        for s in range(0, codes.shape[0], batch):
            w.write(codes[s : s + batch].numpy())
    return w.rows


# sample_rows below the colliders' count: the seeded sample path runs.
SINKHORN = dict(epsilon=0.003, iters=50, sample_rows=40, chunk_rows=33, seed=7)


def _spread(rounds: int):
    """The bucketed resolution's Sinkhorn: `sinkhorn_rounds` on the store it is given."""
    return lambda store, cost: sinkhorn_rounds(store, cost, rounds=rounds, **SINKHORN)


def _reference(codes, cost, dedup, rounds, sizes):
    """The stage's resolution before issue 33 item 5: every function on all N rows."""
    before = collision_rate(codes)
    sk, done = (codes, 0) if rounds == 0 or before == 0 else sinkhorn_resolve(codes, cost, rounds=rounds, **SINKHORN)
    util_q, perp_q = level_usage(sk, sizes)
    final = dedup_extra_level(sk) if dedup == "extra_level" else dedup_reassign(sk, cost)
    out_sizes = list(sizes) + ([int(final[:, -1].max()) + 1] if final.shape[1] > len(sizes) else [])
    util, perp = level_usage(final, out_sizes)
    return final, out_sizes, (before, collision_rate(sk), collision_rate(final), done, util_q, perp_q, util, perp)


CASES = [  # (codebook sizes, cost kind): sparse collisions (S a small part of N), or all colliding
    ([16, 16, 4], "rand"),
    ([16, 16, 8], "ties"),     # reassign ends without an extra level
    ([4, 4, 4], "rand"),      # ~8 rows per prefix for 4 codes: reassign must add a level too
    ([4, 4, 4], "ties"),      # integer costs: exact ties everywhere, broken by row order
    ([40, 6], "rand"),
]


@pytest.mark.parametrize("sizes,kind", CASES)
@pytest.mark.parametrize("dedup", ["extra_level", "reassign"])
@pytest.mark.parametrize("rounds", [0, 4])
def test_streamed_resolution_equals_the_whole_array(tmp_path, sizes, kind, dedup, rounds):
    n = 500
    codes = _codes(n, sizes, seed=len(sizes) + sizes[0])
    g = torch.Generator().manual_seed(1)
    table = torch.rand(n, sizes[-1], generator=g)
    if kind == "ties":
        table = torch.randint(0, 3, (n, sizes[-1]), generator=g).float()
    calls_ref, calls_sub = [], []

    def cost(rows):  # deterministic per global row; the calls are recorded
        calls_ref.append(rows.clone())
        return table[rows]

    final, out_sizes, figures = _reference(codes, cost, dedup, rounds, sizes)

    path = tmp_path / "codes.parquet"
    assert _write(path, codes) == n
    pick = np.array([499, 3, 0, 250, 3])
    scan = scan_codes(path, sizes, tmp_path / "buckets", bucket_rows=120, pick=pick, batch_rows=50)
    assert scan.parts == 5 and (tmp_path / "buckets").is_dir()  # S's buckets, until the scan is closed
    np.testing.assert_array_equal(scan.picked, codes[pick].numpy())

    def cost_sub(rows):
        calls_sub.append(rows.clone())
        return table[rows]

    with scan:
        res = resolve_subset(scan, sizes, cost_sub, dedup, _spread(rounds) if rounds else None)
        got = torch.cat([torch.from_numpy(b) for b in iter_resolved(path, scan.buckets, len(res.sizes), 77)]).long()
    assert not (tmp_path / "buckets").exists()
    assert torch.equal(got, final)
    assert res.sizes == out_sizes
    assert (res.before, res.after_sinkhorn, res.after, res.sinkhorn_rounds, res.util_q, res.perp_q, res.util,
            res.perp) == figures  # exactly
    if dedup == "extra_level":  # Sinkhorn's calls only: the same global rows, in the same order
        assert len(calls_sub) == len(calls_ref) and all(torch.equal(a, b) for a, b in zip(calls_sub, calls_ref))
    elif calls_ref:  # reassign asks bucket by bucket, and a bucket stops once nothing in it can
        # move (the whole array re-scores such rows until nothing moves anywhere): the same rows
        assert torch.equal(torch.cat(calls_sub).unique(), torch.cat(calls_ref).unique())
    assert figures[0] > 0
    if sizes[0] == 16:
        assert scan.size < n  # only the colliding prefix groups come into memory


MANY = [  # 26-43% of a 600-row catalog collides; Sinkhorn runs 2-6 rounds, or undoes its first
    ([10, 10, 5], "rand"),
    ([10, 10, 5], "ties"),
    ([8, 8, 8], "ties"),       # the first round does not help: undone in every bucket
    ([6, 6, 6, 4], "rand"),
    ([20, 25], "rand"),
    ([5, 5, 5, 5], "ties"),
]
# bucket_rows for P = 1 (in memory), 3, 4, 6 and 7 buckets of 600 rows.
BUCKET_ROWS = {1: 600, 3: 200, 4: 150, 6: 100, 7: 86}


def _bucketed(tmp_path, codes, sizes, cost, dedup, rounds, parts):
    """(final codes long [N, L'], `Resolved`, S rows per bucket [parts], scan) of the bucketed
    path with `parts` buckets."""
    path = tmp_path / f"codes{parts}.parquet"
    _write(path, codes, batch=71)
    scan = scan_codes(path, sizes, tmp_path / f"buckets{parts}", bucket_rows=BUCKET_ROWS[parts], batch_rows=50)
    assert scan.parts == parts
    with scan:
        res = resolve_subset(scan, sizes, cost, dedup, _spread(rounds) if rounds else None)
        got = torch.cat([torch.from_numpy(b) for b in iter_resolved(path, scan.buckets, len(res.sizes), 64)])
        held = [scan.buckets.length(i) for i in range(parts)]
    return got.long(), res, held, scan


@pytest.mark.parametrize("sizes,kind", MANY)
@pytest.mark.parametrize("dedup", ["extra_level", "reassign"])
@pytest.mark.parametrize("rounds", [0, 6])
def test_bucket_by_bucket_equals_the_whole_array_and_one_bucket(tmp_path, sizes, kind, dedup, rounds):
    """Issue 33 item 5: with S in 3-7 buckets on disk, resolved a bucket at a time (Sinkhorn's
    sample and undo still global), the codes and every figure are those of the whole-array
    functions and of one bucket in memory, exactly."""
    n = 600
    codes = _codes(n, sizes, seed=sum(sizes))
    assert 0.2 < collision_rate(codes) < 0.6
    g = torch.Generator().manual_seed(1)
    table = torch.rand(n, sizes[-1], generator=g)
    if kind == "ties":
        table = torch.randint(0, 3, (n, sizes[-1]), generator=g).float()

    def cost(rows):
        return table[rows]

    final, out_sizes, figures = _reference(codes, cost, dedup, rounds, sizes)
    if rounds:
        assert colliding_rows(codes).numel() > 5 * SINKHORN["sample_rows"]  # the sample path runs
        assert figures[3] >= 2 or sizes == [8, 8, 8]  # several rounds (or the first undone)
    for parts in BUCKET_ROWS:
        got, res, _, _ = _bucketed(tmp_path, codes, sizes, cost, dedup, rounds, parts)
        assert torch.equal(got, final), parts
        assert res.sizes == out_sizes
        assert (res.before, res.after_sinkhorn, res.after, res.sinkhorn_rounds, res.util_q, res.perp_q, res.util,
                res.perp) == figures, parts  # exactly
    assert figures[2] == 0.0 and (len(out_sizes) > len(sizes) or dedup == "reassign")


def test_one_bucket_of_s_held_at_a_time(tmp_path):
    """The S rows held at once (arrays read from the buckets and still alive) never exceed the
    largest bucket's, through the scan, Sinkhorn, de-duplication and the merge."""
    sizes, n = [10, 10, 5], 600
    codes = _codes(n, sizes, seed=sum(sizes))
    table = torch.rand(n, sizes[-1], generator=torch.Generator().manual_seed(1))
    final, _, _ = _reference(codes, lambda r: table[r], "reassign", 6, sizes)
    for parts in (3, 7):
        got, res, held, scan = _bucketed(tmp_path, codes, sizes, lambda r: table[r], "reassign", 6, parts)
        assert torch.equal(got, final) and res.sinkhorn_rounds >= 2
        assert sum(held) == scan.size and scan.buckets.peak_rows == max(held) < scan.size
    _, _, held, one = _bucketed(tmp_path, codes, sizes, lambda r: table[r], "reassign", 6, 1)
    assert one.buckets.peak_rows == one.size == held[0]  # one bucket: all of S, in memory


def test_closed_set_is_the_colliding_prefix_groups(tmp_path):
    codes = _codes(400, [12, 12, 3], seed=3)
    path = tmp_path / "codes.parquet"
    _write(path, codes, batch=33)
    one = scan_codes(path, [12, 12, 3], tmp_path / "b1", bucket_rows=1000)
    many = scan_codes(path, [12, 12, 3], tmp_path / "b7", bucket_rows=60, batch_rows=41)
    assert one.parts == 1 and many.parts == 7
    assert not (tmp_path / "b1").exists() and (tmp_path / "b7").is_dir()  # one bucket stays in memory
    full = [tuple(r) for r in codes.tolist()]
    colliding_prefixes = {f[:2] for f in full if full.count(f) > 1}
    want = [i for i, f in enumerate(full) if f[:2] in colliding_prefixes]
    colliders = colliding_rows(codes)
    assert 0 < len(want) < 400
    for scan in (one, many):
        rows, s_codes, coll = _held(scan)
        assert rows.tolist() == want and scan.size == len(want)
        np.testing.assert_array_equal(s_codes, codes[want].numpy())
        np.testing.assert_array_equal(coll, colliders.numpy())
        assert scan.unique == int(codes[want].unique(dim=0).shape[0])
        all_counts = [np.bincount(codes[:, lv], minlength=k) for lv, k in enumerate([12, 12, 3])]
        assert [c.tolist() for c in scan.counts] == [c.tolist() for c in all_counts]
        s_counts = [np.bincount(codes[want, lv], minlength=k) for lv, k in enumerate([12, 12, 3])]
        assert [c.tolist() for c in scan.outside] == [(a - b).tolist() for a, b in zip(all_counts, s_counts)]
        rows_by_bucket = [scan.buckets.get(i, ROWS) for i in range(scan.parts)]
        assert all((np.diff(r) > 0).all() for r in rows_by_bucket)  # ascending inside each bucket
        del rows_by_bucket
        scan.close()
    assert not (tmp_path / "b7").exists()
    assert closed_rows(torch.tensor([[0, 1], [0, 2], [1, 1]])).tolist() == [False] * 3
    assert closed_rows(torch.tensor([[0, 1], [0, 1], [0, 2], [1, 1]])).tolist() == [True, True, True, False]
    assert closed_rows(torch.tensor([[1], [1], [2]])).tolist() == [True] * 3  # one level: one empty prefix
    closed, colliding, groups = closed_groups(torch.tensor([[0, 1], [0, 1], [0, 2], [1, 1]]))
    assert (closed.tolist(), colliding.tolist(), groups) == ([True, True, True, False], [True, True, False, False], 3)


def _held(scan):
    """S of a scan as one array each, by row: (rows [s], codes [s, L], colliding rows [m])."""
    b = scan.buckets
    rows = np.concatenate([b.get(i, ROWS) for i in range(b.parts)])
    codes = np.concatenate([b.get(i, "codes") for i in range(b.parts)])
    coll = np.sort(np.concatenate([b.get(i, "coll") for i in range(b.parts)]))
    order = np.argsort(rows)
    return rows[order], codes[order], coll


def test_no_collision_keeps_the_greedy_codes(tmp_path):
    codes = torch.tensor([[0, 1], [1, 1], [0, 0], [2, 3]])
    path = tmp_path / "codes.parquet"
    _write(path, codes, batch=3)
    scan = scan_codes(path, [3, 4], tmp_path / "b")
    assert scan.size == 0
    res = resolve_subset(scan, [3, 4], lambda rows: pytest.fail("no cost needed"), "reassign", _spread(3))
    assert (res.before, res.after, res.sinkhorn_rounds, res.sizes) == (0.0, 0.0, 0, [3, 4])
    assert res.util == level_usage(codes, [3, 4])[0]
    got = np.concatenate(list(iter_resolved(path, scan.buckets, len(res.sizes), batch_rows=3)))
    np.testing.assert_array_equal(got, codes.numpy())


def test_prefix_bucket_and_fixed_batches():
    codes = _codes(300, [5, 5, 9], seed=0).numpy()
    b = prefix_bucket(codes, 4)
    assert set(b.tolist()) == {0, 1, 2, 3}
    again = np.concatenate([prefix_bucket(codes[s : s + 7], 4) for s in range(0, 300, 7)])
    np.testing.assert_array_equal(b, again)
    same_prefix = (codes[:, None, :2] == codes[None, :, :2]).all(-1)
    assert (b[:, None] == b[None, :])[same_prefix].all()
    pieces = [np.arange(s, min(s + 13, 100)) for s in range(0, 100, 13)]
    assert [len(p) for p in fixed_batches(pieces, 30)] == [30, 30, 30, 10]
    np.testing.assert_array_equal(np.concatenate(list(fixed_batches(pieces, 30))), np.arange(100))
    arrow = list(fixed_batches([pa.array(["a", "b"]), pa.array(["c"]), pa.array(["d", "e", "f"])], 4))
    assert [a.to_pylist() for a in arrow] == [["a", "b", "c", "d"], ["e", "f"]]
    assert np.concatenate(list(iter_codes_of(codes))).shape == (300, 3)


def iter_codes_of(codes: np.ndarray):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.parquet"
        with CodesWriter(path) as w:
            w.write(codes[:100])
            w.write(codes[100:])
        yield from iter_codes(path, batch_rows=64)
