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


def _ids_and_sids(n: int, seed: int = 0):
    """n random ids (ASCII, non-ASCII and a few duplicates with different SIDs) and SIDs."""
    import random

    r = random.Random(seed)
    alphabet = "abcXYZ019éß中"
    ids = ["".join(r.choice(alphabet) for _ in range(r.randint(1, 4))) for _ in range(n)]
    ids[5] = ids[9] = ids[2]  # duplicates: ties go in row order, as the stable sort
    return ids, [f"<a_{r.randint(0, 99)}><b_{i % 7}>" for i in range(n)]


def test_sorted_stream_hash_equals_the_whole_column_hash():
    from gti.sid.mapfile import SortedMapHash, sid_map_hash

    ids, sids = _ids_and_sids(500)
    order = sorted(range(len(ids)), key=lambda i: ids[i])  # stable: duplicates in row order
    ids_s, sids_s = [ids[i] for i in order], [sids[i] for i in order]
    h = SortedMapHash()
    for s in range(0, len(ids_s), 37):  # batches, and order checked across them
        assert h.update(pa.array(ids_s[s : s + 37]), pa.array(sids_s[s : s + 37]))
    assert h.update(pa.array([], pa.string()), pa.array([], pa.string()))
    assert h.hexdigest() == sid_map_hash(ids_s, sids_s) == sid_map_hash(ids, sids)
    assert SortedMapHash().hexdigest() == sid_map_hash([], [])
    # Out of order inside a batch, or across two batches: flagged, no hash given.
    inside = SortedMapHash()
    assert not inside.update(pa.array(["b", "a"]), pa.array(["x", "y"]))
    across = SortedMapHash()
    assert across.update(pa.array(["b", "c"]), pa.array(["x", "y"]))
    assert not across.update(pa.array(["a"]), pa.array(["z"])) and not across.in_order
    with pytest.raises(ValueError, match="out of order"):
        across.hexdigest()
    # Byte order == code-point order: "é" (U+00E9) after "z", "中" after both.
    ok = SortedMapHash()
    assert ok.update(pa.array(["z", "é"]), pa.array(["1", "2"])) and ok.update(pa.array(["中"]), pa.array(["3"]))


def test_file_hash_of_unsorted_map_equals_the_whole_column_hash(tmp_path):
    import pyarrow.parquet as pq

    from gti.sid.mapfile import sid_map_hash, sid_map_hash_file

    ids, sids = _ids_and_sids(500, seed=1)
    path = tmp_path / "map.parquet"
    pq.write_table(pa.table({"item_id": ids, "sid": sids}), path, row_group_size=64)
    want = sid_map_hash(ids, sids)
    # Many small runs merged a few rows at a time, one run, and runs of one row.
    assert sid_map_hash_file(path, tmp_path / "runs", run_rows=45, batch_rows=4) == want
    assert sid_map_hash_file(path, tmp_path / "runs", run_rows=1000) == want
    assert sid_map_hash_file(path, tmp_path / "runs", run_rows=1, batch_rows=1) == want
    assert not (tmp_path / "runs").exists()  # the runs are removed
    pq.write_table(pa.table({"item_id": pa.array([], pa.string()), "sid": pa.array([], pa.string())}), path)
    assert sid_map_hash_file(path, tmp_path / "runs") == sid_map_hash([], [])
