"""The colliding prefix groups S of collision resolution, held bucket by bucket.

What it is for: letting `gti.sid.collide` resolve collisions with at most one bucket of S in
memory, whatever the share of the catalog that collides. `SBuckets` holds named arrays per
bucket (S's rows, their codes at each step of the resolution, the colliding rows): in memory
when there is one bucket, else as raw files in a folder, read back one bucket at a time
(`get`, which counts the S rows held, `peak_rows`) or in pieces (`pieces`). `BucketCodes` is
the `gti.sid.resolve.LastCodes` that `sinkhorn_rounds` re-chooses last codes on: a round
visits each bucket once and writes its tentative codes as a second generation, so a round
that does not help is undone by dropping that generation; what it holds for all buckets is
the colliders' rows (int64, ascending). `SortedPieces` streams one bucket's (row, codes) in
row order, for merging the buckets back into file order.

What it does not know: how rows were put into buckets (that every prefix group lies in one
bucket, and rows are ascending inside each, is the caller's promise), embeddings, Ray.
"""

from __future__ import annotations

import shutil
import weakref
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from gti.sid.resolve import colliding_rows

ROWS = "rows"  # S's rows of a bucket, int64 [s_i] ascending: the name every bucket has


class SBuckets:
    """Named arrays per bucket 0..parts-1: in memory (`folder` None) or files `s{i}.{name}`
    under `folder` (removed by `close`). `peak_rows`: the most S rows (bucket sizes) whose
    arrays from `get` were alive at once."""

    def __init__(self, parts: int, folder: Path | None = None) -> None:
        self.parts, self.folder = parts, folder
        self._mem: dict[tuple[int, str], np.ndarray] = {}
        self._meta: dict[tuple[int, str], tuple[np.dtype, tuple[int, ...]]] = {}
        self._live = [0] * parts  # arrays from `get` not yet freed, per bucket
        self.peak_rows = 0
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)  # a killed run's leftovers
            folder.mkdir(parents=True)

    def _path(self, i: int, name: str) -> Path:
        return self.folder / f"s{i}.{name}"

    def put(self, i: int, name: str, arr: np.ndarray) -> None:
        """Store `arr` as bucket i's `name` (replacing it); kept as is in memory."""
        arr = np.ascontiguousarray(arr)
        if self.folder is None:
            self._mem[(i, name)] = arr
            return
        arr.tofile(self._path(i, name))
        self._meta[(i, name)] = (arr.dtype, arr.shape)

    def has(self, i: int, name: str) -> bool:
        return (i, name) in (self._mem if self.folder is None else self._meta)

    def length(self, i: int, name: str = ROWS) -> int:
        """Rows of bucket i's `name` (S rows of the bucket for `ROWS`), without reading it."""
        if self.folder is None:
            return len(self._mem[(i, name)])
        return self._meta[(i, name)][1][0]

    def size(self) -> int:
        """Rows of S in all buckets."""
        return sum(self.length(i) for i in range(self.parts))

    def get(self, i: int, name: str) -> np.ndarray:
        """Bucket i's `name`. From a file it is a fresh array (the caller may change it),
        counted as holding the bucket's S rows until it (and every view of it) is freed."""
        if self.folder is None:
            arr = self._mem[(i, name)]
            self.peak_rows = max(self.peak_rows, self.size())  # everything is held
            return arr
        dtype, shape = self._meta[(i, name)]
        flat = np.fromfile(self._path(i, name), dtype=dtype)
        self._live[i] += 1
        self.peak_rows = max(self.peak_rows, self._held())
        weakref.finalize(flat, self._release, i)  # views and tensors keep `flat` alive
        return flat.reshape(shape)

    def _release(self, i: int) -> None:
        self._live[i] -= 1

    def _held(self) -> int:
        return sum(self.length(i) for i in range(self.parts) if self._live[i])

    def pieces(self, i: int, name: str, rows: int) -> Iterator[np.ndarray]:
        """Bucket i's `name` in consecutive pieces of at most `rows` rows, read as they are
        needed (not counted in `peak_rows`: a piece is a batch, not a bucket)."""
        if self.folder is None:
            arr = self._mem[(i, name)]
            yield from (arr[s : s + rows] for s in range(0, len(arr), rows))
            return
        dtype, shape = self._meta[(i, name)]
        width = int(np.prod(shape[1:], dtype=np.int64))
        with open(self._path(i, name), "rb") as f:
            for s in range(0, shape[0], rows):
                take = min(rows, shape[0] - s)
                yield np.fromfile(f, dtype=dtype, count=take * width).reshape((take, *shape[1:]))

    def rename(self, src: str, dst: str) -> None:
        """Every bucket's `src` becomes its `dst` (replacing it); buckets without `src` keep
        their `dst`."""
        for i in range(self.parts):
            if not self.has(i, src):
                continue
            if self.folder is None:
                self._mem[(i, dst)] = self._mem.pop((i, src))
            else:
                self._path(i, src).replace(self._path(i, dst))
                self._meta[(i, dst)] = self._meta.pop((i, src))

    def drop(self, name: str) -> None:
        """Remove `name` from every bucket."""
        for i in range(self.parts):
            if self.has(i, name):
                if self.folder is None:
                    del self._mem[(i, name)]
                else:
                    self._path(i, name).unlink(missing_ok=True)
                    del self._meta[(i, name)]

    def close(self) -> None:
        """Forget every array and remove the folder."""
        self._mem.clear()
        self._meta.clear()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


class BucketCodes:
    """`LastCodes` over S in `SBuckets`: bucket i's `codes` int32 [s_i, L] and `coll` (its
    colliding rows, int64 ascending), changed a bucket at a time. Rows are global row ids.

    `try_last` writes each changed bucket's codes and colliders as `codes.next`/`coll.next`;
    `keep` renames them over the current ones, `undo` drops them. A bucket with no colliders
    is not read (its codes cannot change)."""

    CODES, COLL = "codes", "coll"

    def __init__(self, buckets: SBuckets) -> None:
        self.b = buckets

    def colliders(self) -> torch.Tensor:
        b = self.b
        sizes = [b.length(i, self.COLL) for i in range(b.parts)]
        out = np.empty(sum(sizes), np.int64)  # filled bucket by bucket: no second copy
        at = 0
        for i, k in enumerate(sizes):
            if k:
                out[at : at + k] = b.get(i, self.COLL)
                at += k
        if sum(1 for k in sizes if k) > 1:
            out.sort()  # each bucket's run is ascending; the merge is the global order
        return torch.from_numpy(out)

    def try_last(self, rows: torch.Tensor, last: torch.Tensor) -> int:
        b, rows_np, last_np = self.b, rows.numpy(), last.numpy()
        after = 0
        for i in range(b.parts):
            if not b.length(i, self.COLL):
                continue
            coll = b.get(i, self.COLL)
            s_rows = b.get(i, ROWS)
            codes = np.array(b.get(i, self.CODES))  # a copy: in memory `get` gives the stored one
            codes[np.searchsorted(s_rows, coll), -1] = last_np[np.searchsorted(rows_np, coll)]
            now = s_rows[colliding_rows(torch.from_numpy(codes.astype(np.int64))).numpy()]
            b.put(i, self.CODES + ".next", codes)
            b.put(i, self.COLL + ".next", now)
            after += now.size
            del coll, s_rows, codes, now  # one bucket held at a time
        return after

    def keep(self) -> None:
        self.b.rename(self.CODES + ".next", self.CODES)
        self.b.rename(self.COLL + ".next", self.COLL)

    def undo(self) -> None:
        self.b.drop(self.CODES + ".next")
        self.b.drop(self.COLL + ".next")


class SortedPieces:
    """Bucket i's `ROWS` with its `name` codes, in row order, handed out by row range
    (`below`), `rows` at a time from the buckets."""

    def __init__(self, buckets: SBuckets, i: int, name: str, rows: int) -> None:
        self._it = zip(buckets.pieces(i, ROWS, rows), buckets.pieces(i, name, rows))
        self._rows: np.ndarray = np.zeros(0, np.int64)
        self._codes: np.ndarray | None = None
        self._at = 0

    def below(self, end: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The next (rows [k], codes [k, w]) pieces, up to the first row >= end."""
        while True:
            if self._at == len(self._rows):
                nxt = next(self._it, None)
                if nxt is None:
                    return
                (self._rows, self._codes), self._at = nxt, 0
            hi = self._at + int(np.searchsorted(self._rows[self._at :], end))
            if hi > self._at:
                yield self._rows[self._at : hi], self._codes[self._at : hi]
            self._at = hi
            if hi < len(self._rows):
                return
