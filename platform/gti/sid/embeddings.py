"""Reading the `embed` stage's embeddings.parquet for the quantiser: checks, random row access,
the last level's residuals, and batch assignment.

What it is for: `check_embeddings` (one streamed pass: count, dim, non-finite rows named),
`embedding_matrix` (an Arrow list column -> float32 [N, dim], no copy where possible),
`EmbeddingRows` (rows by index with one row group in memory at a time), `LastResiduals`
(what the last quantiser level sees per item, cached up to a budget, for collision resolution)
and `AssignBatch` (a callable class for Ray Data's `map_batches`: greedy codes for a batch,
the quantiser loaded once per actor from bytes).
Pure: pyarrow, numpy and torch, no Ray.

What it does not know: how the embeddings were made, or how the quantiser was trained.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from gti.common.errors import DataError
from gti.common.parquet_stream import open_parquet
from gti.sid.quantizer import CONFIG_NAME, WEIGHTS_NAME, load_quantizer

def embedding_matrix(col: pa.ChunkedArray | pa.Array, path: str) -> np.ndarray:
    """fixed_size_list<float32>[dim] (or list<float>) column -> float32 [N, dim] (no copy
    for a single fixed-size chunk)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_fixed_size_list(col.type):
        dim = col.type.list_size
        flat = col.flatten()
        if col.null_count:
            raise DataError(f"{path}: column 'embedding' has {col.null_count} null rows")
        return flat.to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(-1, dim)
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        rows = col.to_pylist()
        lens = {len(r) if r is not None else -1 for r in rows}
        if len(lens) != 1 or -1 in lens:
            raise DataError(f"{path}: column 'embedding' rows differ in length or are null")
        return np.asarray(rows, dtype=np.float32)
    raise DataError(f"{path}: column 'embedding' has type {col.type}, expected a list of floats")


def check_embeddings(path: str | Path, batch_rows: int = 65536) -> tuple[int, int]:
    """Stream the file once: (n_items, dim); DataError naming item ids of non-finite rows."""
    pf = open_parquet(path)
    names = pf.schema_arrow.names
    for col in ("item_id", "embedding"):
        if col not in names:
            raise DataError(f"{path}: missing column '{col}' (has {names})")
    n, dim, bad = 0, None, []
    for batch in pf.iter_batches(batch_size=batch_rows, columns=["item_id", "embedding"]):
        x = embedding_matrix(batch.column("embedding"), str(path))
        if dim is None:
            dim = x.shape[1]
        ok = np.isfinite(x).all(axis=1)
        if not ok.all():
            ids = batch.column("item_id").to_pylist()
            bad.extend(ids[i] for i in np.flatnonzero(~ok)[:5])
        n += x.shape[0]
    if bad:
        raise DataError(
            f"{path}: non-finite (NaN/inf) embedding for item_id(s) {', '.join(map(str, bad[:5]))}"
            + (" and more" if len(bad) > 5 else "")
        )
    if n == 0 or dim is None:
        raise DataError(f"{path}: no embeddings")
    return n, dim


class EmbeddingRows:
    """Random access to rows of embeddings.parquet with one row group in memory at a time.

    Why not `pq.read_table(...).column("embedding").take(rows)`: that decodes the whole column
    (N x dim x 4 bytes) and `take` first joins its chunks into a second full copy: at millions of
    items, gigabytes on the driver (bench/scale_memory/RESULTS.md, "Scale: 5M-item catalog, bounded
    memory").
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.pf = open_parquet(self.path)
        md = self.pf.metadata
        self.starts = np.cumsum([0] + [md.row_group(i).num_rows for i in range(md.num_row_groups)])
        self.n = int(self.starts[-1])

    def read(self, rows: np.ndarray) -> torch.Tensor:
        """Embeddings of row indices `rows` [m] (any order, repeats allowed): float32 [m, dim]."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.n):
            raise IndexError(f"{self.path}: row index out of range 0..{self.n - 1}")
        group = np.searchsorted(self.starts, rows, side="right") - 1
        out: np.ndarray | None = None
        for g in np.unique(group):
            sel = np.nonzero(group == g)[0]
            col = self.pf.read_row_group(int(g), columns=["embedding"]).column(0)
            m = embedding_matrix(col.take(pa.array(rows[sel] - self.starts[g])), self.path)
            if out is None:
                out = np.empty((rows.size, m.shape[1]), dtype=np.float32)
            out[sel] = m
        if out is None:  # no rows asked for
            return torch.zeros(0, self.pf.schema_arrow.field("embedding").type.list_size)
        return torch.from_numpy(out)


class LastResiduals:
    """What the quantiser's last level sees, per item: residuals [m, code_dim] for given rows.

    Collision resolution re-scores the last level of colliding items in every round; the
    residual depends only on the item and its first L-1 codes, which resolution never changes.
    So the first `cache_mb` MB of residuals are kept, and an item in the cache is read and
    encoded once. Items past the cache are recomputed on each call. Where millions of items
    collide (bench/scale_memory/RESULTS.md, "Scale: 5M-item catalog, bounded memory"), a round
    re-reads the uncached ones instead of holding GBs on the driver. The cache is found by
    row (the cached rows, sorted, with their slots: 16 B per cached item, nothing per item of
    the catalog), so rows are the reader's own, any of N. Each call reads and encodes in
    chunks of `chunk` rows. Bounding the size of its output is the caller's job.
    """

    def __init__(self, q, rows_reader: EmbeddingRows, chunk: int = 65536, cache_mb: float = 1024) -> None:
        self.q, self.reader, self.chunk = q, rows_reader, chunk
        self.cache_bytes = int(cache_mb * 2**20)
        self.keys = np.zeros(0, dtype=np.int64)  # cached rows, ascending
        self.slots = np.zeros(0, dtype=np.int64)  # their rows of `res`
        self.res: torch.Tensor | None = None  # [capacity, code_dim]; rows 0..used-1 filled
        self.used = 0
        self.encoded = 0  # rows read and encoded so far (cache misses), for tests and logs

    def _slots_of(self, rows: np.ndarray) -> np.ndarray:
        """Slot in `res` of each of rows [m], -1 where not cached."""
        if not self.keys.size:
            return np.full(rows.size, -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self.keys, rows), self.keys.size - 1)
        return np.where(self.keys[pos] == rows, self.slots[pos], -1)

    def __call__(self, rows: np.ndarray) -> torch.Tensor:
        rows = np.asarray(rows, dtype=np.int64)
        slots = self._slots_of(rows)
        miss = np.nonzero(slots < 0)[0]
        uniq, inv = np.unique(rows[miss], return_inverse=True)
        fresh = [self.q.last_residual(self.reader.read(uniq[s : s + self.chunk])).float()
                 for s in range(0, uniq.size, self.chunk)]
        self.encoded += uniq.size
        if fresh:
            fresh_t = torch.cat(fresh)
            self._keep(uniq, fresh_t)
        if self.res is None and not fresh:
            raise ValueError("no residuals computed")
        dim = self.res.shape[1] if self.res is not None else fresh_t.shape[1]
        out = torch.empty(rows.size, dim)
        hit = np.nonzero(slots >= 0)[0]
        if hit.size:
            out[torch.from_numpy(hit)] = self.res[torch.from_numpy(slots[hit])]
        if miss.size:
            out[torch.from_numpy(miss)] = fresh_t[torch.from_numpy(inv.reshape(-1))]
        return out

    def _keep(self, rows: np.ndarray, res: torch.Tensor) -> None:
        """Cache as many of these residuals (rows [m] ascending, none cached yet) as the budget
        still allows."""
        limit = max(self.cache_bytes // (res.shape[1] * 4), 0)
        take = min(rows.size, limit - self.used)
        if take <= 0:
            return
        cap = 0 if self.res is None else self.res.shape[0]
        if self.used + take > cap:
            # Capacity doubles (up to the budget), so caching round after round copies O(total)
            # rows, not O(total^2) as concatenating every chunk would.
            bigger = torch.empty(min(max(self.used + take, 2 * cap, self.chunk), limit), res.shape[1])
            if self.res is not None:
                bigger[: self.used] = self.res[: self.used]
            self.res = bigger
        self.res[self.used : self.used + take] = res[:take]
        keys = np.concatenate([self.keys, rows[:take]])
        slots = np.concatenate([self.slots, np.arange(self.used, self.used + take)])
        order = np.argsort(keys, kind="stable")  # two ascending runs: a linear merge
        self.keys, self.slots = keys[order], slots[order]
        self.used += take


class AssignBatch:
    """Callable class for `map_batches`: loads the quantiser once per actor (from bytes, so
    it works on any node), then maps a batch of embeddings to greedy codes."""

    def __init__(self, weights: bytes, meta: str, device: str = "cpu") -> None:
        # A folder of its own for load_quantizer, removed once loaded (one per actor adds up).
        with tempfile.TemporaryDirectory(prefix="gti_sid_q_") as tmp:
            d = Path(tmp)
            (d / WEIGHTS_NAME).write_bytes(weights)
            (d / CONFIG_NAME).write_text(meta)
            self.q = load_quantizer(d).to(device)
        self.device = device

    def __call__(self, batch: pa.Table) -> dict:
        with warnings.catch_warnings():
            # Arrow's buffer is read-only; encode never writes to its input, so no copy.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            x = torch.from_numpy(embedding_matrix(batch.column("embedding"), "embeddings")).to(self.device)
        with torch.inference_mode():
            codes = self.q.encode(x)
        return {"codes": codes.to(torch.int32).cpu().numpy()}
