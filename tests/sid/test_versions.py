"""Versioned SID maps (gti/sid/versions.py): version records, and a model accepts a descendant
map and refuses an unrelated one. (Adding and removing items: tests/sid/test_map_edits.py.)"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from gti.errors import DataError
from gti.sid.codec import SidCodec
from gti.sid.resolve import dedup_extra_level
from gti.sid.map_edits import assign_new_items, map_table, remove_items
from gti.sid.versions import (
    LineageDir,
    UnrelatedSidMapError,
    check_map_for_model,
    codebooks_hash,
    compare_tables,
    descends_from,
    make_version,
    map_hash,
    read_version,
    version_path,
    write_map,
)


def _map_from_prefix(prefix: np.ndarray, ids=None):
    """A map as the sid stage builds it with dedup=extra_level: prefix codes + a dedup level."""
    full = dedup_extra_level(torch.as_tensor(prefix, dtype=torch.long))
    sizes = [int(prefix[:, lv].max()) + 1 for lv in range(prefix.shape[1])]
    if full.shape[1] > prefix.shape[1]:
        sizes.append(int(full[:, -1].max()) + 1)
    ids = ids or [f"i{n}" for n in range(len(prefix))]
    return map_table(ids, full.numpy(), SidCodec(full.shape[1], sizes)), sizes


def test_map_hash_is_the_sid_stage_hash_and_order_independent():
    from gti.stages.sid import sid_map_hash

    old, _ = _map_from_prefix(np.array([[0, 0], [0, 0], [1, 1]]))
    assert map_hash(old) == sid_map_hash(old.column("item_id").to_pylist(), old.column("sid").to_pylist())
    assert map_hash(old.take(pa.array([2, 0, 1]))) == map_hash(old)


def _lineage_case(tmp_path):
    cb = {"level_0": torch.randn(2, 4), "level_1": torch.randn(2, 4)}
    cb_hash = codebooks_hash(cb)
    old, sizes = _map_from_prefix(np.array([[0, 0], [0, 0], [1, 1]]))
    v0 = make_version(old, cb_hash, sizes, created=0.0)
    step1 = assign_new_items(old, ["a"], [[1, 1]], sizes)
    t1 = step1.table
    v1 = make_version(t1, cb_hash, sizes, parent=v0, created=1.0)
    t2, _, _ = remove_items(t1, ["i0"])
    t2 = assign_new_items(t2, ["b"], [[0, 0]], sizes).table
    v2 = make_version(t2, cb_hash, sizes, parent=v1, created=2.0)
    return cb, cb_hash, sizes, (old, v0), (t1, v1), (t2, v2)


def test_version_record_roundtrip_and_parent_hash(tmp_path):
    cb, cb_hash, sizes, (old, v0), (t1, v1), _ = _lineage_case(tmp_path)
    assert v1.parent_hash == v0.hash and v0.parent_hash is None
    assert v1.n_items == 4 and v1.hash == map_hash(t1)
    path = tmp_path / "sid_map.parquet"
    write_map(path, t1, v1)
    assert version_path(path).name == "sid_map.version.json"
    assert read_version(path) == v1
    assert read_version(tmp_path / "other.parquet") is None
    with pytest.raises(DataError, match="hashes to"):
        write_map(path, old, v1)
    # codebooks hash of the file equals that of the dict
    from safetensors.torch import save_file

    save_file(cb, str(tmp_path / "codebooks.safetensors"))
    assert codebooks_hash(tmp_path / "codebooks.safetensors") == cb_hash


def test_descendant_accepted_through_lineage_and_tables(tmp_path):
    _, _, _, (old, v0), (t1, v1), (t2, v2) = _lineage_case(tmp_path)
    lineage = {v.hash: v for v in (v0, v1, v2)}
    assert check_map_for_model(v0.hash, v0, lineage) == 0
    assert check_map_for_model(v0.hash, v2, lineage, child_table=t2, ancestor_table=old) == 2
    assert descends_from(v1, v0.hash, lineage, child_table=t1, ancestor_table=old)
    # the same through a lineage folder holding the tables
    ld = LineageDir(tmp_path / "versions")
    for t, v in ((old, v0), (t1, v1), (t2, v2)):
        ld.add(v, t)
    assert ld.get(v1.hash) == v1
    assert check_map_for_model(v0.hash, v2, ld) == 2
    diff = compare_tables(old, t2)
    assert diff == {"changed": [], "n_changed": 0, "n_removed": 1, "n_added": 2, "duplicate_sids": 0}


def test_unrelated_maps_refused_naming_both_hashes(tmp_path):
    _, cb_hash, sizes, (old, v0), (t1, v1), _ = _lineage_case(tmp_path)
    # no lineage between them
    other, osizes = _map_from_prefix(np.array([[1, 0], [0, 1], [1, 1]]), ids=["x", "y", "z"])
    vo = make_version(other, cb_hash, osizes, created=5.0)
    with pytest.raises(UnrelatedSidMapError) as e:
        check_map_for_model(v0.hash, vo, {v0.hash: v0}, model_dir="runs/x/sft/model")
    msg = str(e.value)
    assert v0.hash in msg and vo.hash in msg and "runs/x/sft/model/gti_meta.json" in msg
    # other codebooks, even with the parent pointer set
    v_cb = make_version(t1, codebooks_hash({"level_0": torch.zeros(2, 4)}), sizes, parent=v0)
    with pytest.raises(UnrelatedSidMapError, match="other codebooks") as e:
        check_map_for_model(v0.hash, v_cb, {v0.hash: v0})
    assert v0.hash in str(e.value) and v_cb.hash in str(e.value)
    # other codebook sizes (another vocabulary) count as other codebooks too
    v_sz = make_version(t1, cb_hash, [2, 2, 4], parent=v0)
    assert not descends_from(v_sz, v0.hash, {v0.hash: v0})
    # an old item's SID changed, while the parent pointer claims descent: caught on the tables
    sids = t1.column("sid").to_pylist()
    codes = t1.column("codes").to_pylist()
    codes[0], codes[1] = codes[1], codes[0]
    codec = SidCodec(len(sizes), sizes)
    swapped = map_table(t1.column("item_id").to_pylist(), codes, codec)
    assert swapped.column("sid").to_pylist() != sids
    v_sw = make_version(swapped, cb_hash, sizes, parent=v0)
    with pytest.raises(UnrelatedSidMapError, match="changed SID") as e:
        check_map_for_model(v0.hash, v_sw, {v0.hash: v0}, child_table=swapped, ancestor_table=old)
    assert v0.hash in str(e.value) and v_sw.hash in str(e.value)
    # a record that does not match its table
    with pytest.raises(UnrelatedSidMapError, match="hashes to"):
        check_map_for_model(v0.hash, v1, {v0.hash: v0}, child_table=swapped)
    # a model without a recorded hash
    with pytest.raises(UnrelatedSidMapError, match="no sid_map_hash"):
        check_map_for_model(None, v1, {})


def test_lineage_dir_without_tables_cannot_verify_the_swap(tmp_path):
    """With tables in the lineage folder the check runs on them; a missing child table is named."""
    _, cb_hash, sizes, (old, v0), (t1, v1), _ = _lineage_case(tmp_path)
    ld = LineageDir(tmp_path / "v")
    ld.add(v0, old)
    ld.add(v1)  # record only
    with pytest.raises(UnrelatedSidMapError, match="not available"):
        check_map_for_model(v0.hash, v1, ld)
    assert check_map_for_model(v0.hash, v1, ld, child_table=t1) == 1
