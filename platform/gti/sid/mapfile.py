"""The SID map as a table: SID strings built column-wise, and the map's order-free hash.

What it is for: `sid_strings(codec, codes)` (one Arrow string array for codes [N, L], no
Python object per item) and `sid_map_hash(item_ids, sids)` (sha256 of the item -> SID lines
in item_id order: the identity every model folder records and evaluation checks).

What it does not know: how codes were found, tokenizers, or files.
"""

from __future__ import annotations

import hashlib

import pyarrow as pa
import torch

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
        lines = pc.binary_join_element_wise(ids.take(idx), sid_arr.take(idx), "\t")
        h.update(("\n".join(lines.to_pylist()) + "\n").encode())
    return h.hexdigest()[:16]


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
