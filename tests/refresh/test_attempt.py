"""gti.refresh.attempt: the config a refresh runs with, the version it builds on, and the Job the
steps share (on the fake run of conftest.py; no model, no Ray)."""

from __future__ import annotations

import json
import shutil

import pytest

from gti import config as C
from gti.common.errors import ConfigError
from gti.refresh.attempt import Job, RefreshError, RefreshResult, find_parent, load_run_config, read_manifest


def test_run_config_is_the_trained_models_with_the_new_files(fake_run, tmp_path):
    (fake_run.dir / "config.yaml").write_text(C.dump(C.load(None, ["data.max_items=300", "seed=1"])))
    sft = C.load(None, ["data.max_items=300", "data.max_users=20", "seed=5", "sft.steps=9"])
    (fake_run.dir / "sft" / "config.yaml").write_text(C.dump(sft))
    cfg = load_run_config(fake_run.dir, "new.csv", "events.csv", ["refresh.ground_steps=3"])
    assert cfg.seed == 5 and cfg.sft.steps == 9  # sft/config.yaml wins over the run's
    assert cfg.data.items.path == "new.csv" and cfg.data.interactions.path == "events.csv"
    assert cfg.data.max_items is None and cfg.data.max_users is None  # caps never cut new items
    assert cfg.refresh.ground_steps == 3 and cfg.run_dir == str(fake_run.dir)
    old_inter = cfg.data.interactions.path
    assert load_run_config(fake_run.dir, "new.csv", None).data.interactions.path != old_inter
    with pytest.raises(ConfigError, match="refresh.nope"):
        load_run_config(fake_run.dir, "new.csv", None, ["refresh.nope=1"])


def test_missing_stage_is_one_refresh_error(fake_run):
    assert read_manifest(fake_run.dir, "sid").fact("sid_map_hash") == fake_run.map_hash
    shutil.rmtree(fake_run.dir / "pairs")
    with pytest.raises(RefreshError, match="stage 'pairs' has not completed; refresh needs a trained run"):
        find_parent(fake_run.dir)


def test_parent_of_a_run_never_refreshed_is_the_run(fake_run):
    p = find_parent(fake_run.dir)
    assert p.k == 0 and p.hash == fake_run.map_hash and p.model_dir == fake_run.model_dir
    assert p.map_path == fake_run.dir / "sid" / "sid_map.parquet"
    assert p.interactions_path == fake_run.dir / "ingest" / "interactions.parquet"
    assert p.pair_files == [fake_run.dir / "pairs" / "pairs.parquet"]
    assert p.sequences_path is None and p.sequences_split is None  # the fake ingest records neither
    shutil.rmtree(fake_run.dir / "sft")
    with pytest.raises(RefreshError, match="no exported model"):
        find_parent(fake_run.dir)


def test_parent_is_the_newest_refresh_with_every_refreshs_new_pairs(fake_run):
    import pyarrow.parquet as pq

    from gti.sid.versions import make_version, write_map

    table = pq.read_table(str(fake_run.dir / "sid" / "sid_map.parquet"))
    for k in (1, 2):
        v = fake_run.dir / "refresh" / f"v{k}"
        (v / "sid").mkdir(parents=True)
        (v / "ingest").mkdir()
        t = table.slice(0, 5 - k)  # a different map per version (fewer items)
        write_map(v / "sid" / "sid_map.parquet", t, make_version(t, "cb", [4, 4, 2], note=f"v{k}"))
        (v / "_manifest.json").write_text("{}")
        (v / "pairs_new.parquet").write_bytes(b"")
        if k == 1:
            (v / "ingest" / "interactions.parquet").write_bytes(b"")
    (fake_run.dir / "refresh" / "v3").mkdir()  # no manifest: not a version
    p = find_parent(fake_run.dir)
    v2 = fake_run.dir / "refresh" / "v2"
    assert p.k == 2 and p.map_path == v2 / "sid" / "sid_map.parquet" and p.model_dir == v2 / "model"
    assert p.pair_files == [fake_run.dir / "pairs" / "pairs.parquet", fake_run.dir / "refresh" / "v1" / "pairs_new.parquet",
                            v2 / "pairs_new.parquet"]
    assert p.interactions_path == fake_run.dir / "refresh" / "v1" / "ingest" / "interactions.parquet"
    assert p.sequences_path == p.interactions_path.with_name("sequences.parquet") and p.sequences_split is None
    from gti.sid.versions import read_version

    assert p.hash == read_version(v2 / "sid" / "sid_map.parquet").hash != fake_run.map_hash


def test_job_reads_the_assigned_items_and_result_paths(make_job, tmp_path):
    job = make_job()
    assert isinstance(job, Job) and job.k == 1 and not job.interactions_given
    (job.work / "sid").mkdir()
    (job.work / "sid" / "new_items.json").write_text(json.dumps({"assigned": ["n2", "n1"], "already_present": []}))
    assert job.assigned() == ["n2", "n1"]
    r = RefreshResult(k=1, dir=tmp_path / "v1", parent_hash="p", new_hash="n", facts={})
    assert r.model_dir == tmp_path / "v1" / "model" and r.map_path == tmp_path / "v1" / "sid" / "sid_map.parquet"


def test_trust_remote_code_comes_only_from_the_callers_flag(fake_run, monkeypatch):
    """A run folder's `model.trust_remote_code: true` is ignored with one note; the tokenizer
    (and every loader reading job.cfg.model) gets the caller's flag; an override is refused."""
    import transformers

    cfg_path = fake_run.dir / "config.yaml"
    cfg_path.write_text(C.dump(C.load(None, [f"run_dir={fake_run.dir}", "embed.encoder=hash", "embed.dim=16",
                                            "model.trust_remote_code=true"])))
    notes: list[str] = []
    cfg = load_run_config(fake_run.dir, "new.csv", None, note=notes.append)
    assert cfg.model.trust_remote_code is False
    assert len(notes) == 1 and str(cfg_path) in notes[0] and "trust_remote_code: true is ignored" in notes[0]
    notes.clear()
    assert load_run_config(fake_run.dir, "new.csv", None, (), True, note=notes.append).model.trust_remote_code
    assert notes == []
    with pytest.raises(ConfigError, match="model.trust_remote_code: not a refresh override; pass --trust-remote-code"):
        load_run_config(fake_run.dir, "new.csv", None, ["model.trust_remote_code=true"])

    seen = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path, **kw: seen.append(kw["trust_remote_code"]) or
                        type("Tok", (), {"pad_token_id": 0})())
    job = Job(fake_run.dir, cfg, find_parent(fake_run.dir), fake_run.dir / "w", 1, {}, "cb", notes.append, False)
    job.tokenizer()
    assert seen == [False]


def _version(run, k: int, base: dict | None) -> None:
    """refresh/v<k> with a map of its own and a manifest recording `base` (None: none recorded,
    as a version written by an older gti)."""
    import pyarrow.parquet as pq

    from gti.run.manifest import Manifest
    from gti.sid.versions import make_version, write_map

    table = pq.read_table(str(run / "sid" / "sid_map.parquet"))
    v = run / "refresh" / f"v{k}"
    (v / "sid").mkdir(parents=True)
    t = table.slice(0, 5 - k)
    write_map(v / "sid" / "sid_map.parquet", t, make_version(t, "cb", [4, 4, 2], note=f"v{k}"))
    Manifest(stage="refresh", fingerprint=f"v{k}", config={},
             facts={} if base is None else {"base": base}).write(v)


def test_a_version_made_on_another_base_is_skipped_and_numbering_continues(fake_run):
    """After the run retrains (its model stage's manifest changes), find_parent skips v1 with
    one line naming it and builds on the run again; the next version is v2, never v1 again."""
    from gti.run.manifest import Manifest
    from gti.run.versions import base_record, next_version

    run = fake_run.dir
    _version(run, 1, base_record(run))
    notes: list[str] = []
    assert find_parent(run, note=notes.append).k == 1 and notes == []

    Manifest(stage="sft", fingerprint="retrained", config={}, outputs={"model": "model"}).write(run / "sft")
    p = find_parent(run, note=notes.append)
    assert p.k == 0 and p.hash == fake_run.map_hash and p.model_dir == fake_run.model_dir
    assert p.base == base_record(run) and p.base["model_fingerprint"] == "retrained"
    assert p.pair_files == [run / "pairs" / "pairs.parquet"]  # nothing of v1 either
    assert len(notes) == 1 and "\n" not in notes[0]
    assert f"{run / 'refresh' / 'v1'} is skipped: it was refreshed from another base of this run" in notes[0]
    assert "sft model None" in notes[0] and "sft model retrained" in notes[0]
    assert next_version(run) == 2

    _version(run, 2, None)  # written before bases were recorded: nothing to compare, kept
    notes.clear()
    assert find_parent(run, note=notes.append).k == 2 and len(notes) == 1
