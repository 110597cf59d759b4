"""gti/serve/infer.py on the tiny run of tests/serve/conftest.py (plus ingest sequences), without
Ray: users from the run or a file (and the one-line errors for a bad one), parts, rows equal to
`gti recommend`'s, atomic parts, resume that skips finished parts and never takes a temp or
another plan's file as done, and the output folder's manifest."""

from __future__ import annotations

import json
import shutil

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from gti.common.errors import ConfigError, DataError
from gti.run.manifest import Manifest
from gti.run.versions import RunDirError
from gti.serve import infer as I

SEQS = {  # user -> (train items, valid, test): whole histories of 5..8 known items
    f"u{u}": ([f"it{(3 * u + j) % 20}" for j in range(3 + u % 4)], f"it{(u + 7) % 20}", f"it{(u + 11) % 20}")
    for u in range(7)
}


def add_sequences(run, seqs=SEQS) -> None:
    """The run's ingest stage with a sequences.parquet (the serve fixture has items only)."""
    frame = pl.DataFrame({"user_id": list(seqs), "train_items": [v[0] for v in seqs.values()],
                          "valid_item": [v[1] for v in seqs.values()], "test_item": [v[2] for v in seqs.values()]})
    frame.write_parquet(run / "ingest" / "sequences.parquet")
    Manifest(stage="ingest", fingerprint="f", config={},
             outputs={"items": "items.parquet", "sequences": "sequences.parquet"}).write(run / "ingest")


@pytest.fixture(scope="module")
def seq_run(serve_run, tmp_path_factory):
    """A copy of the tiny run (v0 and v1) with ingest sequences for SEQS."""
    run = tmp_path_factory.mktemp("infer") / "run"
    shutil.copytree(serve_run["run"], run)
    add_sequences(run)
    return run


def _history(u: str) -> list[str]:
    train, valid, test = SEQS[u]
    return [*train, valid, test]


def _run_serial(job, svc, only=None) -> list[int]:
    """The job's parts decoded and written in this process (what each actor does); -> parts done."""
    done = []
    for p in job.parts:
        if only is not None and p.index not in only:
            continue
        sl = job.users.slice(p.start, p.rows)
        I.write_part(job.out, p.index, I.decode_part(
            svc, sl["user_id"].to_list(), sl["history"].to_list(), k=job.key["k"],
            exclude_history=job.key["exclude_history"], batch_users=job.key["batch_users"]))
        done.append(p.index)
    return done


def test_plan_parts_cover_the_users_in_order():
    parts = I.plan_parts(10, 3)
    assert [(p.index, p.start, p.stop) for p in parts] == [(0, 0, 3), (1, 3, 6), (2, 6, 9), (3, 9, 10)]
    assert I.plan_parts(0, 3) == [] and I.part_name(3) == "part-00003.parquet"
    with pytest.raises(ConfigError, match="--part-rows must be >= 1"):
        I.plan_parts(5, 0)


def test_rows_equal_gti_recommend(services):
    """Each row = `gti recommend`'s answer for that history (LoadedRun.recommend -> top_k)."""
    svc = services[0]
    hists = [["it3", "it7", "it1"], ["it2"], ["it9", "it4", "it11", "it0", "it5", "it6", "it8"], ["nope", "it5"],
             ["nope"], []]
    users = [f"user{i}" for i in range(len(hists))]
    table = I.decode_part(svc, users, hists, k=5, exclude_history=False, batch_users=4)
    assert table.schema == I.OUT_SCHEMA and table.column("user_id").to_pylist() == users
    rows = table.to_pylist()
    for hist, row in zip(hists[:4], rows):
        ref = svc.run.recommend([h for h in hist if h != "nope"], 5)
        assert row["item_ids"] == [r["item_id"] for r in ref] and row["sids"] == [r["sid"] for r in ref]
        np.testing.assert_allclose(row["scores"], [r["score"] for r in ref], rtol=1e-6, atol=1e-5)
        assert row["error"] is None
    assert rows[2]["history_used"] == 4  # the newest max_history items, as gti recommend
    assert rows[4]["item_ids"] == [] and "no item of the history is in the catalog" in rows[4]["error"]
    assert rows[5]["item_ids"] == [] and "history is empty" in rows[5]["error"]


def test_exclude_history_leaves_the_history_out(services):
    hist = ["it3", "it7", "it1"]
    row = I.decode_part(services[0], ["a"], [hist], k=5, exclude_history=True, batch_users=8).to_pylist()[0]
    full = [r["item_id"] for r in services[0].run.recommend(hist, 8)]
    assert row["item_ids"] == [i for i in full if i not in hist][:5]


def test_users_all_are_the_runs_whole_sequences(seq_run):
    users, source = I.read_users("all", seq_run, 0)
    assert users["user_id"].to_list() == list(SEQS) and source.startswith("all (")
    assert users["history"].to_list() == [_history(u) for u in SEQS]


def test_users_all_on_a_time_split_run_see_every_period(seq_run, tmp_path):
    """data.split: global_time writes valid_items / test_items lists (valid_item / test_item
    null): a user's history is train + every valid-period + every test-period item."""
    run = tmp_path / "run"
    shutil.copytree(seq_run, run)
    frame = pl.DataFrame({"user_id": ["a", "b"], "train_items": [["it1", "it2"], ["it3"]],
                          "valid_item": [None, None], "test_item": [None, None],
                          "valid_items": [["it4"], []], "test_items": [["it5", "it6"], ["it7"]]},
                         schema_overrides={"valid_item": pl.Utf8, "test_item": pl.Utf8})
    frame.write_parquet(run / "ingest" / "sequences.parquet")
    users, _ = I.read_users("all", run, 0)
    assert users["history"].to_list() == [["it1", "it2", "it4", "it5", "it6"], ["it3", "it7"]]


def test_users_from_files(seq_run, tmp_path):
    pq.write_table(pl.DataFrame({"user_id": ["x", "y"], "history": [["it1", "it2"], ["it3"]]}).to_arrow(),
                   tmp_path / "u.parquet")
    users, _ = I.read_users(str(tmp_path / "u.parquet"), seq_run, 0)
    assert users.to_dicts() == [{"user_id": "x", "history": ["it1", "it2"]}, {"user_id": "y", "history": ["it3"]}]
    (tmp_path / "u.csv").write_text('user_id,history\n7,"it1, it2"\n8,\n')
    users, _ = I.read_users(str(tmp_path / "u.csv"), seq_run, 0)
    assert users.to_dicts() == [{"user_id": "7", "history": ["it1", "it2"]}, {"user_id": "8", "history": []}]
    (tmp_path / "u.jsonl").write_text('{"user_id": 5, "history": ["it4"]}\n')
    assert I.read_users(str(tmp_path / "u.jsonl"), seq_run, 0)[0].to_dicts() == [{"user_id": "5", "history": ["it4"]}]
    # Without a history column the run's sequences give it; an unknown user gets none.
    (tmp_path / "ids.csv").write_text("user_id\nu2\nghost\nu0\n")
    users, _ = I.read_users(str(tmp_path / "ids.csv"), seq_run, 0)
    assert users.to_dicts() == [{"user_id": "u2", "history": _history("u2")}, {"user_id": "ghost", "history": []},
                                {"user_id": "u0", "history": _history("u0")}]


@pytest.mark.parametrize("name, content, match", [
    ("missing.parquet", None, "no such file"),
    ("u.xlsx", "x", "unknown format '.xlsx'"),
    ("u.csv", "id,items\n1,it1\n", "no 'user_id' column \\(it has: id, items\\)"),
    ("u.jsonl", '{"user_id": "a", "history": 3}\n', "column 'history' is Int64"),
    ("u.parquet", "not parquet", "cannot read it as parquet"),
    ("u.csv", "user_id,history\n", "no rows"),
])
def test_a_bad_users_file_is_one_line(seq_run, tmp_path, name, content, match):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=match) as err:
        I.read_users(str(path), seq_run, 0)
    assert "\n" not in str(err.value)


def test_plan_job_fixes_the_version_and_refuses_a_k_over_the_catalog(serve_run, seq_run, tmp_path):
    job = I.plan_job(seq_run, "all", tmp_path / "out", k=3, part_rows=3)
    assert job.key["version"] == 1 and job.key["model"] == "refresh/v1"  # the newest, as gti recommend
    assert job.key["map_hash"] == serve_run["v1_hash"] and job.key["n_users"] == len(SEQS)
    assert [p.rows for p in job.parts] == [3, 3, 1] and job.key["batch_users"] == 32  # serve.infer_batch_users, not eval.batch_users (8)
    v0 = I.plan_job(seq_run, "all", tmp_path / "out", k=3, version=0)
    assert v0.key["map_hash"] == serve_run["base_hash"] and v0.key["model"] == "sft"
    assert v0.key["users_sha256"] == job.key["users_sha256"]
    with pytest.raises(ConfigError, match="--k 21 exceeds the catalog of version 0 \\(20 items\\)"):
        I.plan_job(seq_run, "all", tmp_path / "out", k=21, version=0)
    with pytest.raises(RunDirError, match="no finished refresh version 5"):
        I.plan_job(seq_run, "all", tmp_path / "out", k=3, version=5)
    (tmp_path / "u.csv").write_text("user_id,history\nu0,it1\n")
    other = I.plan_job(seq_run, str(tmp_path / "u.csv"), tmp_path / "out", k=3)
    assert other.key["users_sha256"] != job.key["users_sha256"]


def test_resume_skips_finished_parts_and_never_reads_a_temp(seq_run, services, tmp_path, monkeypatch):
    job = I.plan_job(seq_run, "all", tmp_path / "out", k=4, part_rows=3, batch_users=2)
    assert I.prepare_out(job.out, job.key) is None  # a new folder
    assert _run_serial(job, services[1]) == [0, 1, 2]
    I.finish_manifest(job.out, job.key, job.parts, {})
    reference = I.read_output(job.out)
    assert reference.column("user_id").to_pylist() == list(SEQS)
    (job.out / ".gti.lock").write_text("{}")
    assert pq.read_table(job.out).num_rows == len(SEQS)  # a parquet reader skips the manifest and lock
    # A kill: part 1 never renamed into place (its temp half-written), part 2 gone.
    half = (job.out / "part-00001.parquet").read_bytes()[:100]
    (job.out / "part-00001.parquet").unlink()
    (job.out / ".part-00001.parquet.x1y2.tmp").write_bytes(half)
    (job.out / "part-00002.parquet").unlink()
    assert I.finished_parts(job.out, job.users, job.parts) == {0}
    again = I.plan_job(seq_run, "all", tmp_path / "out", k=4, part_rows=3, batch_users=2)
    assert I.prepare_out(again.out, again.key)["key"] == job.key  # the same job: resumed
    assert not list(job.out.glob(".part-*.tmp"))  # the temp is removed, never read
    todo = {p.index for p in again.parts} - I.finished_parts(again.out, again.users, again.parts)
    before = (job.out / "part-00000.parquet").stat().st_mtime_ns
    assert _run_serial(again, services[1], only=todo) == [1, 2]
    assert (job.out / "part-00000.parquet").stat().st_mtime_ns == before
    assert I.read_output(job.out).equals(reference)


def test_a_part_is_done_only_with_the_plans_users(seq_run, services, tmp_path):
    job = I.plan_job(seq_run, "all", tmp_path / "out", k=2, part_rows=3)
    I.prepare_out(job.out, job.key)
    _run_serial(job, services[1], only={0, 1})
    (job.out / "part-00001.parquet").write_bytes(b"PAR1 garbage")  # unreadable
    (job.out / "part-00002.parquet").write_bytes((job.out / "part-00000.parquet").read_bytes())  # other users
    assert I.finished_parts(job.out, job.users, job.parts) == {0}


def test_prepare_out_refuses_what_is_not_this_jobs(seq_run, tmp_path):
    job = I.plan_job(seq_run, "all", tmp_path / "out", k=2, part_rows=3)
    (tmp_path / "file.parquet").write_text("x")
    with pytest.raises(I.InferOutputError, match="is a file"):
        I.prepare_out(tmp_path / "file.parquet", job.key)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(I.InferOutputError, match="not a gti infer output \\(notes.txt\\)"):
        I.prepare_out(tmp_path / "mine", job.key)
    I.prepare_out(job.out, job.key)
    (job.out / "part-00000.parquet").write_text("old")
    other = dict(job.key, k=5)
    with pytest.raises(I.InferOutputError, match="another gti infer job \\(k: 2 -> 5\\); use a new --out, or --force"):
        I.prepare_out(job.out, other)
    assert I.prepare_out(job.out, other, force=True) is None
    assert not (job.out / "part-00000.parquet").exists()
    assert json.loads((job.out / I.MANIFEST).read_text())["key"]["k"] == 5


def test_the_manifest_names_the_version_and_map(serve_run, seq_run, tmp_path):
    job = I.plan_job(seq_run, "all", tmp_path / "out", k=2, part_rows=4)
    I.prepare_out(job.out, job.key)
    assert I.read_manifest(job.out)["state"] == "running"
    I.finish_manifest(job.out, job.key, job.parts, {"users_per_s": 1.0})
    man = I.read_manifest(job.out)
    assert man["state"] == "complete" and man["parts"] == ["part-00000.parquet", "part-00001.parquet"]
    assert man["key"]["map_hash"] == serve_run["v1_hash"] and man["key"]["version"] == 1
    assert man["columns"] == ["user_id", "item_ids", "sids", "scores", "history_used", "error"]


def _retrain(run, stage: str = "sft", fingerprint: str = "f-new") -> None:
    """What `gti run --from sft` with new settings leaves: the model stage's manifest rewritten
    with another fingerprint (a model trained anew), the sid stage and its map untouched."""
    man = Manifest.read(run / stage)
    man.fingerprint, man.created = fingerprint, man.created + 60.0
    man.write(run / stage)


def test_a_retrained_model_never_resumes_the_old_models_parts(seq_run, services, tmp_path):
    """Issue 51 item 3: the key held stage, map hash, version and users, so after a retrain on
    the same map a rerun into the same --out took every old part as done. The model's manifest
    fingerprint is in the key: the old output is refused (one line) instead."""
    run = tmp_path / "run"
    shutil.copytree(seq_run, run)
    job = I.plan_job(run, "all", tmp_path / "out", k=3, version=0, part_rows=3)
    I.prepare_out(job.out, job.key)
    _run_serial(job, services[0])
    I.finish_manifest(job.out, job.key, job.parts, {})
    _retrain(run)
    again = I.plan_job(run, "all", tmp_path / "out", k=3, version=0, part_rows=3)
    assert (again.key["model"], again.key["map_hash"]) == (job.key["model"], job.key["map_hash"])
    with pytest.raises(I.InferOutputError, match="another gti infer job \\(model_fingerprint: 'f' -> 'f-new'") as err:
        I.prepare_out(again.out, again.key)
    assert "\n" not in str(err.value) and "use a new --out, or --force" in str(err.value)
    assert I.read_manifest(job.out)["state"] == "complete"  # refused: the old output is left as it was
    assert I.prepare_out(again.out, again.key, force=True) is None  # --force: a new output
    assert I.finished_parts(again.out, again.users, again.parts) == set()


def test_the_key_holds_the_model_and_the_decode_settings(seq_run, tmp_path):
    """Every setting a part's rows depend on is in the key: the model's fingerprint and time,
    k, the beam width, history exclusion and length; a changed one is another job."""
    from gti import config as C

    run = tmp_path / "run"
    shutil.copytree(seq_run, run)
    job = I.plan_job(run, "all", tmp_path / "out", k=3, version=0)
    assert job.key["model_fingerprint"] == "f" and isinstance(job.key["model_created"], float)
    assert (job.key["beam_width"], job.key["max_history"], job.key["exclude_history"]) == (20, 4, False)
    v1 = I.plan_job(run, "all", tmp_path / "out", k=3)  # refresh/v1: its manifest has no fingerprint
    assert v1.key["model_fingerprint"].startswith("files:")
    (run / "config.yaml").write_text(C.dump(C.load(None, ["data.max_history=4", "eval.beam_width=24"])))
    wider = I.plan_job(run, "all", tmp_path / "out", k=3, version=0)
    assert wider.key["beam_width"] == 24 and wider.key["model_fingerprint"] == "f"
    I.prepare_out(job.out, job.key)
    with pytest.raises(I.InferOutputError, match="beam_width: 20 -> 24"):
        I.prepare_out(job.out, wider.key)
    with pytest.raises(I.InferOutputError, match="exclude_history: False -> True"):
        I.prepare_out(job.out, dict(job.key, exclude_history=True))
