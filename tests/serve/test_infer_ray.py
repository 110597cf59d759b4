"""gti/serve/infer_ray.py: `gti infer` through the CLI. Without Ray: the parser, one-line errors
before Ray starts, an actor (`PartDecoder`) called in-process writing its parts, and a finished
output that is not decoded again. Slow, on the session's local Ray: a job interrupted after its
first part resumes to the same output as an uninterrupted run, skipping the parts it wrote."""

from __future__ import annotations

import shutil

import numpy as np
import polars as pl
import pytest

from gti import cli
from gti.common.errors import GtiError
from gti.run.manifest import Manifest
from gti.serve import infer as I
from gti.serve import infer_ray as R

USERS = {f"u{u}": [f"it{(5 * u + j) % 20}" for j in range(2 + u % 5)] for u in range(7)}


@pytest.fixture(scope="module")
def seq_run(serve_run, tmp_path_factory):
    """A copy of the tiny run with ingest sequences of USERS (whole history: train + valid + test)."""
    run = tmp_path_factory.mktemp("infer_ray") / "run"
    shutil.copytree(serve_run["run"], run)
    pl.DataFrame({"user_id": list(USERS), "train_items": [h[:-2] for h in USERS.values()],
                  "valid_item": [h[-2] for h in USERS.values()], "test_item": [h[-1] for h in USERS.values()]}
                 ).write_parquet(run / "ingest" / "sequences.parquet")
    Manifest(stage="ingest", fingerprint="f", config={},
             outputs={"items": "items.parquet", "sequences": "sequences.parquet"}).write(run / "ingest")
    return run


@pytest.fixture
def no_ray(monkeypatch):
    """Fails the test if `gti infer` starts or joins Ray."""
    import gti.ray_start as ray_start

    def refuse(cfg):
        raise AssertionError("gti infer started Ray")

    monkeypatch.setattr(ray_start, "ensure_ray", refuse)


def _infer(run, out, *extra) -> int:
    return cli.main(["infer", "--run-dir", str(run), "--users", "all", "--k", "3", "--out", str(out),
                     "--part-rows", "2", "--batch-users", "2", "--concurrency", "1", *extra])


def test_the_parser_takes_the_issues_flags():
    args = cli.build_parser().parse_args(["infer", "--run-dir", "r", "--users", "all", "--k", "7", "--out", "o.parquet",
                                          "--version", "0", "--exclude-history"])
    assert (args.users, args.k, args.out, args.version, args.exclude_history) == ("all", 7, "o.parquet", 0, True)
    assert args.part_rows is None and args.concurrency is None and not args.force


def test_bad_inputs_are_one_line_before_ray_starts(seq_run, tmp_path, capsys, no_ray):
    (tmp_path / "u.csv").write_text("id\n1\n")
    assert cli.main(["infer", "--run-dir", str(seq_run), "--users", str(tmp_path / "u.csv"), "--out",
                     str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gti: error: --users ") and "no 'user_id' column (it has: id)" in err
    assert err.count("\n") == 1
    assert _infer(seq_run, tmp_path / "o", "--k", "30") == 2
    assert "--k 30 exceeds the catalog of version 1 (22 items)" in capsys.readouterr().err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a.txt").write_text("x")
    assert _infer(seq_run, tmp_path / "mine") == 2
    assert "not a gti infer output (a.txt)" in capsys.readouterr().err


def test_the_actor_writes_its_parts_equal_to_the_decode(seq_run, services, tmp_path):
    job = I.plan_job(seq_run, "all", tmp_path / "out", k=3, part_rows=2, batch_users=2)
    I.prepare_out(job.out, job.key)
    actor = R.PartDecoder(str(seq_run), 1, job.key["map_hash"], str(job.out), 3, False, 2)
    import pyarrow as pa

    summary = actor(pa.concat_tables([R.part_rows_table(job, p) for p in job.parts[:2]])).to_pylist()
    assert [(s["part"], s["rows"], s["errors"]) for s in summary] == [(0, 2, 0), (1, 2, 0)]
    got = I.read_output(job.out).to_pylist()
    for row in got:
        ref = services[1].run.recommend(USERS[row["user_id"]], 3)
        assert row["item_ids"] == [r["item_id"] for r in ref]
        np.testing.assert_allclose(row["scores"], [r["score"] for r in ref], rtol=1e-6, atol=1e-5)
    with pytest.raises(GtiError, match="the actor loaded SID map .* the job planned deadbeef"):
        R.PartDecoder(str(seq_run), 1, "deadbeef", str(job.out), 3, False, 2)


def test_a_finished_output_is_not_decoded_again(seq_run, tmp_path, capsys, no_ray):
    job = I.plan_job(seq_run, "all", tmp_path / "out", k=3, part_rows=2, batch_users=2)
    I.prepare_out(job.out, job.key)
    actor = R.PartDecoder(str(seq_run), 1, job.key["map_hash"], str(job.out), 3, False, 2)
    import pyarrow as pa

    actor(pa.concat_tables([R.part_rows_table(job, p) for p in job.parts]))
    assert _infer(seq_run, job.out) == 0
    assert "resuming: 4 of 4 part(s) (7 users) already written" in capsys.readouterr().err
    man = I.read_manifest(job.out)
    assert man["state"] == "complete" and man["resumed_parts"] == 4 and man["decoded_users"] == 0


def test_a_small_catalog_is_decoded_in_this_process(seq_run, services, tmp_path, capsys, no_ray):
    """Without --concurrency, a catalog of at most local_max_items items with one CPU decoder is
    decoded in this process (no Ray), as the evaluate stage does, to the same items."""
    out = tmp_path / "here.parquet"
    assert cli.main(["infer", "--run-dir", str(seq_run), "--users", "all", "--k", "3", "--out", str(out),
                     "--part-rows", "2", "--batch-users", "2"]) == 0
    assert "decoded in this process" in capsys.readouterr().err
    got = I.read_output(out).to_pylist()
    assert [r["user_id"] for r in got] == list(USERS)
    for row in got:
        ref = services[1].run.recommend(USERS[row["user_id"]], 3)
        assert row["item_ids"] == [r["item_id"] for r in ref]
    assert I.read_manifest(out)["state"] == "complete"
    job = I.plan_job(seq_run, "all", out, k=3)
    assert R.decode_here(job, None, 0.0) and not R.decode_here(job, 1, 0.0) and not R.decode_here(job, None, 1.0)


def _free_cpus() -> float:
    import ray

    return ray.available_resources().get("CPU", 0.0)


def _wait_for_pool_gone(free_before: float, timeout_s: float = 60.0) -> None:
    """Until the CPUs free before any decoder pool are free again: the pool's actors are dead."""
    import time

    deadline = time.monotonic() + timeout_s
    while _free_cpus() < free_before:
        assert time.monotonic() < deadline, f"decoder actors still hold CPUs after {timeout_s:.0f} s"
        time.sleep(0.2)


@pytest.mark.slow
def test_interrupted_infer_resumes_to_the_same_output(seq_run, tmp_path, monkeypatch, capsys, ray_start_4_cpus):
    """The CLI on Ray Data: an uninterrupted run, then a run stopped after its first part (Ctrl-C),
    its later parts removed and a half-written temp left as a kill would, then resumed."""
    free_before = _free_cpus()
    assert _infer(seq_run, tmp_path / "ref") == 0
    reference = I.read_output(tmp_path / "ref")
    assert reference.column("user_id").to_pylist() == list(USERS)

    def stop(part):
        raise KeyboardInterrupt

    monkeypatch.setattr(R, "_on_part", stop)
    out = tmp_path / "recs.parquet"
    assert _infer(seq_run, out) == 130
    assert I.read_manifest(out)["state"] == "running"
    _wait_for_pool_gone(free_before)  # a killed decoder's last write must land before the folder is edited
    for late in ("part-00002.parquet", "part-00003.parquet"):  # as if the kill came before them
        (out / late).unlink(missing_ok=True)
    (out / ".part-00002.parquet.k1ll.tmp").write_bytes(b"PAR1 half")
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    assert kept and len(kept) < 4
    capsys.readouterr()
    monkeypatch.setattr(R, "_on_part", None)
    assert _infer(seq_run, out) == 0
    assert f"resuming: {len(kept)} of 4 part(s)" in capsys.readouterr().err
    assert {n: (out / n).stat().st_mtime_ns for n in kept} == kept  # skipped, not rewritten
    got = I.read_output(out)
    assert got.drop_columns(["scores"]).equals(reference.drop_columns(["scores"]))
    for a, b in zip(got.column("scores").to_pylist(), reference.column("scores").to_pylist()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    man = I.read_manifest(out)
    assert man["state"] == "complete" and man["resumed_parts"] == len(kept) and not list(out.glob(".part-*.tmp"))


class _FakeRoll:
    """Stands in for `R.DecoderRoll` (no Ray): records when `stop` begins and returns."""

    def __init__(self, events: list, name: str = "roll-test") -> None:
        self.events, self.name = events, name

    def stop(self, log, timeout_s: float = 0.0) -> list:
        import time

        self.events.append("stop: begin")
        time.sleep(0.05)  # the decoders exiting
        self.events.append("stop: returned")
        return []


def test_ctrl_c_unlocks_the_output_only_after_the_decoders_exited(seq_run, tmp_path, monkeypatch):
    """Interrupted on the pool path: the executor is closed, then the roll's stop (kill and
    wait) returns, and only then is the output's run lock released (fakes for Ray and the lock)."""
    import pyarrow as pa

    import gti.ray_start as ray_start
    import gti.run.runlock as runlock

    events: list[str] = []

    class FakeDataset:
        def iter_batches(self, **kw):
            try:
                events.append("pool: first part")
                yield pa.table({"part": [0], "rows": [2], "errors": [0], "seconds": [0.1]})
                yield pa.table({"part": [1], "rows": [2], "errors": [0], "seconds": [0.1]})
            finally:
                events.append("pool: closed")

    class FakeLock:
        def __init__(self, folder, what=None):
            self.folder = folder

        def __enter__(self):
            events.append("lock: held")
            return self

        def __exit__(self, *exc):
            events.append("lock: released")
            return False

    def interrupt(part):
        raise KeyboardInterrupt

    monkeypatch.setattr(ray_start, "ensure_ray", lambda cfg: None)
    monkeypatch.setattr(runlock, "RunLock", FakeLock)
    monkeypatch.setattr(R, "_pool", lambda job, todo, conc, gpus, trc, roll=None: FakeDataset())
    monkeypatch.setattr(R.DecoderRoll, "start", classmethod(lambda cls: _FakeRoll(events)))
    monkeypatch.setattr(R, "_on_part", interrupt)
    assert _infer(seq_run, tmp_path / "out") == 130
    assert events == ["lock: held", "pool: first part", "pool: closed", "stop: begin", "stop: returned",
                      "lock: released"]
    assert I.read_manifest(tmp_path / "out")["state"] == "running"  # not marked complete


def test_the_roll_is_stopped_when_the_pool_fails_too(seq_run, tmp_path, monkeypatch):
    """A decoder error (not a Ctrl-C): the same order, and the error reaches the caller."""
    import gti.ray_start as ray_start

    events: list[str] = []

    class Failing:
        def iter_batches(self, **kw):
            events.append("pool: started")
            raise RuntimeError("a decoder died")
            yield  # pragma: no cover - a generator

    monkeypatch.setattr(ray_start, "ensure_ray", lambda cfg: None)
    monkeypatch.setattr(R, "_pool", lambda *a, **kw: Failing())
    monkeypatch.setattr(R.DecoderRoll, "start", classmethod(lambda cls: _FakeRoll(events)))
    job = I.plan_job(seq_run, "all", tmp_path / "out", k=3, part_rows=2, batch_users=2)
    with pytest.raises(RuntimeError, match="a decoder died"):
        R.run_parts(job, job.parts, 0, concurrency=1, num_gpus=0.0, log=lambda m: None)
    assert events == ["pool: started", "stop: begin", "stop: returned"]


def test_wait_exited_kills_each_and_waits_for_every_one_through_a_second_ctrl_c():
    """`wait_exited` with fake members: each is killed once, the wait lasts until the last one
    is seen gone (a Ctrl-C meanwhile does not end it), a member that never exits is reported."""
    killed, polls, said = [], {"a": 2, "b": 5}, []
    interrupted = []

    def exited(m):
        polls[m[0]] -= 1
        if m[0] == "b" and polls["b"] == 3 and not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return polls[m[0]] <= 0

    members = [("a", "node", 11), ("b", "node", 12)]
    left = R.wait_exited(members, 30.0, said.append, kill=killed.append, exited=exited, sleep=lambda s: None)
    assert left == [] and killed == members and interrupted
    assert polls["b"] == 0 and polls["a"] <= 0  # polled until the last one was gone
    assert said == ["stopping: waiting for 2 decoder(s) to exit before the output is unlocked"]
    said.clear()
    left = R.wait_exited([("c", "node", 13)], 0.05, said.append, kill=lambda m: None, exited=lambda m: False)
    assert left == [("c", "node", 13)] and "1 decoder(s) not seen to exit within 0 s (pids 13)" in said[0]


def test_a_decoder_refuses_a_model_changed_since_the_plan(seq_run, tmp_path):
    job = I.plan_job(seq_run, "all", tmp_path / "out", k=3, part_rows=2, batch_users=2)
    planned = {"model_fingerprint": job.key["model_fingerprint"], "model_created": job.key["model_created"]}
    R.PartDecoder(str(seq_run), 1, job.key["map_hash"], str(job.out), 3, False, 2, model=planned)
    with pytest.raises(GtiError, match="the model changed since the job was planned \\(fingerprint old -> "):
        R.PartDecoder(str(seq_run), 1, job.key["map_hash"], str(job.out), 3, False, 2,
                      model=dict(planned, model_fingerprint="old"))
