"""The SID map as a table: SID strings built column-wise, and the map's order-free hash.

What it is for: `sid_strings(codec, codes)` (one Arrow string array for codes [N, L], no
Python object per item) and `sid_map_hash(item_ids, sids)` (sha256 of the item -> SID lines
in item_id order: the identity every model folder records and evaluation checks). The same
hash with bounded memory for a map written batch by batch: `SortedMapHash` (fed in order, for
ids that arrive sorted) and `sid_map_hash_file` (any row order: sorted runs spilled to a
folder, then merged).

What it does not know: how codes were found, tokenizers, or where a map file comes from.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gti.common.parquet_stream import iter_parquet
from gti.sid.codec import SidCodec


def sid_map_hash(item_ids, sids, chunk: int = 65536) -> str:
    """sha256 (16 hex) of the item -> SID mapping, independent of row order: the lines
    "item_id\tsid\n" in item_id order (code-point order, as Python sorts str). Takes lists
    or Arrow string arrays; hashes `chunk` lines at a time."""
    import pyarrow.compute as pc

    ids = pa.array(item_ids, pa.string()) if not isinstance(item_ids, pa.Array) else item_ids
    sid_arr = pa.array(sids, pa.string()) if not isinstance(sids, pa.Array) else sids
    order = pc.sort_indices(ids)  # UTF-8 byte order == code-point order
    h = hashlib.sha256()
    for s in range(0, len(order), chunk):
        idx = order.slice(s, chunk)
        _hash_lines(h, ids.take(idx), sid_arr.take(idx))
    return h.hexdigest()[:16]


def _hash_lines(h, ids, sids) -> None:
    """Feed the lines "item_id\tsid\n" of aligned string arrays [n] (n >= 1) to sha256 `h`."""
    import pyarrow.compute as pc

    lines = pc.binary_join_element_wise(ids, sids, "\t")
    h.update(("\n".join(lines.to_pylist()) + "\n").encode())


class SortedMapHash:
    """`sid_map_hash` of a map fed batch by batch in row order, while the ids arrive in
    ascending code-point order (equal ids kept in row order, as the stable sort does): then
    the rows are already in hash order and each batch is hashed as it comes, holding nothing.
    The first batch out of order (within itself or after the previous one) sets `in_order`
    False and later batches are ignored: the caller then hashes the finished file with
    `sid_map_hash_file`."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._last: str | None = None
        self.in_order = True

    def update(self, item_ids: pa.Array, sids: pa.Array) -> bool:
        """Hash one batch (string arrays [b]); returns `in_order`."""
        import pyarrow.compute as pc

        if not self.in_order or len(item_ids) == 0:
            return self.in_order
        ids = item_ids.cast(pa.string())
        # Arrow compares strings bytewise, and UTF-8 byte order is code-point order.
        inside = len(ids) < 2 or pc.all(pc.less_equal(ids.slice(0, len(ids) - 1), ids.slice(1))).as_py()
        if not inside or (self._last is not None and ids[0].as_py() < self._last):
            self.in_order = False
            return False
        _hash_lines(self._h, ids, sids.cast(pa.string()))
        self._last = ids[len(ids) - 1].as_py()
        return True

    def hexdigest(self) -> str:
        """The 16-hex hash (`sid_map_hash` of all rows fed); ValueError if they were not in order."""
        if not self.in_order:
            raise ValueError("ids arrived out of order: hash the file with sid_map_hash_file")
        return self._h.hexdigest()[:16]


_ORDER = [("item_id", "ascending"), ("row", "ascending")]  # ties in row order, as the stable sort


def sid_map_hash_file(path: str | Path, tmp_dir: str | Path, run_rows: int = 1 << 20, batch_rows: int = 16384) -> str:
    """`sid_map_hash` of a map file (columns item_id, sid; rows in any order) without holding
    the columns: sorted runs of `run_rows` rows (with their row numbers) are written under
    `tmp_dir` (removed after), then merged `batch_rows` rows per run at a time. Memory: about
    run_rows + (N / run_rows) x batch_rows rows."""
    import pyarrow.compute as pc

    tmp = Path(tmp_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        runs, start = [], 0
        for i, b in enumerate(iter_parquet(path, run_rows, columns=["item_id", "sid"])):
            t = pa.table({"item_id": b.column("item_id").cast(pa.string()), "sid": b.column("sid").cast(pa.string()),
                          "row": pa.array(np.arange(start, start + b.num_rows, dtype=np.int64))})
            start += b.num_rows
            runs.append(tmp / f"run-{i:05d}.parquet")
            pq.write_table(t.take(pc.sort_indices(t, sort_keys=_ORDER)), str(runs[-1]), row_group_size=batch_rows)
        h = hashlib.sha256()
        for t in _merge_runs(runs, batch_rows):
            _hash_lines(h, t.column("item_id"), t.column("sid"))
        return h.hexdigest()[:16]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _merge_runs(paths: list[Path], batch_rows: int):
    """Tables (item_id, sid, row) of the sorted run files merged into one ascending
    (item_id, row) order, one table per step. Each step takes from every run's buffer the rows
    up to the smallest buffer end (the frontier): rows not read yet all come after it."""
    import pyarrow.compute as pc

    readers = [iter_parquet(p, batch_rows) for p in paths]
    bufs: list[pa.Table | None] = [None] * len(readers)
    while True:
        for i in range(len(readers)):
            while readers[i] is not None and (bufs[i] is None or bufs[i].num_rows == 0):
                b = next(readers[i], None)
                bufs[i] = None if b is None else pa.Table.from_batches([b])
                if b is None:
                    readers[i] = None
        live = [i for i, t in enumerate(bufs) if t is not None and t.num_rows]
        if not live:
            return
        f_id, f_row = min((bufs[i].column("item_id")[-1].as_py(), bufs[i].column("row")[-1].as_py()) for i in live)
        parts = []
        for i in live:
            t = bufs[i]
            ids = t.column("item_id")
            head = pc.or_(pc.less(ids, f_id), pc.and_(pc.equal(ids, f_id), pc.less_equal(t.column("row"), f_row)))
            k = int(pc.sum(head).as_py() or 0)  # a sorted run: the rows up to the frontier are its head
            parts.append(t.slice(0, k))
            bufs[i] = t.slice(k)
        out = pa.concat_tables(parts)
        yield out.take(pc.sort_indices(out, sort_keys=_ORDER))


def sid_strings(codec: SidCodec, codes: torch.Tensor) -> pa.Array:
    """SID strings for codes [N, L] as one Arrow string array, built column-wise (no Python
    object per item: at millions of items a list of str and of code lists costs GBs)."""
    import pyarrow.compute as pc

    cols = []
    for lv in range(codes.shape[1]):
        c = codes[:, lv]
        if c.numel() and (int(c.min()) < 0 or int(c.max()) >= codec.codebook_sizes[lv]):
            raise ValueError(f"level {lv} code out of range 0..{codec.codebook_sizes[lv] - 1}")
        table = pa.array([codec.token(lv, k) for k in range(codec.codebook_sizes[lv])], pa.string())
        cols.append(table.take(pa.array(c.numpy())))
    return pc.binary_join_element_wise(*cols, "")
