"""Tests of gti/sid/from_file.py: SID maps read from MiniOneRec / LC-Rec index.json and parquet,
checked as our own maps, and written back in the index.json form."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gti import config as C
from gti.common.errors import DataError
from gti.sid import from_file as F


def sid_cfg(path, *over):
    return C.load(None, ["sid.method=file", f"sid.path={path}", *over]).sid


def write_json(path, obj):
    path.write_text(json.dumps(obj))
    return path


CATALOG = ["i0", "i1", "i2", "i3"]
INDEX = {"i0": ["<a_1>", "<b_2>", "<c_0>"], "i1": ["<a_1>", "<b_0>", "<c_3>"],
         "i2": ["<a_0>", "<b_2>", "<c_1>"], "i3": ["<a_2>", "<b_1>", "<c_1>"]}


# --------------------------------------------------------------------------- tokens
def test_tokens_lists_ints_and_sid_strings_give_the_same_codes(tmp_path):
    rx = F.token_regex("<{level}_{code}>", None)
    assert F.parse_value("x", ["<a_12>", "<b_3>", "<c_7>"], rx, "f") == [12, 3, 7]
    assert F.parse_value("x", [12, 3, 7], rx, "f") == [12, 3, 7]
    assert F.parse_value("x", "<a_12><b_3> <c_7>", rx, "f") == [12, 3, 7]


def test_a_stated_token_pattern_reads_numbered_levels_or_positions():
    rx = F.token_regex("<{level}_{code}>", r"\[L(?P<level>\d+):(?P<code>\d+)\]")
    assert F.parse_value("x", ["[L0:4]", "[L1:9]"], rx, "f") == [4, 9]
    no_level = F.token_regex("<{level}_{code}>", r"s(?P<code>\d+)")
    assert F.parse_value("x", ["s4", "s9", "s1"], no_level, "f") == [4, 9, 1]
    with pytest.raises(DataError, match="no group named 'code'"):
        F.token_regex("<{level}_{code}>", r"<(\d+)>")


def test_a_bad_token_names_the_item_and_the_token(tmp_path):
    path = write_json(tmp_path / "x.index.json", {**INDEX, "i2": ["<a_0>", "<b2>", "<c_1>"]})
    with pytest.raises(DataError, match=r"item 'i2': token '<b2>' does not match sid.token_format"):
        F.read_file_map(sid_cfg(path), CATALOG)
    path = write_json(tmp_path / "y.index.json", {**INDEX, "i3": ["<a_2>", "<c_1>", "<b_1>"]})
    with pytest.raises(DataError, match=r"item 'i3': token '<c_1>' at position 1 is level 'c', expected level 1 \(b\)"):
        F.read_file_map(sid_cfg(path), CATALOG)
    path = write_json(tmp_path / "z.index.json", {**INDEX, "i1": [1, 2.5, 3]})
    with pytest.raises(DataError, match=r"item 'i1': 2.5 at position 1 is neither an int nor a token"):
        F.read_file_map(sid_cfg(path), CATALOG)


# --------------------------------------------------------------------------- reading
def test_index_json_is_read_in_catalog_order_with_sizes_from_the_largest_codes(tmp_path):
    fm = F.read_file_map(sid_cfg(write_json(tmp_path / "m.index.json", INDEX)), ["i3", "i0", "i1", "i2"])
    assert fm.ids == ["i3", "i0", "i1", "i2"]
    assert fm.codes.tolist() == [[2, 1, 1], [1, 2, 0], [1, 0, 3], [0, 2, 1]]
    assert fm.sizes == [3, 3, 4] and fm.file_levels == 3 and fm.missing == [] and fm.duplicate_groups == 0


def test_a_plain_parquet_map_reads_like_the_json(tmp_path):
    path = tmp_path / "m.parquet"
    codes = pa.array([[1, 2, 0], [1, 0, 3], [0, 2, 1], [2, 1, 1]], pa.list_(pa.int64()))
    pq.write_table(pa.table({"item": CATALOG, "sem_ids": codes}), path)  # two columns, any names
    from_json = F.read_file_map(sid_cfg(write_json(tmp_path / "m.index.json", INDEX)), CATALOG)
    from_parquet = F.read_file_map(sid_cfg(path), CATALOG)
    assert from_parquet.codes.tolist() == from_json.codes.tolist() and from_parquet.sizes == from_json.sizes
    pq.write_table(pa.table({"item_id": ["i0", "i0"], "codes": [[1], [2]]}), path)
    with pytest.raises(DataError, match="item 'i0' appears 2 times"):
        F.read_entries(path)


def test_a_repeated_json_key_is_refused(tmp_path):
    path = tmp_path / "m.index.json"
    path.write_text('{"i0": [1, 2], "i1": [0, 1], "i0": [2, 2]}')
    with pytest.raises(DataError, match="key 'i0' appears twice"):
        F.read_entries(path)


@pytest.mark.parametrize("form", ["list", "records", "item2id"])
def test_item_json_maps_their_indices_to_our_ids(tmp_path, form):
    index = {str(k): INDEX[i] for k, i in enumerate(CATALOG)}
    if form == "list":
        names = write_json(tmp_path / "d.item.json", CATALOG)
    elif form == "records":
        names = write_json(tmp_path / "d.item.json", {str(k): {"title": f"t{k}", "asin": i} for k, i in enumerate(CATALOG)})
    else:
        names = tmp_path / "d.item2id"
        names.write_text("".join(f"{i}\t{k}\n" for k, i in enumerate(CATALOG)))
    fm = F.read_file_map(sid_cfg(write_json(tmp_path / "d.index.json", index), f"sid.item_json={names}"), CATALOG)
    want = F.read_file_map(sid_cfg(write_json(tmp_path / "m.index.json", INDEX)), CATALOG)
    assert fm.ids == want.ids and fm.codes.tolist() == want.codes.tolist()


def test_item_json_errors_name_the_index(tmp_path):
    index = write_json(tmp_path / "d.index.json", {"0": [1, 2], "7": [0, 1]})
    names = write_json(tmp_path / "d.item.json", ["i0", "i1"])
    with pytest.raises(DataError, match=r"index '7' is not in sid.item_json"):
        F.read_file_map(sid_cfg(index, f"sid.item_json={names}"), ["i0", "i1"])
    names = write_json(tmp_path / "t.item.json", {"0": {"title": "a"}, "1": {"title": "b"}})
    with pytest.raises(DataError, match=r"entry '0' names no item"):
        F.read_item_names(names)


def test_keys_that_are_indices_without_item_json_get_a_hint(tmp_path):
    index = write_json(tmp_path / "d.index.json", {str(k): INDEX[i] for k, i in enumerate(CATALOG)})
    with pytest.raises(DataError, match=r"none of the 4 catalog items is in the map .* need sid.item_json"):
        F.read_file_map(sid_cfg(index), CATALOG)


# --------------------------------------------------------------------------- checks
def test_a_missing_item_is_named_with_the_count_or_quarantined(tmp_path):
    path = write_json(tmp_path / "m.index.json", {k: v for k, v in INDEX.items() if k not in ("i1", "i3")})
    with pytest.raises(DataError, match=r"2 catalog item\(s\) have no SID: 'i1', 'i3' \(add them, or set "
                                        r"sid.missing=quarantine"):
        F.read_file_map(sid_cfg(path), CATALOG)
    fm = F.read_file_map(sid_cfg(path, "sid.missing=quarantine"), CATALOG)
    assert fm.ids == ["i0", "i2"] and fm.missing == ["i1", "i3"]


def test_keys_outside_the_catalog_are_counted_and_left_out(tmp_path):
    path = write_json(tmp_path / "m.index.json", {**INDEX, "gone": ["<a_9>", "<b_9>", "<c_9>"]})
    fm = F.read_file_map(sid_cfg(path), CATALOG)
    assert fm.not_in_catalog == 1 and fm.sizes == [3, 3, 4]  # the sizes of the catalog's codes


def test_a_wrong_level_count_names_the_item(tmp_path):
    path = write_json(tmp_path / "m.index.json", {**INDEX, "i2": ["<a_0>", "<b_2>"]})
    with pytest.raises(DataError, match=r"item 'i2' has 2 codes where the map's others have 3 \(every SID needs "
                                        r"the same number of levels; 1 such item"):
        F.read_file_map(sid_cfg(path), CATALOG)


def test_an_out_of_range_code_names_the_item_code_and_level(tmp_path):
    path = write_json(tmp_path / "m.index.json", INDEX)
    with pytest.raises(DataError, match=r"item 'i1': code 3 at level c is outside 0..2 \(sid.file_codebook_size "
                                        r"gives level c 3 codes; 1 such item"):
        F.read_file_map(sid_cfg(path, "sid.file_codebook_size=3"), CATALOG)
    fm = F.read_file_map(sid_cfg(path, "sid.file_codebook_size=[4,4,8]"), CATALOG)
    assert fm.sizes == [4, 4, 8]  # given sizes stand, unused codes included
    with pytest.raises(DataError, match=r"has 2 entries; the map has 3 levels"):
        F.read_file_map(sid_cfg(path, "sid.file_codebook_size=[4,4]"), CATALOG)
    neg = write_json(tmp_path / "n.index.json", {**INDEX, "i0": [1, -1, 0]})
    with pytest.raises(DataError, match=r"item 'i0': code -1 at level b is outside 0..2 \(codes start at 0"):
        F.read_file_map(sid_cfg(neg), CATALOG)


def test_a_duplicate_is_refused_naming_both_items_and_the_sid(tmp_path):
    path = write_json(tmp_path / "m.index.json", {**INDEX, "i3": INDEX["i0"]})
    with pytest.raises(DataError, match=r"items 'i0' and 'i3' share the SID <a_1><b_2><c_0> \(1 shared SID\(s\), "
                                        r"2 items; set sid.duplicates=append_level"):
        F.read_file_map(sid_cfg(path, "sid.duplicates=error"), CATALOG)


def test_duplicates_get_a_level_numbering_them_by_item_id(tmp_path):
    path = write_json(tmp_path / "m.index.json", {"z": [1, 1], "a": [1, 1], "m": [1, 1], "b": [0, 1], "c": [0, 2]})
    fm = F.read_file_map(sid_cfg(path), ["z", "b", "a", "m", "c"])
    assert fm.codes.tolist() == [[1, 1, 2], [0, 1, 0], [1, 1, 0], [1, 1, 1], [0, 2, 0]]
    assert fm.sizes == [2, 3, 3] and fm.file_levels == 2 and (fm.duplicate_groups, fm.duplicate_items) == (1, 3)
    assert len({tuple(r) for r in fm.codes.tolist()}) == 5


# --------------------------------------------------------------------------- export
def test_index_json_entries_keys_by_item_id_or_their_index():
    codes = np.array([[1, 2], [0, 3]])
    assert F.index_json_entries(["b", "a"], codes, "<{level}_{code}>") == {"a": ["<a_0>", "<b_3>"],
                                                                             "b": ["<a_1>", "<b_2>"]}
    keyed = F.index_json_entries(["b", "a"], codes, "<{level}_{code}>", {"a": "10", "b": "9"})
    assert list(keyed) == ["9", "10"] and keyed["10"] == ["<a_0>", "<b_3>"]
    with pytest.raises(DataError, match=r"1 item\(s\) of the map are not in the item.json: 'b'"):
        F.index_json_entries(["b", "a"], codes, "<{level}_{code}>", {"a": "0"})


def test_export_writes_an_item_json_that_reads_back(tmp_path):
    map_path = tmp_path / "sid_map.parquet"
    pq.write_table(pa.table({"item_id": ["b", "a"], "codes": pa.array([[1, 2], [0, 3]], pa.list_(pa.int32())),
                             "sid": ["<a_1><b_2>", "<a_0><b_3>"]}), map_path)
    items = tmp_path / "items.parquet"
    pq.write_table(pa.table({"item_id": ["a", "b"], "title": ["A", None], "description": ["about a", "about b"]}), items)
    got = F.export_index_json(map_path, "<{level}_{code}>", tmp_path / "out.index.json", tmp_path / "out.item.json", items)
    assert got == {"items": 2, "levels": 2, "item_json_written": True}
    assert json.loads((tmp_path / "out.item.json").read_text()) == {
        "0": {"item_id": "a", "title": "A", "description": "about a"},
        "1": {"item_id": "b", "title": "", "description": "about b"}}
    assert json.loads((tmp_path / "out.index.json").read_text()) == {"0": ["<a_0>", "<b_3>"], "1": ["<a_1>", "<b_2>"]}
    fm = F.read_file_map(sid_cfg(tmp_path / "out.index.json", f"sid.item_json={tmp_path / 'out.item.json'}"), ["b", "a"])
    assert fm.codes.tolist() == [[1, 2], [0, 3]]
