"""`gti doctor` and the preflight at the start of `gti run`: fast, one line per problem, exit 2,
and nothing reserved or written before it passes."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from gti import cli, preflight
from gti.stages import doctor

CONFIGS = Path(__file__).resolve().parents[2] / "jobs" / "configs"


@pytest.fixture
def simulated(monkeypatch):
    """simulated(cluster, **facts): the preflight sees this cluster and these machine facts."""

    def _set(cluster, **overrides):
        monkeypatch.setattr(doctor, "read_cluster", lambda cfg: (cluster, "simulated cluster", None, False))
        real = preflight.gather_facts

        def fake(*a, **kw):
            return dataclasses.replace(real(*a, **kw), **overrides)

        monkeypatch.setattr(preflight, "gather_facts", fake)

    return _set


def test_doctor_prints_the_table_and_passes_for_tiny(tmp_path, capsys):
    t0 = time.time()
    rc = cli.main(["doctor", "-c", str(CONFIGS / "tiny.yaml"), f"run_dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert time.time() - t0 < 60
    lines = out.splitlines()
    assert lines[0].split() == ["check", "status", "detail"]
    names = {ln.split("  ")[0].strip() for ln in lines[2:-1]}
    assert {"cluster", "resources: ground", "torch build", "backend", "deepspeed", "model", "disk",
            "ray auth", "tracking"} <= names
    assert lines[-1].startswith(f"{len(lines) - 3} checks: no problems")
    assert not (tmp_path / "run").exists()


def test_run_with_use_gpu_on_cpu_torch_fails_in_seconds(tmp_path, capsys, simulated):
    simulated({"CPU": 8.0, "GPU": 2.0}, torch_cuda=None, torch_version="2.13.0+cpu")
    t0 = time.time()
    rc = cli.main(["run", "-c", str(CONFIGS / "tiny.yaml"), f"run_dir={tmp_path / 'run'}", "ground.use_gpu=true"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert time.time() - t0 < 60
    assert err[-1].startswith("gti: error: preflight: ground.use_gpu asks for a GPU but this Python has "
                              "torch 2.13.0+cpu (CPU-only build)")
    assert len([ln for ln in err if ln.startswith("gti: error")]) == 1 and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "run" / "ingest").exists()  # nothing ran


def test_run_on_a_cluster_without_the_gpus_asked_for(tmp_path, capsys, simulated):
    simulated({"CPU": 16.0}, torch_cuda="13.0", nccl=True)
    rc = cli.main(["stage", "ingest", "-c", str(CONFIGS / "tiny.yaml"), f"run_dir={tmp_path / 'run'}",
                   "eval.num_gpus=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1] == ("gti: error: preflight: eval.concurrency x eval.num_gpus: the evaluate stage needs 1 GPU "
                       "but simulated cluster has 0, so it would wait for ever; set eval.num_gpus: 0 or run on "
                       "a cluster with GPUs")


def test_doctor_lists_every_problem_and_exits_2(tmp_path, capsys, simulated):
    simulated({"CPU": 1.0, "GPU": 0.0})
    rc = cli.main(["doctor", "-c", str(CONFIGS / "tiny.yaml"), f"run_dir={tmp_path}", "sft.num_workers=3",
                   "tracking.mlflow=true"])
    cap = capsys.readouterr()
    assert rc == 2
    errors = [ln for ln in cap.err.splitlines() if ln.startswith("gti: error: ")]
    assert any("the sft stage needs 3 CPU but simulated cluster has 1" in ln for ln in errors)
    if not __import__("importlib.util").util.find_spec("mlflow"):
        assert any(ln.startswith("gti: error: tracking.mlflow: true needs the mlflow package") for ln in errors)
    assert "ERROR" in cap.out and "resources: sft" in cap.out


def test_no_preflight_flag_skips_the_checks(tmp_path, monkeypatch):
    called = []
    monkeypatch.setattr(doctor, "preflight_or_raise", lambda cfg: called.append(cfg))
    from gti import pipeline

    monkeypatch.setattr(pipeline, "run", lambda *a, **k: {})
    assert cli.main(["run", "-c", str(CONFIGS / "tiny.yaml"), f"run_dir={tmp_path}", "--no-preflight"]) == 0
    assert called == []
    assert cli.main(["run", "-c", str(CONFIGS / "tiny.yaml"), f"run_dir={tmp_path}"]) == 0
    assert len(called) == 1
