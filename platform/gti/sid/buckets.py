"""The colliding prefix groups S of collision resolution, held bucket by bucket.

What it is for: letting `gti.sid.collide` resolve collisions with at most one bucket of S in
memory, whatever the share of the catalog that collides. `SBuckets` holds named arrays per bucket
(S's rows, their codes at each step of the resolution, the colliding rows). `BucketCodes` is the
`gti.sid.resolve.LastCodes` that `sinkhorn_rounds` re-chooses last codes on, holding nothing for
all colliders at once. `SortedPieces` streams one bucket's (row, codes) in row order, for merging
the buckets back into file order.

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

from gti.sid.resolve import bottom_k, colliding_rows, window_bins

ROWS = "rows"  # S's rows of a bucket, int64 [s_i] ascending: the name every bucket has


class SBuckets:
    """Named arrays per bucket 0..parts-1: in memory (`folder` None) or files `s{i}.{name}`
    under `folder` (removed by `close`), read back one bucket at a time (`get`), in pieces
    (`pieces`) or by row range (`slice`). `peak_rows`: the most S rows (bucket sizes) whose
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

    def slice(self, i: int, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of bucket i's `name`, read alone from a file (not counted in
        `peak_rows`: a slice of a bucket, not the bucket)."""
        if self.folder is None:
            return self._mem[(i, name)][start:stop]
        dtype, shape = self._meta[(i, name)]
        width = int(np.prod(shape[1:], dtype=np.int64))
        flat = np.fromfile(self._path(i, name), dtype=dtype, count=(stop - start) * width,
                           offset=start * width * np.dtype(dtype).itemsize)
        return flat.reshape((stop - start, *shape[1:]))

    def append(self, i: int, name: str, arr: np.ndarray) -> None:
        """Add rows `arr` at the end of bucket i's `name` (created if missing)."""
        arr = np.ascontiguousarray(arr)
        if not self.has(i, name):
            self.put(i, name, arr)
            return
        if self.folder is None:
            self._mem[(i, name)] = np.concatenate([self._mem[(i, name)], arr])
            return
        dtype, shape = self._meta[(i, name)]
        with open(self._path(i, name), "ab") as f:
            f.write(arr.astype(dtype, copy=False).tobytes())
        self._meta[(i, name)] = (dtype, (shape[0] + arr.shape[0], *shape[1:]))

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

    `try_last` scores the colliders in the windows `window_slices` gives the whole ascending
    list of them: each window is gathered from slices of every bucket's `coll` (found from
    per-bucket counts per bin of rows), its new last codes go back to their buckets as
    `last.next`, then each changed bucket's codes and colliders are written as
    `codes.next`/`coll.next`; `keep` renames them over the current ones, `undo` drops them. A
    bucket with no colliders is not read (its codes cannot change). Nothing is held for all
    colliders at once: one bucket, one window, and a count per bucket and bin of rows."""

    CODES, COLL, LAST = "codes", "coll", "last.next"

    def __init__(self, buckets: SBuckets) -> None:
        self.b = buckets

    def _live(self) -> list[int]:
        return [i for i in range(self.b.parts) if self.b.length(i, self.COLL)]

    def count(self) -> int:
        return sum(self.b.length(i, self.COLL) for i in range(self.b.parts))

    def sample(self, k: int, salt: int) -> torch.Tensor:
        best = np.zeros(0, np.int64)
        for i in self._live():
            best = bottom_k(np.concatenate([best, bottom_k(self.b.get(i, self.COLL), k, salt)]), k, salt)
        return torch.from_numpy(np.sort(best))

    def _bin_offsets(self, live: list[int], chunk_rows: int) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """(colliders per `chunk_rows`-row bin over all buckets [B], each bucket's offsets of
        those bins in its `coll` [B + 1])."""
        per = {i: np.bincount(self.b.get(i, self.COLL) // chunk_rows) for i in live}
        bins = max((len(c) for c in per.values()), default=0)
        total = np.zeros(bins, np.int64)
        offsets = {}
        for i, c in per.items():
            c = np.pad(c, (0, bins - len(c)))
            total += c
            offsets[i] = np.concatenate([[0], np.cumsum(c)])
        return total, offsets

    def try_last(self, choose, chunk_rows: int) -> int:
        b, live = self.b, self._live()
        total, offsets = self._bin_offsets(live, chunk_rows)
        for lo, hi in window_bins(total, chunk_rows):
            pieces = [(i, b.slice(i, self.COLL, int(offsets[i][lo]), int(offsets[i][hi]))) for i in live]
            rows = np.concatenate([p for _, p in pieces])
            order = np.argsort(rows, kind="stable")
            last = np.empty(rows.size, np.int32)
            last[order] = choose(torch.from_numpy(rows[order])).numpy()
            at = 0
            for i, p in pieces:
                if p.size:
                    b.append(i, self.LAST, last[at : at + p.size])
                    at += p.size
            del pieces, rows, order, last  # one window held at a time
        after = 0
        for i in live:
            coll = b.get(i, self.COLL)
            s_rows = b.get(i, ROWS)
            codes = np.array(b.get(i, self.CODES))  # a copy: in memory `get` gives the stored one
            codes[np.searchsorted(s_rows, coll), -1] = b.get(i, self.LAST)
            now = s_rows[colliding_rows(torch.from_numpy(codes.astype(np.int64))).numpy()]
            b.put(i, self.CODES + ".next", codes)
            b.put(i, self.COLL + ".next", now)
            after += now.size
            del coll, s_rows, codes, now  # one bucket held at a time
        b.drop(self.LAST)
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
