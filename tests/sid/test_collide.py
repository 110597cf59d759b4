"""gti/sid/collide.py: collision resolution from a codes file gives exactly the whole-array result."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from gti.sid.collide import (CodesWriter, closed_rows, fixed_batches, iter_codes, iter_resolved, prefix_bucket,
                             resolve_subset, scan_codes)
from gti.sid.quality import level_usage
from gti.sid.resolve import collision_rate, dedup_extra_level, dedup_reassign, sinkhorn_resolve


def _codes(n: int, sizes: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, k, (n,), generator=g) for k in sizes], dim=1)


def _write(path, codes: torch.Tensor, batch: int = 64):
    with CodesWriter(path) as w:
        for s in range(0, codes.shape[0], batch):
            w.write(codes[s : s + batch].numpy())
    return w.rows


def _spread(rounds: int):
    # sample_rows below the colliders' count: the seeded sample path runs.
    return lambda codes, cost: sinkhorn_resolve(codes, cost, epsilon=0.003, iters=50, rounds=rounds,
                                                sample_rows=40, chunk_rows=33, seed=7)


def _reference(codes, cost, dedup, rounds, sizes):
    """The stage's resolution before issue 33 item 5: every function on all N rows."""
    before = collision_rate(codes)
    sk, done = (codes, 0) if rounds == 0 or before == 0 else _spread(rounds)(codes, cost)
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
    assert scan.parts == 5 and not (tmp_path / "buckets").exists()
    np.testing.assert_array_equal(scan.picked, codes[pick].numpy())
    rows_t = torch.from_numpy(scan.rows)

    def cost_sub(pos):
        calls_sub.append(rows_t[pos])
        return table[rows_t[pos]]

    res = resolve_subset(scan, sizes, cost_sub, dedup, _spread(rounds) if rounds else None)
    got = torch.cat([torch.from_numpy(b) for b in iter_resolved(path, scan.rows, res.codes, batch_rows=77)]).long()
    assert torch.equal(got, final)
    assert res.sizes == out_sizes
    assert (res.before, res.after_sinkhorn, res.after, res.sinkhorn_rounds, res.util_q, res.perp_q, res.util,
            res.perp) == figures  # exactly
    # The same cost calls, with the same global rows, in the same order.
    assert len(calls_sub) == len(calls_ref) and all(torch.equal(a, b) for a, b in zip(calls_sub, calls_ref))
    assert figures[0] > 0
    if sizes[0] == 16:
        assert scan.rows.size < n  # only the colliding prefix groups come into memory


def test_closed_set_is_the_colliding_prefix_groups(tmp_path):
    codes = _codes(400, [12, 12, 3], seed=3)
    path = tmp_path / "codes.parquet"
    _write(path, codes, batch=33)
    one = scan_codes(path, [12, 12, 3], tmp_path / "b", bucket_rows=1000)
    many = scan_codes(path, [12, 12, 3], tmp_path / "b", bucket_rows=60, batch_rows=41)
    assert one.parts == 1 and many.parts == 7
    full = [tuple(r) for r in codes.tolist()]
    colliding_prefixes = {f[:2] for f in full if full.count(f) > 1}
    want = [i for i, f in enumerate(full) if f[:2] in colliding_prefixes]
    assert 0 < len(want) < 400
    for scan in (one, many):
        assert scan.rows.tolist() == want
        np.testing.assert_array_equal(scan.codes, codes[want].numpy())
        assert [c.tolist() for c in scan.counts] == [np.bincount(codes[:, lv], minlength=k).tolist()
                                                     for lv, k in enumerate([12, 12, 3])]
    assert closed_rows(torch.tensor([[0, 1], [0, 2], [1, 1]])).tolist() == [False] * 3
    assert closed_rows(torch.tensor([[0, 1], [0, 1], [0, 2], [1, 1]])).tolist() == [True, True, True, False]
    assert closed_rows(torch.tensor([[1], [1], [2]])).tolist() == [True] * 3  # one level: one empty prefix


def test_no_collision_keeps_the_greedy_codes(tmp_path):
    codes = torch.tensor([[0, 1], [1, 1], [0, 0], [2, 3]])
    path = tmp_path / "codes.parquet"
    _write(path, codes, batch=3)
    scan = scan_codes(path, [3, 4], tmp_path / "b")
    assert scan.rows.size == 0
    res = resolve_subset(scan, [3, 4], lambda pos: pytest.fail("no cost needed"), "reassign", _spread(3))
    assert (res.before, res.after, res.sinkhorn_rounds, res.sizes) == (0.0, 0.0, 0, [3, 4])
    assert res.util == level_usage(codes, [3, 4])[0]
    got = np.concatenate(list(iter_resolved(path, scan.rows, res.codes, batch_rows=3)))
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
