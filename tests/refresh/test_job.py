"""gti.refresh.job: the config a refresh runs with, the version it builds on, and the Job the
steps share (on the fake run of conftest.py; no model, no Ray)."""

from __future__ import annotations

import json
import shutil

import pytest

from gti import config as C
from gti.refresh.job import Job, RefreshError, RefreshResult, find_parent, load_run_config, read_manifest


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
    with pytest.raises(C.ConfigError, match="refresh.nope"):
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
