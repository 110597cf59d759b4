"""gti/sid/mapfile.py: SID strings built column-wise and the order-free SID map hash."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch


def test_sid_strings_and_hash_match_the_per_item_definitions():
    import hashlib

    from gti.sid.codec import SidCodec
    from gti.sid.mapfile import sid_map_hash, sid_strings

    codec = SidCodec(3, [4, 5, 6], "<{level}_{code}>")
    codes = torch.tensor([[0, 4, 5], [3, 0, 1], [1, 1, 1]])
    got = sid_strings(codec, codes)
    assert got.to_pylist() == codec.to_strings(codes)
    with pytest.raises(ValueError, match="level 1"):
        sid_strings(codec, torch.tensor([[0, 5, 0]]))
    ids = ["b", "é", "a", "Z", "ab"]
    sids = [f"<a_{i}>" for i in range(5)]
    ref = hashlib.sha256()
    for i in sorted(range(5), key=lambda i: ids[i]):
        ref.update(f"{ids[i]}\t{sids[i]}\n".encode())
    want = ref.hexdigest()[:16]
    assert sid_map_hash(ids, sids) == want
    assert sid_map_hash(pa.array(ids), pa.array(sids), chunk=2) == want
    assert sid_map_hash(ids[::-1], sids[::-1]) == want  # row order does not matter
