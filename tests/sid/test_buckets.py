"""gti/sid/buckets.py: S held bucket by bucket, in memory or on disk, and Sinkhorn's last codes over it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gti.sid.buckets import ROWS, BucketCodes, SBuckets, SortedPieces
from gti.sid.resolve import ArrayCodes, sinkhorn_rounds


def _filled(folder):
    b = SBuckets(3, folder)
    for i, k in enumerate([4, 0, 6]):
        b.put(i, ROWS, np.arange(k, dtype=np.int64) * 3 + i)
        b.put(i, "codes", np.arange(2 * k, dtype=np.int32).reshape(k, 2) + 100 * i)
    return b


@pytest.mark.parametrize("on_disk", [False, True])
def test_named_arrays_per_bucket(tmp_path, on_disk):
    b = _filled(tmp_path / "b" if on_disk else None)
    assert [b.length(i) for i in range(3)] == [4, 0, 6] and b.size() == 10 and b.length(2, "codes") == 6
    np.testing.assert_array_equal(b.get(2, "codes"), np.arange(12, dtype=np.int32).reshape(6, 2) + 200)
    assert b.get(2, ROWS).dtype == np.int64 and b.get(0, "codes").shape == (4, 2)
    pieces = list(b.pieces(2, "codes", 4))
    assert [p.shape for p in pieces] == [(4, 2), (2, 2)]
    np.testing.assert_array_equal(np.concatenate(pieces), b.get(2, "codes"))
    b.put(0, "codes.next", np.zeros((4, 2), np.int32))
    b.rename("codes.next", "codes")  # bucket 2 keeps its codes
    assert not b.has(0, "codes.next") and b.get(0, "codes").sum() == 0 and b.get(2, "codes")[0, 0] == 200
    np.testing.assert_array_equal(b.slice(2, "codes", 1, 4), b.get(2, "codes")[1:4])
    np.testing.assert_array_equal(b.slice(2, ROWS, 5, 6), [17])
    b.append(2, "extra", np.ones((2, 2), np.int32))  # created
    b.append(2, "extra", np.full((3, 2), 5, np.int32))  # grows
    assert b.length(2, "extra") == 5 and b.get(2, "extra")[:, 0].tolist() == [1, 1, 5, 5, 5]
    b.drop("codes")
    assert not any(b.has(i, "codes") for i in range(3)) and b.has(2, ROWS)
    b.close()
    assert not (tmp_path / "b").exists()


def test_on_disk_get_is_a_fresh_array_and_the_rows_held_are_counted(tmp_path):
    b = _filled(tmp_path / "b")
    first = b.get(0, "codes")
    first[:] = -1  # the caller's copy
    assert b.get(0, "codes").min() == 0
    view = torch.from_numpy(b.get(2, ROWS))[1:]  # a tensor over a view keeps the array alive
    again = b.get(0, ROWS)
    assert b.peak_rows == 4 + 6
    del first, view, again
    b.get(2, "codes")  # freed at once
    b.get(0, ROWS)
    assert b.peak_rows == 10
    fresh = SBuckets(3, tmp_path / "c")
    fresh.put(0, ROWS, np.arange(5))
    fresh.put(1, ROWS, np.arange(7))
    for i in (0, 1, 0):
        fresh.get(i, ROWS)  # one at a time
    assert fresh.peak_rows == 7
    assert _filled(None).get(0, ROWS).size == 4 and _filled(None).peak_rows == 0
    mem = _filled(None)
    mem.get(0, ROWS)
    assert mem.peak_rows == 10  # in memory every bucket is held


def _split(codes: torch.Tensor, parts: int, folder):
    """SBuckets of codes [N, L] by first code mod parts (whole prefix groups per bucket), each
    with its colliding rows, as `gti.sid.collide.scan_codes` leaves them."""
    from gti.sid.resolve import colliding_rows

    b = SBuckets(parts, folder)
    for i in range(parts):
        rows = torch.nonzero(codes[:, 0] % parts == i).flatten()
        sub = codes[rows]
        b.put(i, ROWS, rows.numpy())
        b.put(i, BucketCodes.CODES, sub.numpy().astype(np.int32))
        b.put(i, BucketCodes.COLL, rows[colliding_rows(sub)].numpy() if len(rows) else np.zeros(0, np.int64))
    return b


def _gather(b: SBuckets, n: int, levels: int) -> torch.Tensor:
    out = torch.full((n, levels), -1, dtype=torch.long)
    for i in range(b.parts):
        out[torch.from_numpy(b.get(i, ROWS))] = torch.from_numpy(b.get(i, BucketCodes.CODES)).long()
    return out


@pytest.mark.parametrize("on_disk", [False, True])
def test_bucket_codes_step_as_the_whole_array(tmp_path, on_disk):
    g = torch.Generator().manual_seed(0)
    codes = torch.stack([torch.randint(0, k, (300,), generator=g) for k in (7, 4, 3)], dim=1)
    whole = ArrayCodes(codes.clone())
    buckets = BucketCodes(_split(codes, 4, tmp_path / "b" if on_disk else None))
    assert whole.count() > 50 and buckets.count() == whole.count()
    for step, keep in enumerate((True, False, True)):
        # The same seeded sample, found bucket by bucket.
        assert torch.equal(buckets.sample(20, salt=step), whole.sample(20, salt=step))
        assert torch.equal(buckets.sample(10_000, salt=step), whole.colliders())  # all, when few
        calls = {"whole": [], "buckets": []}

        def choose(name, step=step):
            # new last codes, a function of the row alone; records each window asked for
            return lambda r: calls[name].append(r.clone()) or ((r * 7 + step) % 3).to(torch.int32)

        # 29-row windows: the colliders are scored in several windows, in the same ones.
        assert buckets.try_last(choose("buckets"), 29) == whole.try_last(choose("whole"), 29)
        assert len(calls["whole"]) > 2 and max(len(r) for r in calls["whole"]) <= 29
        assert all(torch.equal(a, b) for a, b in zip(calls["whole"], calls["buckets"], strict=True))
        (whole.keep(), buckets.keep()) if keep else (whole.undo(), buckets.undo())
        assert torch.equal(_gather(buckets.b, 300, 3), whole.codes)
        assert buckets.count() == whole.count()
    assert not any(buckets.b.has(i, n) for i in range(4) for n in ("codes.next", "coll.next", "last.next"))


def test_sinkhorn_rounds_over_buckets_equal_the_whole_array(tmp_path):
    g = torch.Generator().manual_seed(0)
    codes = torch.stack([torch.randint(0, k, (500,), generator=g) for k in (12, 8, 6)], dim=1)
    table = torch.rand(500, 6, generator=g)
    calls = {"whole": [], "buckets": []}

    def cost(name):
        return lambda rows: calls[name].append(rows.clone()) or table[rows]

    kw = dict(epsilon=0.003, iters=50, rounds=8, sample_rows=30, chunk_rows=41, seed=5)
    whole = ArrayCodes(codes.clone())
    done = sinkhorn_rounds(whole, cost("whole"), **kw)
    buckets = BucketCodes(_split(codes, 5, tmp_path / "b"))
    assert sinkhorn_rounds(buckets, cost("buckets"), **kw) == done >= 2
    assert torch.equal(_gather(buckets.b, 500, 3), whole.codes)
    assert len(calls["whole"]) == len(calls["buckets"])  # the same sample and chunks, in order
    assert all(torch.equal(a, b) for a, b in zip(calls["whole"], calls["buckets"]))


def test_sorted_pieces_hand_out_rows_by_range():
    b = SBuckets(1)
    rows = np.array([2, 3, 9, 10, 11, 30, 31, 47], dtype=np.int64)
    b.put(0, ROWS, rows)
    b.put(0, "final", (rows * 10).astype(np.int32).reshape(-1, 1))
    merge = SortedPieces(b, 0, "final", rows=3)
    got = []
    for end in (3, 10, 10, 12, 40, 100):
        got.append([(r.tolist(), c[:, 0].tolist()) for r, c in merge.below(end)])
    assert got == [[([2], [20])], [([3, 9], [30, 90])], [], [([10, 11], [100, 110])],
                   [([30], [300]), ([31], [310])], [([47], [470])]]  # a range can span two pieces
