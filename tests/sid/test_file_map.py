"""Tests of gti/sid/file_map.py: the sid stage's outputs for a map read from a file."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gti import config as C
from gti.common.errors import DataError
from gti.sid import file_map as M
from gti.sid.mapfile import sid_map_hash


def write_embeddings(path, vecs, ids):
    flat = pa.array(np.ascontiguousarray(vecs, dtype=np.float32).reshape(-1))
    pq.write_table(pa.table({"item_id": ids, "embedding": pa.FixedSizeListArray.from_arrays(flat, vecs.shape[1])}),
                   path, row_group_size=3)


def test_residual_means_are_the_per_code_means_of_what_earlier_levels_leave(tmp_path):
    g = np.random.default_rng(0)
    x = g.normal(size=(7, 3)).astype(np.float32)
    emb = tmp_path / "e.parquet"
    write_embeddings(emb, x, [f"i{k}" for k in range(7)])
    codes = np.array([[0, 1], [0, 0], [1, 1], [1, 0], [0, 1], [2, 0], [0, 0]])
    rows = np.array([0, 1, 2, 3, 4, 5, -1])  # the last item is not in the map
    books, mse = M.residual_means(emb, rows, codes[:6], [4, 2], batch_rows=2)
    x6, c6 = x[:6].astype(np.float64), codes[:6]
    lv0 = np.stack([x6[c6[:, 0] == k].mean(0) if (c6[:, 0] == k).any() else np.zeros(3) for k in range(4)])
    np.testing.assert_allclose(books[0].numpy(), lv0, atol=1e-6)
    assert not books[0][3].any()  # code 3 is used by no item: zeros
    r1 = x6 - lv0[c6[:, 0]]
    lv1 = np.stack([r1[c6[:, 1] == k].mean(0) for k in range(2)])
    np.testing.assert_allclose(books[1].numpy(), lv1, atol=1e-6)
    assert mse == pytest.approx(float(((r1 - lv1[c6[:, 1]]) ** 2).mean()), rel=1e-6)


def _setup(tmp_path, index, ids, *over):
    emb = tmp_path / "embeddings.parquet"
    write_embeddings(emb, np.random.default_rng(1).normal(size=(len(ids), 4)), ids)
    path = tmp_path / "m.index.json"
    path.write_text(json.dumps(index))
    work = tmp_path / "work"
    work.mkdir()
    return C.load(None, ["sid.method=file", f"sid.path={path}", *over]).sid, emb, work


def test_make_file_map_writes_the_map_codebooks_quarantine_and_facts(tmp_path):
    ids = ["i2", "i0", "i1", "i3"]
    index = {"i0": ["<a_1>", "<b_2>"], "i1": ["<a_1>", "<b_2>"], "i2": ["<a_0>", "<b_0>"]}
    s, emb, work = _setup(tmp_path, index, ids, "sid.missing=quarantine")
    outputs, facts = M.make_file_map(s, emb, work, log=lambda m: None)
    assert outputs == {"sid_map": "sid_map.parquet", "codebooks": "codebooks.safetensors",
                       "quarantine": "quarantine.parquet"}
    t = pq.read_table(work / "sid_map.parquet")
    assert t.schema.field("codes").type == pa.list_(pa.int32())
    assert t.column("item_id").to_pylist() == ["i2", "i0", "i1"]  # embeddings order, quarantined left out
    assert t.column("sid").to_pylist() == ["<a_0><b_0><c_0>", "<a_1><b_2><c_0>", "<a_1><b_2><c_1>"]
    assert facts["sid_map_hash"] == sid_map_hash(t.column("item_id"), t.column("sid"))
    assert pq.read_table(work / "quarantine.parquet").to_pylist() == [{"item_id": "i3", "reason": "no_sid"}]
    assert facts["levels"] == 3 and facts["quantizer_levels"] == 2 and facts["dedup_level_added"]
    assert facts["codebook_sizes"] == [2, 3, 2] and len(facts["new_tokens"]) == 7
    assert facts["collision_rate_before"] == pytest.approx(1 / 3) and facts["collision_rate_after"] == 0.0
    assert facts["source"]["quarantined"] == 1 and facts["source"]["duplicate_items"] == 2
    from safetensors.torch import load_file

    cb = load_file(str(work / "codebooks.safetensors"))
    assert sorted(cb) == ["level_0", "level_1"] and cb["level_1"].shape == (3, 4) and cb["level_0"].dtype == torch.float32


def test_a_quarantined_item_with_interactions_is_refused(tmp_path):
    s, emb, work = _setup(tmp_path, {"a": [0], "b": [1]}, ["a", "b", "c"], "sid.missing=quarantine")
    inter = tmp_path / "interactions.parquet"
    pq.write_table(pa.table({"user_id": ["u", "u"], "item_id": ["a", "c"], "ts": [1, 2]}), inter)
    with pytest.raises(DataError, match=r"item 'c' has no SID but is in the interactions \(1 such item"):
        M.make_file_map(s, emb, work, log=lambda m: None, interactions=inter)
    pq.write_table(pa.table({"user_id": ["u", "u"], "item_id": ["a", "b"], "ts": [1, 2]}), inter)
    _, facts = M.make_file_map(s, emb, work, log=lambda m: None, interactions=inter)
    assert facts["n_items"] == 2 and facts["source"]["quarantined"] == 1
