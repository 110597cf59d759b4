"""Versioned SID maps (gti/sid/versions.py): new items never move an old SID, full groups are
reported, removed items leave, and a model accepts a descendant map and refuses an unrelated one."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from gti.errors import DataError
from gti.sid.codec import SidCodec
from gti.sid.resolve import dedup_extra_level
from gti.sid.versions import (
    LineageDir,
    UnrelatedSidMapError,
    assign_new_items,
    check_map_for_model,
    codebooks_hash,
    compare_tables,
    descends_from,
    make_version,
    map_hash,
    map_table,
    read_version,
    remove_items,
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


def _check_invariants(old: pa.Table, res, n_new: int):
    new = res.table
    old_sid = dict(zip(old.column("item_id").to_pylist(), old.column("sid").to_pylist()))
    new_sid = dict(zip(new.column("item_id").to_pylist(), new.column("sid").to_pylist()))
    # every old SID unchanged, rows in place
    assert new.slice(0, old.num_rows).column("sid").to_pylist() == old.column("sid").to_pylist()
    assert all(new_sid[i] == s for i, s in old_sid.items())
    # every SID unique
    sids = new.column("sid").to_pylist()
    assert len(sids) == len(set(sids))
    # nothing dropped silently
    assert len(res.assigned) + len(res.needs_new_tokens) + len(res.already_present) == n_new
    assert new.num_rows == old.num_rows + len(res.assigned)
    # SID strings spell the codes
    codes = new.column("codes").to_pylist()
    assert len({tuple(c) for c in codes}) == len(codes)


@pytest.mark.parametrize("seed", range(25))
def test_random_assignment_keeps_old_sids_and_new_sids_unique(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 5))
    prefix = rng.integers(0, k, size=(int(rng.integers(5, 60)), 2))
    old, sizes = _map_from_prefix(prefix)
    m = int(rng.integers(1, 40))
    new_ids = [f"n{j}" for j in range(m)]
    # some ids already in the map
    if seed % 3 == 0:
        new_ids[0] = "i0"
    new_prefix = rng.integers(0, k, size=(m, 2))
    new_prefix = np.minimum(new_prefix, np.array(sizes[:2]) - 1)
    res = assign_new_items(old, new_ids, new_prefix, sizes)
    _check_invariants(old, res, m)
    for need in res.needs_new_tokens:
        assert "de-duplication level" in need.reason
    # determinism
    again = assign_new_items(old, new_ids, new_prefix, sizes)
    assert again.table.equals(res.table)


def test_smallest_free_code_in_group_and_full_groups_reported():
    # prefix (0, 0) holds 3 items (dedup codes 0, 1, 2), so the dedup level has size 3;
    # prefix (1, 1) holds one item (code 0).
    prefix = np.array([[0, 0], [0, 0], [0, 0], [1, 1], [1, 0]])
    old, sizes = _map_from_prefix(prefix)
    assert sizes == [2, 2, 3]
    res = assign_new_items(old, ["a", "b", "c", "d", "e"], [[1, 1], [1, 1], [1, 1], [0, 0], [0, 1]], sizes)
    got = dict(zip(res.table.column("item_id").to_pylist(), res.table.column("codes").to_pylist()))
    assert got["a"] == [1, 1, 1] and got["b"] == [1, 1, 2]
    assert got["e"] == [0, 1, 0]  # a new prefix group starts at 0
    full = {n.item_id: n for n in res.needs_new_tokens}
    assert set(full) == {"c", "d"}
    assert "<a_0><b_0>" in full["d"].reason and "size 3" in full["d"].reason
    assert full["c"].codes == (1, 1)
    _check_invariants(old, res, 5)


def test_already_present_items_keep_their_sid_and_are_reported():
    prefix = np.array([[0, 0], [0, 0], [1, 1]])
    old, sizes = _map_from_prefix(prefix)
    res = assign_new_items(old, ["i0", "i2", "x"], [[0, 0], [0, 1], [1, 0]], sizes)
    assert res.already_present == ["i0", "i2"]
    assert res.prefix_changed == ["i2"]
    assert res.assigned == ["x"]
    assert res.table.num_rows == 4
    assert "1 new items assigned" in res.summary()


def test_map_without_dedup_level_taken_sid_needs_cost_or_is_reported():
    codec = SidCodec(2, [3, 3])
    old = map_table(["p", "q"], [[0, 0], [0, 1]], codec)
    res = assign_new_items(old, ["a", "b"], [[0, 0], [2, 2]], [3, 3])
    assert res.assigned == ["b"]
    assert res.needs_new_tokens[0].item_id == "a"
    assert "no de-duplication level" in res.needs_new_tokens[0].reason
    # with last-level costs the collider moves to the cheapest free code under <a_0>
    cost = np.array([[0.0, 0.1, 0.5], [0.0, 0.0, 0.0]])
    res = assign_new_items(old, ["a", "b"], [[0, 0], [2, 2]], [3, 3], last_cost=cost)
    got = dict(zip(res.table.column("item_id").to_pylist(), res.table.column("codes").to_pylist()))
    assert got["a"] == [0, 2] and got["b"] == [2, 2]
    # a prefix whose every last code is taken
    full = map_table(["p", "q", "r"], [[0, 0], [0, 1], [0, 2]], codec)
    res = assign_new_items(full, ["a"], [[0, 1]], [3, 3], last_cost=np.zeros((1, 3)))
    assert res.needs_new_tokens and "every last-level code" in res.needs_new_tokens[0].reason
    _check_invariants(full, res, 1)


def test_bad_inputs_are_data_errors():
    old, sizes = _map_from_prefix(np.array([[0, 0], [0, 0], [1, 1]]))
    with pytest.raises(DataError, match="more than once"):
        assign_new_items(old, ["a", "a"], [[0, 0], [0, 0]], sizes)
    with pytest.raises(DataError, match="outside 0..1"):
        assign_new_items(old, ["a"], [[0, 5]], sizes)
    with pytest.raises(DataError, match="levels"):
        assign_new_items(old, ["a"], [[0]], sizes)


def test_remove_items_leaves_the_rest_in_place():
    old, sizes = _map_from_prefix(np.array([[0, 0], [0, 0], [1, 1], [1, 0]]))
    new, removed, missing = remove_items(old, ["i1", "zz", "i3"])
    assert removed == ["i1", "i3"] and missing == ["zz"]
    assert new.column("item_id").to_pylist() == ["i0", "i2"]
    assert new.column("sid").to_pylist() == [old.column("sid")[0].as_py(), old.column("sid")[2].as_py()]
    # after removal, the freed dedup code is free again for a new item in that group
    res = assign_new_items(new, ["z"], [[0, 0]], sizes)
    assert res.table.column("codes").to_pylist()[-1] == [0, 0, 1]


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
