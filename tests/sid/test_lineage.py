"""gti.sid.lineage: which SID map a model may decode with, and a run's refresh layout."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from gti.sid import lineage as L
from gti.sid.resolve import dedup_extra_level
from gti.sid.codec import SidCodec
from gti.sid.map_edits import add_last_level_codes, assign_new_items, map_table
from gti.sid.versions import MissingSidTokensError, UnrelatedSidMapError, codebooks_hash, make_version, write_map


def _base():
    prefix = np.array([[0, 0], [0, 0], [1, 1]])
    full = dedup_extra_level(torch.as_tensor(prefix))
    sizes = [2, 2, int(full[:, -1].max()) + 1]
    table = map_table(["i0", "i1", "i2"], full.numpy(), SidCodec(3, sizes))
    return table, sizes, codebooks_hash({"level_0": torch.ones(2, 3), "level_1": torch.zeros(2, 3)})


def _model(folder, h):
    folder.mkdir(parents=True)
    (folder / L.META_NAME).write_text(json.dumps({"sid_map_hash": h}))
    return folder


def _refreshed_run(tmp_path):
    """A run folder with its base map, one finished refresh version v1 and the lineage."""
    run = tmp_path / "run"
    base, sizes, cb = _base()
    v0 = make_version(base, cb, sizes, created=0.0)
    (run / "sid").mkdir(parents=True)
    pq.write_table(base, run / "sid" / "sid_map.parquet")
    t1 = assign_new_items(base, ["new"], [[1, 0]], sizes).table
    v1 = make_version(t1, cb, sizes, parent=v0, created=1.0)
    vdir = L.refresh_root(run) / "v1"
    (vdir / "sid").mkdir(parents=True)
    write_map(vdir / L.MAP_REL, t1, v1)
    (vdir / L.MANIFEST).write_text("{}")
    (L.refresh_root(run) / "v2").mkdir()  # an unfinished version (no manifest) is not listed
    ld = L.lineage_dir(run)
    ld.add(v0, base)
    ld.add(v1, t1)
    return run, (base, v0), (t1, v1)


def test_versions_lists_finished_refreshes_and_finds_the_lineage(tmp_path):
    run, _, (_, v1) = _refreshed_run(tmp_path)
    vs = L.versions(run)
    assert [v.k for v in vs] == [1] and L.latest_version(run) == vs[0]
    assert vs[0].version() == v1 and vs[0].model_dir == run / "refresh" / "v1" / "model"
    assert L.find_lineage(vs[0].map_path).folder == L.lineage_dir(run).folder
    assert L.find_lineage(tmp_path / "elsewhere" / "m.parquet") is None
    assert L.versions(tmp_path / "never-refreshed") == [] and L.latest_version(tmp_path) is None


def test_model_accepts_its_map_and_a_descendant_refuses_an_unrelated_one(tmp_path):
    run, (base, v0), (t1, v1) = _refreshed_run(tmp_path)
    model = _model(tmp_path / "model", v0.hash)
    assert L.check_model_map(model, v0.hash, map_path=run / "sid" / "sid_map.parquet") == 0
    # the refreshed map descends from the model's map through one version
    assert L.check_model_map(model, None, map_path=L.versions(run)[0].map_path) == 1
    # a model trained on some other map: refused, both hashes named
    stranger = _model(tmp_path / "stranger", "f" * 16)
    with pytest.raises(UnrelatedSidMapError) as err:
        L.check_model_map(stranger, v1.hash, map_path=L.versions(run)[0].map_path)
    assert "f" * 16 in str(err.value) and v1.hash in str(err.value)
    # a map whose record disagrees with the hash it is given as
    with pytest.raises(UnrelatedSidMapError, match="records hash"):
        L.check_model_map(model, "0" * 16, map_path=L.versions(run)[0].map_path)


def test_a_grown_version_needs_a_model_with_its_added_tokens(tmp_path):
    """v2 grows the last level (two more copies of the full group (0, 0)): the base model, whose
    map record the lineage holds, is refused with one line naming the added tokens; a model
    trained on v2 (its gti_meta.json records v2 and its version) accepts it."""
    run, (base, v0), (t1, v1) = _refreshed_run(tmp_path)
    _, sizes, cb = _base()
    first = assign_new_items(t1, ["x", "y"], [[0, 0], [0, 0]], sizes)
    g = add_last_level_codes(first, sizes)
    assert g.codebook_sizes == sizes[:-1] + [sizes[-1] + 2]
    v2 = make_version(g.assignment.table, cb, g.codebook_sizes, parent=v1, created=2.0)
    vdir = L.refresh_root(run) / "v2"
    (vdir / "sid").mkdir(parents=True)
    write_map(vdir / L.MAP_REL, g.assignment.table, v2)
    (vdir / L.MANIFEST).write_text("{}")
    L.lineage_dir(run).add(v2, g.assignment.table)
    model = _model(tmp_path / "model", v0.hash)
    with pytest.raises(MissingSidTokensError) as err:
        L.check_model_map(model, None, map_path=vdir / L.MAP_REL)
    msg = str(err.value)
    assert f"<c_{sizes[-1]}>, <c_{sizes[-1] + 1}>" in msg and v0.hash in msg and v2.hash in msg
    assert str(model) in msg and "\n" not in msg
    assert L.check_model_map(model, None, map_path=L.versions(run)[0].map_path) == 1  # v1 did not grow
    grown = tmp_path / "grown"
    grown.mkdir()
    (grown / L.META_NAME).write_text(json.dumps({"sid_map_hash": v2.hash, "sid_map_version": v2.to_dict()}))
    assert L.check_model_map(grown, None, map_path=vdir / L.MAP_REL) == 0
