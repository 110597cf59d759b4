"""Collision resolution with the codes on disk: only the rows that can collide come into memory.

What it is for: keeping the `sid` stage's driver memory independent of the catalog size.
Greedy codes int32 [N, L] are written batch by batch to a parquet file (`CodesWriter`);
`scan_codes` streams it once and keeps only what resolution needs: the closed set S (every
row whose first L-1 codes, its prefix, equal those of a colliding row) with its codes, the
per-level code counts, and the codes of a few rows asked for. `resolve_subset` runs
`gti.sid.resolve`'s functions on S alone and gives the same codes, collision rates and level
usage as on all N rows; `iter_resolved` streams the final codes [N, L'] back in file order.

Why S suffices: a collision needs equal prefixes; Sinkhorn changes only the last code of
colliding rows and `dedup_reassign` moves a row only to a code free under its own prefix, so
a row outside S never collides, before or after. On S the functions see the same colliding
rows in the same order (S is ascending), so the seeded Sinkhorn sample, ties to the lowest row
and `dedup_extra_level`'s ranks are those of the whole array. With L = 1 every row shares the
empty prefix: one collision puts all N rows in S.

Finding S with bounded memory: rows are hash-partitioned by prefix into P buckets of about
`bucket_rows` rows (spilled to a folder when P > 1); every prefix group lies in one bucket.

What it does not know: embeddings, the quantiser, SID strings, Ray.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gti.sid.quality import usage_from_counts
from gti.sid.resolve import LastCost, dedup_extra_level, dedup_reassign, group_ids

CODES_COLUMN = "codes"
# Rows per bucket when finding S: a bucket's rows, codes and group ids (about 100 B a row at
# 4 levels) are what the scan holds at once.
BUCKET_ROWS = 1 << 21


class CodesWriter:
    """Appends codes int [b, L] to a parquet file, one row group per batch (column `codes`:
    fixed_size_list<int32>[L]); `rows` counts what was written. A context manager."""

    def __init__(self, path: str | Path) -> None:
        self.path, self.rows = Path(path), 0
        self._w: pq.ParquetWriter | None = None

    def write(self, codes: np.ndarray) -> None:
        codes = np.ascontiguousarray(codes, dtype=np.int32)
        arr = pa.FixedSizeListArray.from_arrays(pa.array(codes.reshape(-1)), codes.shape[1])
        table = pa.table({CODES_COLUMN: arr})
        if self._w is None:
            self._w = pq.ParquetWriter(str(self.path), table.schema)
        self._w.write_table(table)
        self.rows += codes.shape[0]

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None

    def __enter__(self) -> CodesWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iter_codes(path: str | Path, batch_rows: int = 65536) -> Iterator[np.ndarray]:
    """The codes file's rows in order, int32 [b, L] per batch (read-only arrays)."""
    pf = pq.ParquetFile(str(path))
    levels = pf.schema_arrow.field(CODES_COLUMN).type.list_size
    for b in pf.iter_batches(batch_size=batch_rows, columns=[CODES_COLUMN]):
        yield b.column(0).flatten().to_numpy().reshape(-1, levels)


def fixed_batches(parts: Iterable, size: int) -> Iterator:
    """A stream of arrays (numpy [b, ...] or Arrow [b]) re-cut into pieces of exactly `size`
    rows (the last may be shorter), so two files' streams can be zipped row for row."""
    buf, have = [], 0
    for p in parts:
        while len(p):
            take = min(size - have, len(p))
            buf.append(p[:take])
            have, p = have + take, p[take:]
            if have == size:
                yield _concat(buf)
                buf, have = [], 0
    if have:
        yield _concat(buf)


def _concat(pieces: list):
    if len(pieces) == 1:
        return pieces[0]
    return np.concatenate(pieces) if isinstance(pieces[0], np.ndarray) else pa.concat_arrays(pieces)


_MUL, _MIX = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9)


def prefix_bucket(codes: np.ndarray, parts: int) -> np.ndarray:
    """Bucket int64 [b] in 0..parts-1 of each row's prefix (first L-1 codes of int [b, L]):
    a fixed hash, so equal prefixes share a bucket in every batch."""
    h = np.zeros(codes.shape[0], np.uint64)
    for j in range(codes.shape[1] - 1):
        h = (h ^ codes[:, j].astype(np.uint64)) * _MUL
        h ^= h >> np.uint64(29)
    h = (h ^ (h >> np.uint64(31))) * _MIX
    return ((h ^ (h >> np.uint64(27))) % np.uint64(parts)).astype(np.int64)


def closed_rows(codes: torch.Tensor) -> torch.Tensor:
    """Bool [m]: rows of codes [m, L] whose prefix is that of a colliding row (every row of a
    complete set of prefix groups, e.g. one bucket)."""
    if codes.shape[0] == 0:
        return torch.zeros(0, dtype=torch.bool)
    gid = group_ids(codes)
    colliding = torch.bincount(gid)[gid] > 1
    if not colliding.any() or codes.shape[1] == 1:
        return colliding.any().expand(codes.shape[0]).clone()
    pid = group_ids(codes[:, :-1])
    hit = torch.zeros(int(pid.max()) + 1, dtype=torch.bool)
    hit[pid[colliding]] = True
    return hit[pid]


@dataclass
class CodeScan:
    """What `scan_codes` keeps of N greedy codes [N, L]: `counts` per level (int64
    [max(K_l, max code + 1)]), S as ascending `rows` int64 [s] with their `codes` int32
    [s, L], the `picked` rows' codes int32 [len(pick), L], and the bucket count `parts`."""

    n: int
    counts: list[np.ndarray]
    rows: np.ndarray
    codes: np.ndarray
    picked: np.ndarray
    parts: int


def _add(total: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """total + counts, the shorter padded with zeros."""
    if len(counts) > len(total):
        total = np.pad(total, (0, len(counts) - len(total)))
    total[: len(counts)] += counts
    return total


class _Buckets:
    """P spill files of (row int64, codes int32 [L]) per bucket under `folder`."""

    def __init__(self, folder: Path, parts: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.parts = folder, parts
        self.files = [(open(folder / f"{i}.rows", "wb"), open(folder / f"{i}.codes", "wb")) for i in range(parts)]

    def add(self, bucket: np.ndarray, rows: np.ndarray, codes: np.ndarray) -> None:
        order = np.argsort(bucket, kind="stable")  # rows stay ascending inside each bucket
        cuts = np.concatenate([[0], np.cumsum(np.bincount(bucket, minlength=self.parts))])
        for i, (fr, fc) in enumerate(self.files):
            sel = order[cuts[i] : cuts[i + 1]]
            if sel.size:
                fr.write(rows[sel].astype(np.int64).tobytes())
                fc.write(np.ascontiguousarray(codes[sel], dtype=np.int32).tobytes())

    def read(self, i: int, levels: int) -> tuple[np.ndarray, np.ndarray]:
        for f in self.files[i]:
            f.close()
        rows = np.fromfile(self.folder / f"{i}.rows", dtype=np.int64)
        return rows, np.fromfile(self.folder / f"{i}.codes", dtype=np.int32).reshape(-1, levels)

    def close(self) -> None:
        for fr, fc in self.files:
            fr.close()
            fc.close()


def scan_codes(path: str | Path, sizes: list[int], tmp_dir: str | Path, bucket_rows: int | None = None,
               pick: np.ndarray | None = None, batch_rows: int = 65536) -> CodeScan:
    """One pass over the codes file (sizes [L]: codebook sizes): per-level counts, the codes of
    rows `pick` [p] (any order), then S found bucket by bucket (about `bucket_rows` rows each,
    `BUCKET_ROWS` when None). `tmp_dir` holds the buckets while P > 1 and is removed after."""
    n = pq.ParquetFile(str(path)).metadata.num_rows
    parts = max(1, -(-n // (bucket_rows or BUCKET_ROWS)))
    pick = np.asarray([] if pick is None else pick, dtype=np.int64)
    pick_order = np.argsort(pick, kind="stable")
    pick_sorted = pick[pick_order]
    counts = [np.zeros(k, np.int64) for k in sizes]
    picked, held, start = [], [], 0
    spill = _Buckets(Path(tmp_dir), parts) if parts > 1 else None
    try:
        for codes in iter_codes(path, batch_rows):
            b = codes.shape[0]
            for lv, k in enumerate(sizes):
                counts[lv] = _add(counts[lv], np.bincount(codes[:, lv], minlength=k))
            lo, hi = np.searchsorted(pick_sorted, [start, start + b])
            picked.append(codes[pick_sorted[lo:hi] - start])
            if spill is None:
                held.append(codes)
            else:
                spill.add(prefix_bucket(codes, parts), np.arange(start, start + b), codes)
            start += b
        levels = len(sizes)
        buckets = ([(np.arange(n), np.concatenate(held) if held else np.zeros((0, levels), np.int32))]
                   if spill is None else (spill.read(i, levels) for i in range(parts)))
        keep_rows, keep_codes = [], []
        for rows, codes in buckets:
            mask = closed_rows(torch.from_numpy(codes.astype(np.int64))).numpy()
            keep_rows.append(rows[mask])
            keep_codes.append(codes[mask])
    finally:
        if spill is not None:
            spill.close()
            shutil.rmtree(tmp_dir, ignore_errors=True)
    rows, codes = np.concatenate(keep_rows), np.concatenate(keep_codes)
    order = np.argsort(rows, kind="stable")
    got = np.concatenate(picked) if picked else np.zeros((0, len(sizes)), np.int32)
    out = np.empty_like(got)
    out[pick_order] = got
    return CodeScan(n, counts, rows[order], np.ascontiguousarray(codes[order]), out, parts)


def subset_collision_rate(n: int, sub: torch.Tensor) -> float:
    """`collision_rate` of all n rows from S's codes [s, L'] alone (every row outside S is
    unique): 1 - (n - s + unique in S) / n, the same division as on the whole array."""
    if n == 0:
        return 0.0
    uniq = int(group_ids(sub).max()) + 1 if sub.shape[0] else 0
    return 1.0 - (n - sub.shape[0] + uniq) / n


def _counts_with(scan: CodeScan, sub: torch.Tensor, sizes: list[int]) -> list[np.ndarray]:
    """Per-level counts of all N rows once S's codes are `sub` [s, L'] (L' = L or L + 1: an
    extra level is 0 outside S), trimmed as bincount(minlength=K_l) would give them."""
    out, new = [], sub.numpy()
    for lv, k in enumerate(sizes):
        if lv < len(scan.counts):
            c = _add(scan.counts[lv].copy(), -np.bincount(scan.codes[:, lv], minlength=k))
            c = _add(c, np.bincount(new[:, lv], minlength=k))
        else:
            c = np.bincount(new[:, lv], minlength=k)
            c[0] += scan.n - new.shape[0]
        used = np.flatnonzero(c)
        out.append(c[: max(k, int(used[-1]) + 1 if used.size else 0)])
    return out


@dataclass
class Resolved:
    """S's final codes `codes` long [s, L'] (rows `scan.rows`), the codebook sizes [L'] and
    the figures of all N rows: collision rates, Sinkhorn rounds, (utilisation, perplexity)
    after Sinkhorn on the quantiser's levels (`util_q`, `perp_q`) and of the final codes."""

    codes: torch.Tensor
    sizes: list[int]
    before: float
    after_sinkhorn: float
    after: float
    sinkhorn_rounds: int
    util_q: list[float]
    perp_q: list[float]
    util: list[float]
    perp: list[float]


Spread = Callable[[torch.Tensor, LastCost], tuple[torch.Tensor, int]]


def resolve_subset(scan: CodeScan, sizes: list[int], last_cost: LastCost, dedup: str,
                   spread: Spread | None = None) -> Resolved:
    """Sinkhorn (`spread(codes [s, L], last_cost) -> (codes, rounds)`, e.g. `sinkhorn_resolve`
    with the stage's settings; None: none), then `dedup` ("extra_level" or "reassign") on S,
    as the whole-array calls would. `last_cost(positions)` scores positions into `scan.rows`
    (the caller maps them to items); sizes [L]: the quantiser's codebook sizes."""
    sub = torch.from_numpy(scan.codes.astype(np.int64))
    before = after_sk = subset_collision_rate(scan.n, sub)
    rounds = 0
    if spread is not None and before > 0:
        sub, rounds = spread(sub, last_cost)
        after_sk = subset_collision_rate(scan.n, sub)
    util_q, perp_q = usage_from_counts(_counts_with(scan, sub, list(sizes)), sizes)
    if sub.shape[0] == 0:
        final = sub
    else:
        final = dedup_extra_level(sub) if dedup == "extra_level" else dedup_reassign(sub, last_cost)
    out_sizes = list(sizes)
    if final.shape[1] > len(out_sizes):
        out_sizes.append(int(final[:, -1].max()) + 1)  # every row outside S has 0 there
    util, perp = usage_from_counts(_counts_with(scan, final, out_sizes), out_sizes)
    return Resolved(final, out_sizes, before, after_sk, subset_collision_rate(scan.n, final), rounds,
                    util_q, perp_q, util, perp)


def iter_resolved(path: str | Path, rows: np.ndarray, final: torch.Tensor, batch_rows: int = 65536
                  ) -> Iterator[np.ndarray]:
    """All N final codes int32 [b, L'] in file order, `batch_rows` per batch (the last may be
    shorter): the codes file's, with rows `rows` [s] (ascending) replaced by `final` [s, L']
    (an extra level is 0 elsewhere)."""
    sub = final.to(torch.int32).numpy()
    width = sub.shape[1] if sub.ndim == 2 and sub.shape[0] else None

    def batches() -> Iterator[np.ndarray]:
        start = 0
        for codes in iter_codes(path, batch_rows):
            b = codes.shape[0]
            out = np.zeros((b, width or codes.shape[1]), np.int32)
            out[:, : codes.shape[1]] = codes
            lo, hi = np.searchsorted(rows, [start, start + b])
            out[rows[lo:hi] - start] = sub[lo:hi]
            start += b
            yield out

    return fixed_batches(batches(), batch_rows)
