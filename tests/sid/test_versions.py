"""Versioned SID maps (gti/sid/versions.py): version records, and a model accepts a descendant
map and refuses an unrelated one. (Adding and removing items: tests/sid/test_map_edits.py.)"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from gti.common.errors import DataError
from gti.sid.codec import SidCodec
from gti.sid.resolve import dedup_extra_level
from gti.sid.map_edits import add_last_level_codes, assign_new_items, map_table, remove_items
from gti.sid.versions import (
    LineageDir,
    MissingSidTokensError,
    UnrelatedSidMapError,
    check_map_for_model,
    codebooks_hash,
    compare_tables,
    descends_from,
    identity_problem,
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
    from gti.sid.mapfile import sid_map_hash  # the function the sid stage records the hash with

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
    # other codebook sizes (another vocabulary) count as other codebooks too: a level other than
    # the last grew, the last level shrank, a level more, another token format
    for bad_sizes in ([2, 4, 2], [2, 2, 1], [2, 2, 2, 2]):
        v_sz = make_version(t1, cb_hash, bad_sizes, parent=v0)
        assert not descends_from(v_sz, v0.hash, {v0.hash: v0})
        with pytest.raises(UnrelatedSidMapError, match=f"{v_sz.hash} does not descend from {v0.hash}.*other codebooks"):
            check_map_for_model(v0.hash, v_sz, {v0.hash: v0})
    assert not descends_from(make_version(t1, cb_hash, sizes, "[{level}{code}]", parent=v0), v0.hash, {v0.hash: v0})
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


def _grown_case():
    """v0 (sizes [2, 2, 2], group (0, 0) full) -> v1: two more copies of (0, 0) on added codes
    (last level 2 -> 4) -> v2: one more item on a free code, sizes as v1's."""
    cb_hash = codebooks_hash({"level_0": torch.ones(2, 4), "level_1": torch.zeros(2, 4)})
    old, sizes = _map_from_prefix(np.array([[0, 0], [0, 0], [1, 1]]))
    v0 = make_version(old, cb_hash, sizes, created=0.0)
    first = assign_new_items(old, ["a", "b"], [[0, 0], [0, 0]], sizes)
    assert [n.item_id for n in first.needs_new_tokens] == ["a", "b"]
    g = add_last_level_codes(first, sizes)
    assert g.codebook_sizes == [2, 2, 4]
    t1 = g.assignment.table
    v1 = make_version(t1, cb_hash, g.codebook_sizes, parent=v0, created=1.0)
    t2 = assign_new_items(t1, ["c"], [[0, 0]], g.codebook_sizes).table
    assert t2.num_rows == t1.num_rows  # (0, 0) uses all 4 codes now: c needs a token again
    t2 = assign_new_items(t1, ["c"], [[1, 0]], g.codebook_sizes).table
    v2 = make_version(t2, cb_hash, g.codebook_sizes, parent=v1, created=2.0)
    return cb_hash, (old, v0), (t1, v1), (t2, v2)


def test_identity_rule_lets_only_the_last_level_grow():
    assert identity_problem(("h", (4, 4, 2), "f"), ("h", (4, 4, 2), "f")) is None
    assert identity_problem(("h", (4, 4, 2), "f"), ("h", (4, 4, 5), "f")) is None
    assert "only the last level may grow" in identity_problem(("h", (4, 4, 2), "f"), ("h", (4, 5, 2), "f"))
    assert "shrank from 2 to 1" in identity_problem(("h", (4, 4, 2), "f"), ("h", (4, 4, 1), "f"))
    assert "codebooks g are not h" in identity_problem(("h", (4, 4, 2), "f"), ("g", (4, 4, 3), "f"))
    assert "token format" in identity_problem(("h", (4, 4, 2), "f"), ("h", (4, 4, 3), "e"))
    assert "only the last level" in identity_problem(("h", (4, 4), "f"), ("h", (4, 4, 2), "f"))


def test_grown_map_descends_but_the_parents_model_lacks_its_tokens():
    _, (old, v0), (t1, v1), (t2, v2) = _grown_case()
    lineage = {v.hash: v for v in (v0, v1, v2)}
    # the lineage rule: a grown last level still descends (old SIDs checked on the tables)
    assert descends_from(v1, v0.hash, lineage, child_table=t1, ancestor_table=old)
    assert descends_from(v2, v0.hash, lineage, child_table=t2, ancestor_table=old)
    # the model of v0 has no rows for <c_2>, <c_3>: one line naming them and both hashes
    for child, table in ((v1, t1), (v2, t2)):
        with pytest.raises(MissingSidTokensError) as e:
            check_map_for_model(v0.hash, child, lineage, model_dir="runs/x/sft/model", child_table=table,
                                ancestor_table=old)
        msg = str(e.value)
        assert "\n" not in msg and child.hash in msg and v0.hash in msg and "runs/x/sft/model/gti_meta.json" in msg
        assert "<c_2>, <c_3>" in msg and "vocabulary lacks" in msg
    # the same when the model's sizes come from its own record (ancestor_identity) instead of the lineage
    with pytest.raises(MissingSidTokensError, match="<c_2>, <c_3>"):
        check_map_for_model(v0.hash, v1, {}, ancestor_identity=v0.codebook_identity)
    assert issubclass(MissingSidTokensError, UnrelatedSidMapError)
    # the model made with the grown map (v1's vocabulary) accepts it and its descendant
    assert check_map_for_model(v1.hash, v1, lineage) == 0
    assert check_map_for_model(v1.hash, v2, lineage, child_table=t2, ancestor_table=t1,
                               ancestor_identity=v1.codebook_identity) == 1
    # a version that shrinks the last level again on the way is refused with the usual line
    v_back = make_version(t2, v1.codebooks_hash, [2, 2, 3], parent=v1)
    lineage[v_back.hash] = v_back
    with pytest.raises(UnrelatedSidMapError, match=f"does not descend from {v0.hash}.*other codebooks") as e:
        check_map_for_model(v0.hash, v_back, lineage)
    assert not isinstance(e.value, MissingSidTokensError)


def test_lineage_dir_refuses_a_self_parent_and_a_rewritten_parent(tmp_path):
    """A record that names itself as parent, or that rewrites a known record's parent, would cut
    older models off their maps; both are refused and the stored record is kept."""
    _, cb_hash, sizes, (old, v0), (t1, v1), (t2, v2) = _lineage_case(tmp_path)
    ld = LineageDir(tmp_path / "v")
    for t, v in ((old, v0), (t1, v1), (t2, v2)):
        ld.add(v, t)
    ld.add(v1, t1)  # the same record again is fine (a rerun)
    with pytest.raises(DataError, match=f"version {v1.hash} names itself as its parent"):
        ld.add(make_version(t1, cb_hash, sizes, parent=v1.hash), t1)
    with pytest.raises(DataError, match=f"version {v1.hash} is recorded with parent {v0.hash}, not {v2.hash}"):
        ld.add(make_version(t1, cb_hash, sizes, parent=v2.hash), t1)
    assert ld.get(v1.hash) == v1
    assert check_map_for_model(v0.hash, v2, ld) == 2
