"""Editing a frozen SID map (gti/sid/map_edits.py): new items never move an old SID, new SIDs
are unique, full groups are reported with a reason, removed items leave and free their code;
with added last-level codes (`add_last_level_codes`) every item is placed, the last level grown
by the least that places them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from gti.common.errors import DataError
from gti.sid.codec import SidCodec
from gti.sid.map_edits import add_last_level_codes, assign_new_items, codes_matrix, map_table, remove_items
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


def _check_growth(old: pa.Table, first, g, sizes: list[int], n_new: int):
    """Invariants of `add_last_level_codes` on top of `assign_new_items`'s result `first`."""
    res = g.assignment
    new_sid = dict(zip(res.table.column("item_id").to_pylist(), res.table.column("sid").to_pylist()))
    first_sid = dict(zip(first.table.column("item_id").to_pylist(), first.table.column("sid").to_pylist()))
    assert all(new_sid[i] == s for i, s in first_sid.items())  # old SIDs (and the first pass's) unchanged
    assert res.table.slice(0, first.table.num_rows).equals(first.table.cast(res.table.schema))
    sids = res.table.column("sid").to_pylist()
    assert len(sids) == len(set(sids))  # every SID unique
    assert not res.needs_new_tokens and len(res.assigned) + len(res.already_present) == n_new  # none dropped
    assert set(g.on_new_codes) == {n.item_id for n in first.needs_new_tokens}
    assert res.assigned == first.assigned + g.on_new_codes
    assert g.codebook_sizes[:-1] == sizes[:-1] and g.old_size == sizes[-1]
    codes = {i: c for i, c in zip(res.table.column("item_id").to_pylist(), res.table.column("codes").to_pylist())}
    placed = [codes[i] for i in g.on_new_codes]
    assert all(c[-1] >= sizes[-1] for c in placed)  # only added codes for them
    assert all(all(0 <= x < k for x, k in zip(c, g.codebook_sizes)) for c in codes.values())
    # minimal: the last level grew by the size of the largest group of items needing a token
    groups: dict[tuple, int] = {}
    for c in placed:
        groups[tuple(c[:-1])] = groups.get(tuple(c[:-1]), 0) + 1
    assert g.n_added == (max(groups.values()) if groups else 0)
    # the grown sizes spell every SID
    codec = SidCodec(len(g.codebook_sizes), g.codebook_sizes)
    assert [codec.to_string(c) for c in res.table.column("codes").to_pylist()] == sids


@pytest.mark.parametrize("seed", range(25))
def test_random_growth_places_every_item_and_grows_minimally(seed):
    rng = np.random.default_rng(100 + seed)
    k = int(rng.integers(2, 4))
    prefix = rng.integers(0, k, size=(int(rng.integers(5, 40)), 2))
    old, sizes = _map_from_prefix(prefix)
    m = int(rng.integers(1, 40))
    new_ids = [f"n{j}" for j in range(m)]
    if seed % 4 == 0:
        new_ids[-1] = "i0"  # already present: kept, not placed again
    new_prefix = np.minimum(rng.integers(0, k, size=(m, 2)), np.array(sizes[:2]) - 1)
    first = assign_new_items(old, new_ids, new_prefix, sizes)
    g = add_last_level_codes(first, sizes)
    _check_growth(old, first, g, sizes, m)
    again = add_last_level_codes(assign_new_items(old, new_ids, new_prefix, sizes), sizes)
    assert again.assignment.table.equals(g.assignment.table) and again.codebook_sizes == g.codebook_sizes
    # a second refresh on the grown map: its groups use the added codes as their own
    res2 = assign_new_items(g.assignment.table, ["z1", "z2"], new_prefix[:1].repeat(2, 0), g.codebook_sizes)
    g2 = add_last_level_codes(res2, g.codebook_sizes)
    _check_growth(g.assignment.table, res2, g2, g.codebook_sizes, 2)


def test_growth_takes_the_smallest_codes_past_the_old_size_per_group():
    prefix = np.array([[0, 0], [0, 0], [0, 0], [1, 1], [1, 1], [1, 1]])
    old, sizes = _map_from_prefix(prefix)
    assert sizes == [2, 2, 3]  # both groups full
    first = assign_new_items(old, ["a", "b", "c", "d"], [[0, 0], [1, 1], [0, 0], [0, 0]], sizes)
    assert [n.item_id for n in first.needs_new_tokens] == ["a", "b", "c", "d"]
    g = add_last_level_codes(first, sizes, "<{level}_{code}>")
    codes = dict(zip(g.assignment.table.column("item_id").to_pylist(), g.assignment.table.column("codes").to_pylist()))
    assert codes["a"] == [0, 0, 3] and codes["c"] == [0, 0, 4] and codes["d"] == [0, 0, 5] and codes["b"] == [1, 1, 3]
    assert g.codebook_sizes == [2, 2, 6] and g.n_added == 3 and g.on_new_codes == ["a", "b", "c", "d"]
    assert g.assignment.table.column("sid").to_pylist()[-1] == "<a_0><b_0><c_5>"
    _check_growth(old, first, g, sizes, 4)
    # nothing needing a token: the assignment and the sizes come back unchanged
    none = assign_new_items(old, ["e"], [[1, 0]], sizes)
    same = add_last_level_codes(none, sizes)
    assert same.assignment is none and same.codebook_sizes == sizes and same.n_added == 0 and not same.on_new_codes


def test_growth_without_a_dedup_level_uses_the_first_levels_as_group():
    codec = SidCodec(2, [3, 3])
    full = map_table(["p", "q", "r", "s"], [[0, 0], [0, 1], [0, 2], [1, 1]], codec)
    first = assign_new_items(full, ["a", "b", "c"], [[0, 1], [0, 0], [1, 1]], [3, 3], last_cost=np.zeros((3, 3)))
    assert [n.item_id for n in first.needs_new_tokens] == ["a", "b"] and first.assigned == ["c"]
    g = add_last_level_codes(first, [3, 3])
    codes = dict(zip(g.assignment.table.column("item_id").to_pylist(), g.assignment.table.column("codes").to_pylist()))
    assert codes["a"] == [0, 3] and codes["b"] == [0, 4] and codes["c"] == [1, 0]
    assert g.codebook_sizes == [3, 5]
    _check_growth(full, first, g, [3, 3], 3)
