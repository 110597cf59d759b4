"""`gti doctor` and the preflight at the start of `gti run`: fast, one line per problem, exit 2,
and nothing reserved or written before it passes."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from gti import cli, doctor, preflight

CONFIGS = Path(__file__).resolve().parents[1] / "jobs" / "configs"


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
    from gti.run import pipeline

    monkeypatch.setattr(pipeline, "run", lambda *a, **k: {})
    assert cli.main(["run", "-c", str(CONFIGS / "tiny.yaml"), f"run_dir={tmp_path}", "--no-preflight"]) == 0
    assert called == []
    assert cli.main(["run", "-c", str(CONFIGS / "tiny.yaml"), f"run_dir={tmp_path}"]) == 0
    assert len(called) == 1


# --------------------------------------------------------------------------- the other commands
@pytest.fixture
def delegated(monkeypatch):
    """Replaces each command's own entry point: the preflight runs for real, and a command it
    lets through is only recorded (nothing starts Ray or trains)."""
    import importlib

    calls = []
    for module in ("gti.refresh.command", "gti.experiments.tune", "gti.experiments.compare", "gti.vocab_ground",
                   "gti.serve.deployment"):
        monkeypatch.setattr(importlib.import_module(module), "cli_main",
                            lambda args, m=module: calls.append(m) or 0)
    return calls


def _refused(capsys, argv, *wanted):
    assert cli.main(argv) == 2, argv
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("gti: error")]
    assert len(err) == 1 and err[0].startswith("gti: error: preflight: "), err
    assert all(w in err[0] for w in wanted), err[0]
    return err[0]


def test_refresh_is_checked_as_it_trains(tmp_path, capsys, simulated, delegated):
    """gti refresh: the run's workers and use_gpu at refresh.ground_steps / refresh.sft_steps."""
    simulated({"CPU": 4.0, "GPU": 0.0})
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text((CONFIGS / "tiny.yaml").read_text())
    base = ["refresh", "--run-dir", str(run), "--items", str(tmp_path / "new.csv")]
    _refused(capsys, base + ["ground.num_workers=8"], "ground.num_workers", "needs 8 CPU but simulated cluster has 4")
    assert delegated == []
    assert cli.main(base + ["ground.num_workers=8", "refresh.ground_steps=0"]) == 0  # no grounding pass
    assert cli.main(base + ["sft.num_workers=8", "refresh.sft_steps=5"]) == 0  # no SFT without --interactions
    _refused(capsys, base + ["sft.num_workers=8", "refresh.sft_steps=5", "--interactions", str(tmp_path / "i.csv")],
             "sft.num_workers", "the sft stage needs 8 CPU")
    assert delegated == ["gti.refresh.command"] * 2


def test_tune_is_checked_for_the_stages_its_trials_run(tmp_path, capsys, simulated, delegated):
    simulated({"CPU": 4.0, "GPU": 0.0})
    base = ["tune", "-c", str(CONFIGS / "tiny.yaml"), f"run_dir={tmp_path}"]
    _refused(capsys, base + ["ground.use_gpu=true"], "ground.use_gpu", "needs 1 GPU but simulated cluster has 0")
    assert cli.main(base + ["sft.num_workers=8"]) == 0  # a grounding sweep runs no SFT
    _refused(capsys, base + ["sft.num_workers=8", "tune.objective=sft", "tune.metric=recall@10"], "sft.num_workers")
    assert cli.main(base + ["ground.use_gpu=true", "--no-preflight"]) == 0
    assert delegated == ["gti.experiments.tune"] * 2


def test_compare_checks_every_arm_and_names_it(tmp_path, capsys, simulated, delegated):
    simulated({"CPU": 4.0, "GPU": 0.0})
    base = ["compare", "-c", str(CONFIGS / "tiny.yaml"), f"run_dir={tmp_path}", "ground.enabled=false",
            "ground.num_workers=8"]
    assert cli.main(base + ["--arms", "mean"]) == 0  # no arm grounds
    _refused(capsys, base + ["--arms", "mean,gti"], "arm 'gti': ground.num_workers", "needs 8 CPU")
    assert cli.main(base + ["--arms", "mean,gti", "--report-only"]) == 0  # runs nothing: not checked
    assert delegated == ["gti.experiments.compare"] * 2


def test_vocab_ground_is_checked(tmp_path, capsys, simulated, delegated):
    simulated({"CPU": 4.0, "GPU": 0.0})
    base = ["vocab", "ground", "--model", "tiny", "--tokens", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "o")]
    _refused(capsys, base + ["ground.use_gpu=true"], "the ground stage needs 1 GPU",
             "set ground.use_gpu: false or run on a cluster with GPUs")
    assert cli.main(base) == 0
    assert delegated == ["gti.vocab_ground"]


def test_serve_is_checked_for_its_replicas(tmp_path, capsys, simulated, delegated):
    simulated({"CPU": 4.0, "GPU": 0.0})
    base = ["serve", "--run-dir", str(tmp_path)]
    _refused(capsys, base + ["serve.num_gpus=1"], "serve.replicas x serve.threads / serve.num_gpus: the serve "
             "stage needs 1 GPU but simulated cluster has 0", "set serve.num_gpus: 0")
    _refused(capsys, base + ["--replicas", "3", "serve.threads=2"], "the serve stage needs 6 CPU",
             "lower serve.replicas")
    assert cli.main(base + ["--replicas", "2", "serve.threads=2"]) == 0
    assert delegated == ["gti.serve.deployment"]
