"""The pipeline driver on fake stages: order, skipping, invalidation, atomicity, resume."""

import errno
import sys
import types

import pytest

from gti import config as C
from gti.run import pipeline as P
from gti.run.contract import StageResult, StageSpec
from gti.run.manifest import Manifest

CALLS: list[str] = []


def _fake_module(name, crash_flag=None):
    mod = types.ModuleType(f"fake_stage_{name}")

    def run(ctx):
        CALLS.append(name)
        # Record what the partial dir held before this attempt (resume evidence).
        had_ckpt = (ctx.work_dir / "ckpt").exists()
        (ctx.work_dir / "ckpt").write_text("step 1")
        if crash_flag is not None and crash_flag.get(name):
            exc = crash_flag[name]
            crash_flag[name] = False
            raise exc if isinstance(exc, BaseException) else RuntimeError(f"{name} crashed")
        for dep in ctx.spec.depends:
            assert ctx.input(dep, "out").read_text().startswith(dep)
        (ctx.work_dir / "out.txt").write_text(f"{name} {ctx.cfg.sid.levels}")
        return StageResult(outputs={"out": "out.txt"}, facts={"resumed": had_ckpt})

    mod.run = run
    return mod


@pytest.fixture
def fake(monkeypatch, tmp_path):
    crash = {}
    specs = [
        StageSpec("a", "fake_stage_a", (), ("data",), "a"),
        StageSpec("b", "fake_stage_b", ("a",), ("sid",), "b"),
        StageSpec("c", "fake_stage_c", ("b",), ("ground",), "c"),
    ]
    for s in specs:
        monkeypatch.setitem(sys.modules, s.module, _fake_module(s.name, crash))
    monkeypatch.setattr(P, "STAGES", specs)
    monkeypatch.setattr(P, "STAGE_NAMES", [s.name for s in specs])
    CALLS.clear()
    cfg = C.load(None, [f"run_dir={tmp_path / 'run'}"])
    return cfg, crash


def test_runs_in_order_and_writes_manifests(fake):
    cfg, _ = fake
    out = P.run(cfg, echo=lambda m: None)
    assert CALLS == ["a", "b", "c"]
    run_dir = cfg.resolved_run_dir()
    for s in "abc":
        m = Manifest.read(run_dir / s)
        assert m.stage == s and (run_dir / s / "config.yaml").is_file()
        assert not (run_dir / f".{s}.partial").exists()
        assert not (run_dir / s / "_fingerprint").exists()
    assert out["b"].inputs["stage:a"] == out["a"].fingerprint


def test_up_to_date_stages_are_skipped(fake):
    cfg, _ = fake
    P.run(cfg, echo=lambda m: None)
    CALLS.clear()
    P.run(cfg, echo=lambda m: None)
    assert CALLS == []


def test_change_invalidates_exactly_downstream(fake):
    cfg, _ = fake
    P.run(cfg, echo=lambda m: None)
    CALLS.clear()
    changed = C.validate({**cfg.model_dump(mode="json"), "sid": {**cfg.sid.model_dump(), "levels": 2}})
    P.run(changed, echo=lambda m: None)
    assert CALLS == ["b", "c"]  # a does not read sid.*, so it stays
    CALLS.clear()
    changed2 = C.validate({**changed.model_dump(mode="json"), "ground": {**changed.ground.model_dump(), "lr": 0.5}})
    P.run(changed2, echo=lambda m: None)
    assert CALLS == ["c"]


def test_crash_leaves_no_complete_looking_stage_and_resumes(fake):
    cfg, crash = fake
    P.run(cfg, echo=lambda m: None)
    run_dir = cfg.resolved_run_dir()
    old_b = (run_dir / "b" / "out.txt").read_text()
    changed = C.validate({**cfg.model_dump(mode="json"), "sid": {**cfg.sid.model_dump(), "levels": 2}})
    crash["b"] = True
    CALLS.clear()
    with pytest.raises(RuntimeError, match="b crashed"):
        P.run(changed, echo=lambda m: None)
    # The previous complete output is intact, and it does not look complete for the new config.
    assert (run_dir / "b" / "out.txt").read_text() == old_b
    assert not P.is_complete(P.spec("b"), changed, run_dir)
    assert (run_dir / ".b.partial" / "ckpt").exists()
    CALLS.clear()
    res = P.run(changed, echo=lambda m: None)
    assert CALLS == ["b", "c"]
    assert res["b"].facts["resumed"] is True  # partial dir (checkpoints) was reused
    assert (run_dir / "b" / "out.txt").read_text() == "b 2"


def test_partial_dir_from_other_config_is_discarded(fake):
    cfg, crash = fake
    crash["a"] = True
    with pytest.raises(RuntimeError):
        P.run(cfg, echo=lambda m: None)
    other = C.validate({**cfg.model_dump(mode="json"), "seed": 7})
    res = P.run(other, echo=lambda m: None)
    assert res["a"].facts["resumed"] is False


def test_from_and_to(fake):
    cfg, _ = fake
    with pytest.raises(P.PipelineError, match="needs stage 'a'"):
        P.run(cfg, from_stage="b", echo=lambda m: None)
    P.run(cfg, to_stage="b", echo=lambda m: None)
    assert CALLS == ["a", "b"]
    CALLS.clear()
    P.run(cfg, from_stage="b", echo=lambda m: None)
    assert CALLS == ["b", "c"]  # --from reruns b; c is new
    with pytest.raises(P.PipelineError, match="unknown stage"):
        P.run(cfg, from_stage="zzz", echo=lambda m: None)
    with pytest.raises(P.PipelineError, match="comes after"):
        P.run(cfg, from_stage="c", to_stage="a", echo=lambda m: None)


def test_missing_declared_output_fails(fake, monkeypatch):
    cfg, _ = fake
    mod = sys.modules["fake_stage_a"]
    monkeypatch.setattr(mod, "run", lambda ctx: StageResult(outputs={"x": "nope.parquet"}))
    with pytest.raises(P.PipelineError, match="did not write"):
        P.run(cfg, echo=lambda m: None)
    assert not (cfg.resolved_run_dir() / "a").exists()


def test_secrets_never_reach_manifests(fake, tmp_path):
    cfg, _ = fake
    cfg = C.validate({**cfg.model_dump(mode="json"), "data": {"items": {
        "path": "s3://bucket/items.parquet",
        "storage_options": {"key": "AKIASECRET1", "secret": "s3cr3tvalue", "region": "eu-1"}}}})
    P.run(cfg, to_stage="a", echo=lambda m: None)
    run_dir = cfg.resolved_run_dir()
    for f in [run_dir / "a" / "_manifest.json", run_dir / "a" / "config.yaml", run_dir / "config.yaml"]:
        text = f.read_text()
        assert "AKIASECRET1" not in text and "s3cr3tvalue" not in text, f
        assert "eu-1" in text, f  # non-secret values are kept


def test_real_stage_list_is_consistent():
    names = [s.name for s in P.STAGES]
    assert names == ["ingest", "embed", "sid", "pairs", "ground", "sft", "rl", "evaluate", "report"]
    for i, s in enumerate(P.STAGES):
        assert all(names.index(d) < i for d in s.depends), s.name
        assert all(sec in C.RunConfig.model_fields for sec in s.sections), s.name


@pytest.mark.parametrize("err", [
    OSError(errno.ENOSPC, "No space left on device", "sid_map.parquet"),
    PermissionError(errno.EACCES, "Permission denied", "sid_map.parquet"),
])
def test_disk_full_or_denied_in_gti_run_is_one_line_and_keeps_outputs(fake, capsys, err):
    from gti.cli import main

    cfg, crash = fake
    run_dir = cfg.resolved_run_dir()
    conf = run_dir.parent / "c.yaml"
    conf.write_text(f"run_dir: {run_dir}\n")
    assert main(["run", "-c", str(conf)]) == 0
    before = {s: (run_dir / s / "out.txt").read_text() for s in "abc"}
    capsys.readouterr()
    crash["b"] = err
    assert main(["run", "-c", str(conf), "sid.levels=2"]) == 2
    err_out = capsys.readouterr().err
    assert "Traceback" not in err_out
    msg = err_out.strip().splitlines()[-1]  # after the stage progress lines: one error line
    assert [ln for ln in err_out.splitlines() if "error" in ln] == [msg]
    assert msg.startswith("gti: error: sid_map.parquet: ") and err.strerror in msg
    assert "outputs of completed stages are unchanged" in msg
    # The earlier complete outputs are intact; rerunning the same command resumes and finishes.
    assert {s: (run_dir / s / "out.txt").read_text() for s in "abc"} == before
    assert main(["run", "-c", str(conf), "sid.levels=2"]) == 0
    assert (run_dir / "b" / "out.txt").read_text() == "b 2"


def test_os_error_line_is_one_line_for_any_oserror():
    from gti.cli import os_error_line

    assert os_error_line(OSError()) == "OSError"
    assert os_error_line(OSError("Error closing file\ndetail")) == "Error closing file"
    line = os_error_line(OSError(errno.EROFS, "Read-only file system", "/ro/x"))
    assert line.startswith("/ro/x: Read-only file system (outputs of completed stages are unchanged")
    assert "outputs of completed" not in os_error_line(FileNotFoundError(errno.ENOENT, "No such file", "/x"))
