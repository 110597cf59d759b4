"""Collision resolution with the codes on disk: only the rows that can collide come into memory,
one bucket of them at a time.

What it is for: keeping the `sid` stage's driver memory independent of the catalog size. Greedy
codes int32 [N, L] are written batch by batch to a parquet file (`CodesWriter`); `scan_codes`
streams it once and keeps the closed set S (every row whose prefix, its first L-1 codes, equals
that of a colliding row), hash-partitioned by prefix into buckets; `resolve_subset` runs
`gti.sid.resolve`'s functions on S alone with the same codes and figures as on all N rows;
`iter_resolved` streams the final codes [N, L'] back in file order.

What it does not know: embeddings, the quantiser, SID strings, Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gti.common.parquet_stream import open_parquet
from gti.sid.buckets import ROWS, BucketCodes, SBuckets, SortedPieces
from gti.sid.quality import usage_from_counts
from gti.sid.resolve import LastCodes, LastCost, dedup_extra_level, dedup_reassign, group_ids

CODES_COLUMN = "codes"
# Rows per bucket when finding S (the sid stage passes `sid.resolve_bucket_rows`): a bucket's
# rows, codes and group ids (about 100 B a row at 4 levels) are what the scan holds at once.
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
    pf = open_parquet(path)
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


def closed_groups(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Of codes [m, L] (a complete set of prefix groups, e.g. one bucket): (bool [m] rows whose
    prefix is that of a colliding row, bool [m] colliding rows, distinct SIDs among the m)."""
    if codes.shape[0] == 0:
        return torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.bool), 0
    gid = group_ids(codes)
    colliding = torch.bincount(gid)[gid] > 1
    groups = int(gid.max()) + 1
    if not colliding.any() or codes.shape[1] == 1:
        return colliding.any().expand(codes.shape[0]).clone(), colliding, groups
    pid = group_ids(codes[:, :-1])
    hit = torch.zeros(int(pid.max()) + 1, dtype=torch.bool)
    hit[pid[colliding]] = True
    return hit[pid], colliding, groups


def closed_rows(codes: torch.Tensor) -> torch.Tensor:
    """Bool [m]: rows of codes [m, L] whose prefix is that of a colliding row (every row of a
    complete set of prefix groups, e.g. one bucket)."""
    return closed_groups(codes)[0]


# The name of each bucket's final codes in `CodeScan.buckets` (written by `resolve_subset`).
FINAL = "final"


@dataclass
class CodeScan:
    """What `scan_codes` keeps of N greedy codes [N, L]: `counts` per level of all N rows and
    `outside` of the rows outside S (int64 [max(K_l, max code + 1)] each); S bucket by bucket
    in `buckets` (`ROWS` int64 [s_i] ascending, `codes` int32 [s_i, L], `coll`: the colliding
    rows); `size` (s) and `unique` (distinct SIDs in S); the `picked` rows' codes int32
    [len(pick), L]; the bucket count `parts`. `close` (or leaving `with`) removes the buckets."""

    n: int
    counts: list[np.ndarray]
    outside: list[np.ndarray]
    buckets: SBuckets
    size: int
    unique: int
    picked: np.ndarray
    parts: int

    def close(self) -> None:
        self.buckets.close()

    def __enter__(self) -> CodeScan:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _add(total: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """total + counts, the shorter padded with zeros."""
    if len(counts) > len(total):
        total = np.pad(total, (0, len(counts) - len(total)))
    total[: len(counts)] += counts
    return total


class _Spill:
    """P spill files of (row int64, codes int32 [L]) per bucket under `folder`: every row,
    until `read` takes a bucket back (and deletes its files)."""

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
        paths = (self.folder / f"{i}.rows", self.folder / f"{i}.codes")
        rows = np.fromfile(paths[0], dtype=np.int64)
        codes = np.fromfile(paths[1], dtype=np.int32).reshape(-1, levels)
        for p in paths:
            p.unlink()
        return rows, codes

    def close(self) -> None:
        for fr, fc in self.files:
            fr.close()
            fc.close()


def _keep_closed(buckets: SBuckets, i: int, rows: np.ndarray, codes: np.ndarray, s_counts: list[np.ndarray]) -> int:
    """Put bucket i's part of S (of its `rows` [b] ascending with `codes` int32 [b, L]) into
    `buckets`, add S's per-level counts to `s_counts`; returns the distinct SIDs in it."""
    closed, colliding, groups = closed_groups(torch.from_numpy(codes.astype(np.int64)))
    closed, colliding = closed.numpy(), colliding.numpy()
    s_codes = codes[closed]
    buckets.put(i, ROWS, rows[closed])
    buckets.put(i, BucketCodes.CODES, s_codes)
    buckets.put(i, BucketCodes.COLL, rows[colliding])
    for lv in range(len(s_counts)):
        s_counts[lv] = _add(s_counts[lv], np.bincount(s_codes[:, lv], minlength=len(s_counts[lv])))
    return groups - (len(rows) - s_codes.shape[0])  # rows outside S are SIDs of their own


def scan_codes(path: str | Path, sizes: list[int], tmp_dir: str | Path, bucket_rows: int | None = None,
               pick: np.ndarray | None = None, batch_rows: int = 65536) -> CodeScan:
    """One pass over the codes file (sizes [L]: codebook sizes): per-level counts, the codes of
    rows `pick` [p] (any order), then S found bucket by bucket (about `bucket_rows` rows each,
    `BUCKET_ROWS` when None) and kept so: in memory for one bucket, else in `tmp_dir` (emptied
    first) until the scan is closed (removed at once on an error here)."""
    n = pq.ParquetFile(str(path)).metadata.num_rows
    parts = max(1, -(-n // (bucket_rows or BUCKET_ROWS)))
    pick = np.asarray([] if pick is None else pick, dtype=np.int64)
    pick_order = np.argsort(pick, kind="stable")
    pick_sorted = pick[pick_order]
    counts = [np.zeros(k, np.int64) for k in sizes]
    picked, held, start = [], [], 0
    buckets = SBuckets(parts, Path(tmp_dir) if parts > 1 else None)
    spill = _Spill(Path(tmp_dir), parts) if parts > 1 else None
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
        parts_iter = ([(np.arange(n), np.concatenate(held) if held else np.zeros((0, levels), np.int32))]
                      if spill is None else (spill.read(i, levels) for i in range(parts)))
        del held
        s_counts, unique = [np.zeros(k, np.int64) for k in sizes], 0
        for i, (rows, codes) in enumerate(parts_iter):
            unique += _keep_closed(buckets, i, rows, codes, s_counts)
            del rows, codes  # one spilled bucket in memory at a time
    except BaseException:
        buckets.close()
        raise
    finally:
        if spill is not None:
            spill.close()
    outside = [_add(c.copy(), -sc) for c, sc in zip(counts, s_counts)]
    got = np.concatenate(picked) if picked else np.zeros((0, len(sizes)), np.int32)
    out = np.empty_like(got)
    out[pick_order] = got
    return CodeScan(n, counts, outside, buckets, buckets.size(), unique, out, parts)


def _rate(n: int, s: int, unique: int) -> float:
    """`collision_rate` of all n rows from S's s rows with `unique` distinct SIDs (every row
    outside S is unique): 1 - (n - s + unique) / n, the same division as on the whole array."""
    if n == 0:
        return 0.0
    return 1.0 - (n - s + unique) / n


def _counts_with(outside: list[np.ndarray], n_out: int, inside: list[np.ndarray], sizes: list[int]
                 ) -> list[np.ndarray]:
    """Per-level counts of all N rows: `outside` (the n_out rows outside S, per quantiser
    level) plus `inside` (S's codes, per level [L']; an extra level is 0 outside S), trimmed
    as bincount(minlength=K_l) would give them."""
    out = []
    for lv, k in enumerate(sizes):
        if lv < len(outside):
            c = _add(outside[lv].copy(), inside[lv])
        else:
            c = inside[lv].copy()
            c[0] += n_out
        used = np.flatnonzero(c)
        out.append(c[: max(k, int(used[-1]) + 1 if used.size else 0)])
    return out


@dataclass
class Resolved:
    """The codebook sizes [L'] of the final codes (each bucket's are in the scan's buckets as
    `FINAL`) and the figures of all N rows: collision rates, Sinkhorn rounds, (utilisation,
    perplexity) after Sinkhorn on the quantiser's levels (`util_q`, `perp_q`) and of the final
    codes."""

    sizes: list[int]
    before: float
    after_sinkhorn: float
    after: float
    sinkhorn_rounds: int
    util_q: list[float]
    perp_q: list[float]
    util: list[float]
    perp: list[float]


Spread = Callable[[LastCodes, LastCost], int]

# Why S suffices: a collision needs equal prefixes; Sinkhorn changes only the last code of
# colliding rows and `dedup_reassign` moves a row only to a code free under its own prefix, so a
# row outside S never collides, before or after. On S the functions see the same colliding rows in
# the same order (S is ascending), so the seeded Sinkhorn sample, ties to the lowest row and
# `dedup_extra_level`'s ranks are those of the whole array. With L = 1 every row shares the empty
# prefix: one collision puts all N rows in S (and in one bucket).
# Bounded memory: every prefix group lies in one bucket, so de-duplication runs a bucket at a time.
# Sinkhorn's decisions are global (prices from a sample of all colliders, a round kept or undone on
# the count of all colliders), so each round scores its row windows across the buckets, holding
# one window and one bucket at a time. The figures are integer sums over the buckets, so they are
# those of the whole array exactly.


def resolve_subset(scan: CodeScan, sizes: list[int], last_cost: LastCost, dedup: str,
                   spread: Spread | None = None) -> Resolved:
    """Sinkhorn (`spread(store, last_cost) -> rounds`, e.g. `sinkhorn_rounds` with the stage's
    settings; None: none) on S's last codes, then `dedup` ("extra_level" or "reassign") bucket
    by bucket: the codes and figures of the whole-array calls. `last_cost(rows)` scores global
    rows (LongTensor [m]) -> [m, K]; sizes [L]: the quantiser's codebook sizes. Holds one
    bucket of S at a time (and Sinkhorn one sample and window: `BucketCodes`)."""
    before = _rate(scan.n, scan.size, scan.unique)
    rounds = 0
    if spread is not None and before > 0:
        rounds = spread(BucketCodes(scan.buckets), last_cost)
    return _dedup_buckets(scan, list(sizes), last_cost, dedup, before, rounds)


def _dedup_buckets(scan: CodeScan, sizes: list[int], last_cost: LastCost, dedup: str, before: float,
                   rounds: int) -> Resolved:
    """One pass over the buckets: S's figures after Sinkhorn, `dedup` on each bucket (whole
    prefix groups: `gti.sid.resolve` decides within them), its final codes int32 [s_i, L or
    L + 1] stored as `FINAL`, and the final figures, summed over the buckets."""
    levels, b = len(sizes), scan.buckets
    mid, fin = [np.zeros(k, np.int64) for k in sizes], [np.zeros(k, np.int64) for k in sizes]
    uniq_mid = uniq_fin = 0
    extra, plain, extended = np.zeros(1, np.int64), 0, False  # the extra level's counts; rows without it
    for i in range(b.parts):
        if not b.length(i):
            continue
        rows = torch.from_numpy(b.get(i, ROWS))
        codes = torch.from_numpy(b.get(i, BucketCodes.CODES).astype(np.int64))
        uniq_mid += int(group_ids(codes).max()) + 1
        _add_levels(mid, codes)
        if dedup == "extra_level":
            final = dedup_extra_level(codes)
        else:
            final = dedup_reassign(codes, lambda pos, rows=rows: last_cost(rows[pos]))
        uniq_fin += int(group_ids(final).max()) + 1
        _add_levels(fin, final[:, :levels])
        if final.shape[1] > levels:
            extended, extra = True, _add(extra, np.bincount(final[:, levels].numpy()))
        else:
            plain += final.shape[0]  # 0 at the extra level, if one is added
        b.put(i, FINAL, final.to(torch.int32).numpy())
        del rows, codes, final  # one bucket held at a time
    b.drop(BucketCodes.CODES)
    b.drop(BucketCodes.COLL)
    n, s = scan.n, scan.size
    util_q, perp_q = usage_from_counts(_counts_with(scan.outside, n - s, mid, sizes), sizes)
    out_sizes = list(sizes)
    if extended:
        out_sizes.append(len(extra))  # its largest code + 1: every row outside S has 0 there
        extra[0] += plain
        fin.append(extra)
    util, perp = usage_from_counts(_counts_with(scan.outside, n - s, fin, out_sizes), out_sizes)
    return Resolved(out_sizes, before, _rate(n, s, uniq_mid), _rate(n, s, uniq_fin), rounds, util_q, perp_q,
                    util, perp)


def _add_levels(counts: list[np.ndarray], codes: torch.Tensor) -> None:
    """counts[l] += bincount of codes[:, l] (codes long [m, L]), in place in the list."""
    for lv in range(len(counts)):
        counts[lv] = _add(counts[lv], np.bincount(codes[:, lv].numpy(), minlength=len(counts[lv])))


# Rows per piece of each bucket's final codes while they are merged back into file order.
MERGE_ROWS = 8192


def iter_resolved(path: str | Path, buckets: SBuckets, width: int, batch_rows: int = 65536
                  ) -> Iterator[np.ndarray]:
    """All N final codes int32 [b, width] in file order, `batch_rows` per batch (the last may
    be shorter): the codes file's, with S's rows replaced by each bucket's `FINAL` codes,
    merged by row (an extra level is 0 elsewhere). Holds a batch and a piece of `MERGE_ROWS`
    rows per bucket."""

    def batches() -> Iterator[np.ndarray]:
        merges = [SortedPieces(buckets, i, FINAL, MERGE_ROWS) for i in range(buckets.parts) if buckets.length(i)]
        start = 0
        for codes in iter_codes(path, batch_rows):
            b = codes.shape[0]
            out = np.zeros((b, max(width, codes.shape[1])), np.int32)
            out[:, : codes.shape[1]] = codes
            for m in merges:
                for rows, sub in m.below(start + b):
                    out[rows - start, : sub.shape[1]] = sub
            start += b
            yield out

    return fixed_batches(batches(), batch_rows)
