"""Editing a frozen SID map (gti/sid/map_edits.py): new items never move an old SID, new SIDs
are unique, full groups are reported with a reason, removed items leave and free their code."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from gti.errors import DataError
from gti.sid.codec import SidCodec
from gti.sid.map_edits import assign_new_items, codes_matrix, map_table, remove_items
from gti.sid.resolve import dedup_extra_level


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


def test_codes_matrix_and_empty_maps():
    codec = SidCodec(2, [3, 3])
    t = map_table(["p", "q"], [[0, 2], [1, 0]], codec)
    assert codes_matrix(t).tolist() == [[0, 2], [1, 0]] and t.column("sid").to_pylist()[0] == "<a_0><b_2>"
    ragged = pa.table({"item_id": ["p", "q"], "codes": [[0, 1], [1]], "sid": ["x", "y"]})
    with pytest.raises(DataError, match="different lengths"):
        codes_matrix(ragged)
    empty = t.slice(0, 0)
    res = assign_new_items(empty, ["a", "b"], [[1, 1], [1, 1]], [3, 3])
    assert res.assigned == ["a"] and res.needs_new_tokens[0].item_id == "b"  # same SID, no dedup level
    with pytest.raises(DataError, match="duplicate SIDs"):
        assign_new_items(map_table(["p", "q"], [[0, 2], [0, 2]], codec), ["a"], [[1, 1]], [3, 3])
    with pytest.raises(DataError, match="last_cost has shape"):
        assign_new_items(t, ["a"], [[1, 1]], [3, 3], last_cost=np.zeros((1, 2)))


def test_no_new_items_leave_the_map_as_it_is():
    prefix = np.array([[0, 0], [0, 0], [1, 1]])
    old, sizes = _map_from_prefix(prefix)
    for empty in ([], np.zeros((0, 2), dtype=np.int64)):
        res = assign_new_items(old, [], empty, sizes)
        assert res.table.equals(old) and not res.assigned and not res.needs_new_tokens
        _check_invariants(old, res, 0)
