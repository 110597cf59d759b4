"""gti.run.versions: which version of a run is current, which model and SID map go together,
and which SID map a model may decode with (run folders written here: manifests, maps, version
records; no model weights, no Ray)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from gti.run import versions as R
from gti.run.manifest import MANIFEST_NAME, Manifest
from gti.sid.codec import SidCodec
from gti.sid.map_edits import add_last_level_codes, assign_new_items, map_table
from gti.sid.resolve import dedup_extra_level
from gti.sid.versions import MissingSidTokensError, UnrelatedSidMapError, codebooks_hash, make_version, write_map


def _base():
    prefix = np.array([[0, 0], [0, 0], [1, 1]])
    full = dedup_extra_level(torch.as_tensor(prefix))
    sizes = [2, 2, int(full[:, -1].max()) + 1]
    table = map_table(["i0", "i1", "i2"], full.numpy(), SidCodec(3, sizes))
    return table, sizes, codebooks_hash({"level_0": torch.ones(2, 3), "level_1": torch.zeros(2, 3)})


def _model(folder, h):
    folder.mkdir(parents=True)
    (folder / R.META_NAME).write_text(json.dumps({"sid_map_hash": h}))
    (folder / "config.json").write_text("{}")
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
    vdir = R.refresh_root(run) / "v1"
    (vdir / "sid").mkdir(parents=True)
    write_map(vdir / R.MAP_REL, t1, v1)
    (vdir / MANIFEST_NAME).write_text("{}")
    (R.refresh_root(run) / "v2").mkdir()  # an unfinished version (no manifest) is not listed
    ld = R.lineage_dir(run)
    ld.add(v0, base)
    ld.add(v1, t1)
    return run, (base, v0), (t1, v1)


def test_refresh_versions_lists_finished_refreshes_and_finds_the_lineage(tmp_path):
    run, _, (_, v1) = _refreshed_run(tmp_path)
    vs = R.refresh_versions(run)
    assert [v.k for v in vs] == [1] and R.next_version(run) == 2
    assert vs[0].map_version() == v1 and vs[0].model_dir == run / "refresh" / "v1" / "model"
    assert R.find_lineage(vs[0].map_path).folder == R.lineage_dir(run).folder
    assert R.find_lineage(tmp_path / "elsewhere" / "m.parquet") is None
    assert R.refresh_versions(tmp_path / "never-refreshed") == [] and R.next_version(tmp_path) == 1


def test_model_accepts_its_map_and_a_descendant_refuses_an_unrelated_one(tmp_path):
    run, (base, v0), (t1, v1) = _refreshed_run(tmp_path)
    model = _model(tmp_path / "model", v0.hash)
    assert R.check_model_map(model, v0.hash, map_path=run / "sid" / "sid_map.parquet") == 0
    # the refreshed map descends from the model's map through one version
    assert R.check_model_map(model, None, map_path=R.refresh_versions(run)[0].map_path) == 1
    # a model trained on some other map: refused in one line naming both hashes
    stranger = _model(tmp_path / "stranger", "f" * 16)
    with pytest.raises(UnrelatedSidMapError) as err:
        R.check_model_map(stranger, v1.hash, map_path=R.refresh_versions(run)[0].map_path)
    assert "f" * 16 in str(err.value) and v1.hash in str(err.value) and "\n" not in str(err.value)
    # a map whose record disagrees with the hash it is given as
    with pytest.raises(UnrelatedSidMapError, match="records hash"):
        R.check_model_map(model, "0" * 16, map_path=R.refresh_versions(run)[0].map_path)
    # the strict form (the sft stage): only the very map
    R.check_exact_map(model, v0.hash)
    with pytest.raises(UnrelatedSidMapError, match=f"has sid_map_hash {v0.hash} but the sid stage's sid_map_hash "
                                                   f"is {v1.hash}: stale SID map"):
        R.check_exact_map(model, v1.hash)


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
    vdir = R.refresh_root(run) / "v2"
    (vdir / "sid").mkdir(parents=True)
    write_map(vdir / R.MAP_REL, g.assignment.table, v2)
    (vdir / MANIFEST_NAME).write_text("{}")
    R.lineage_dir(run).add(v2, g.assignment.table)
    model = _model(tmp_path / "model", v0.hash)
    with pytest.raises(MissingSidTokensError) as err:
        R.check_model_map(model, None, map_path=vdir / R.MAP_REL)
    msg = str(err.value)
    assert f"<c_{sizes[-1]}>, <c_{sizes[-1] + 1}>" in msg and v0.hash in msg and v2.hash in msg
    assert str(model) in msg and "\n" not in msg
    assert R.check_model_map(model, None, map_path=R.refresh_versions(run)[0].map_path) == 1  # v1 did not grow
    grown = tmp_path / "grown"
    grown.mkdir()
    (grown / R.META_NAME).write_text(json.dumps({"sid_map_hash": v2.hash, "sid_map_version": v2.to_dict()}))
    assert R.check_model_map(grown, None, map_path=vdir / R.MAP_REL) == 0


def test_check_tokens_names_the_tokens_the_tokenizer_lacks(tmp_path):
    class Tok:
        def __init__(self, tokens):
            self.vocab = {t: i for i, t in enumerate(tokens)}

        def get_vocab(self):
            return self.vocab

    codec = SidCodec(2, [2, 3])
    R.check_tokens(Tok(codec.tokens()), codec, tmp_path, tmp_path / "m.parquet")
    with pytest.raises(MissingSidTokensError, match=r"lacks 1 SID token\(s\) .*\[2, 3\]\): <b_2>; use the model"):
        R.check_tokens(Tok(codec.tokens()[:-1]), codec, tmp_path, tmp_path / "m.parquet")


# --------------------------------------------------------------------------- resolve
def _run_with_model(tmp_path, stage="sft"):
    """A run with its sid stage (the base map) and a `stage` model; returns (run, base map version)."""
    run = tmp_path / "run"
    base, sizes, cb = _base()
    v0 = make_version(base, cb, sizes, created=0.0)
    (run / "sid").mkdir(parents=True)
    pq.write_table(base, run / "sid" / "sid_map.parquet")
    Manifest(stage="sid", fingerprint="f", config={}, outputs={"sid_map": "sid_map.parquet"},
             facts={"sid_map_hash": v0.hash, "codebook_sizes": sizes}).write(run / "sid")
    _model(run / stage / "model", v0.hash)
    Manifest(stage=stage, fingerprint="trained", config={}, outputs={"model": "model"}).write(run / stage)
    R.lineage_dir(run).add(v0, base)
    return run, v0


def _publish(run, k: int, parent, base: dict | None, grow: int = 0):
    """refresh/v<k>: one more item on `parent`'s map (the last level grown by `grow` codes), its
    manifest recording `base` (None: none, as a version of an older gti); returns its record."""
    table = R.lineage_dir(run).table(parent.hash)
    sizes = list(parent.codebook_sizes[:-1]) + [parent.codebook_sizes[-1] + grow]
    t = assign_new_items(table, [f"new{k}"], [[1, 0]], list(parent.codebook_sizes)).table
    v = make_version(t, parent.codebooks_hash, sizes, parent=parent, created=float(k))
    vdir = R.refresh_root(run) / f"v{k}"
    (vdir / "sid").mkdir(parents=True)
    write_map(vdir / R.MAP_REL, t, v)
    Manifest(stage="refresh", fingerprint=f"v{k}", config={}, facts={} if base is None else {"base": base}).write(vdir)
    R.lineage_dir(run).add(v, t)
    return v


def test_resolve_a_run_never_refreshed_is_its_own_stages(tmp_path):
    run, v0 = _run_with_model(tmp_path)
    at = R.resolve(run)
    assert (at.k, at.stage, at.model_dir, at.refreshes, at.record) == (0, "sft", run / "sft" / "model", (), None)
    assert at.map_path == run / "sid" / "sid_map.parquet" and at.map_hash == v0.hash
    assert at.codebook_sizes == tuple(v0.codebook_sizes) and at.base == R.base_record(run)
    assert R.resolve(run, 0) == at and R.resolve(run, find_model=False).stage is None
    with pytest.raises(R.RunDirError, match=r"no finished refresh version 1 \(have: none\)"):
        R.resolve(run, 1)


def test_resolve_falls_back_to_ground_and_names_what_is_missing(tmp_path):
    run, _ = _run_with_model(tmp_path, stage="ground")
    assert R.resolve(run).stage == "ground"
    (run / "ground" / MANIFEST_NAME).unlink()
    (run / "ground" / "model" / "config.json").unlink()
    with pytest.raises(R.RunDirError, match="no exported model"):
        R.resolve(run)
    assert R.resolve(run, find_model=False).model_dir is None  # another model is paired with the map
    (run / "sid" / MANIFEST_NAME).unlink()
    with pytest.raises(R.RunDirError, match="no finished sid stage"):
        R.resolve(run)
    with pytest.raises(R.RunDirError, match="run directory not found"):
        R.resolve(tmp_path / "missing")


def test_resolve_takes_the_newest_refresh_and_version_picks_one(tmp_path):
    run, v0 = _run_with_model(tmp_path)
    base = R.base_record(run)
    v1 = _publish(run, 1, v0, base)
    v2 = _publish(run, 2, v1, None, grow=1)  # written before bases were recorded: kept
    at = R.resolve(run)
    assert (at.k, at.stage, at.map_hash, at.record) == (2, "refresh/v2", v2.hash, v2)
    assert at.model_dir == run / "refresh" / "v2" / "model" and at.map_path == run / "refresh" / "v2" / R.MAP_REL
    assert [v.k for v in at.refreshes] == [1, 2] and at.codebook_sizes == tuple(v2.codebook_sizes)
    assert at.codebook_sizes[-1] == v0.codebook_sizes[-1] + 1  # the grown level, not the sid stage's
    one = R.resolve(run, 1)
    assert (one.k, one.map_hash, [v.k for v in one.refreshes]) == (1, v1.hash, [1])
    zero = R.resolve(run, 0)
    assert (zero.k, zero.stage, zero.map_hash, zero.refreshes) == (0, "sft", v0.hash, ())
    assert R.chosen_version(run, None).k == 2 and R.chosen_version(run, 0) is None


def test_a_refresh_made_on_an_older_base_is_skipped_with_one_note(tmp_path):
    run, v0 = _run_with_model(tmp_path)
    _publish(run, 1, v0, R.base_record(run))
    Manifest(stage="sft", fingerprint="retrained", config={}, outputs={"model": "model"}).write(run / "sft")
    notes: list[str] = []
    at = R.resolve(run, note=notes.append)
    assert (at.k, at.stage, at.refreshes) == (0, "sft", ()) and at.base["model_fingerprint"] == "retrained"
    assert len(notes) == 1 and "\n" not in notes[0]
    assert f"{run / 'refresh' / 'v1'} is skipped: it was refreshed from another base of this run" in notes[0]
    assert "sft model trained" in notes[0] and "sft model retrained" in notes[0]
    assert R.current_versions(run, note=notes.append) == [] and len(R.refresh_versions(run)) == 1
    notes.clear()
    with pytest.raises(R.RunDirError, match=r"v1 cannot be used: it was refreshed from another base"):
        R.resolve(run, 1, note=notes.append)
    assert notes == [] and R.next_version(run) == 2  # never numbered over


def test_note_once_says_a_line_once_per_process(monkeypatch, capsys):
    monkeypatch.setattr(R, "_noted", set())
    R.note_once("a version is skipped")
    R.note_once("a version is skipped")
    assert capsys.readouterr().err == "gti: note: a version is skipped\n"
