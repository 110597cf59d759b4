"""A gti pipeline submitted as a Ray job to a real Ray head, the way production runs go.

The test starts `ray start --head --block` as its own child process (dashboard and job API on
127.0.0.1, free ports, its own temp dir, token authentication with a token file of its own),
submits `gti run --config jobs/configs/tiny.yaml` through the Job Submission SDK
(`jobs/submit.py`, working_dir = the repository, runtime env = jobs/runtime_env.yaml), waits for
SUCCEEDED, checks the stage manifests the job wrote, the TensorBoard curves of every
training stage and the progress lines in the job's log, and ends the head with SIGTERM to that
child's pid (never `ray stop`, which would kill every Ray on the machine).

Why the job finds `gti`: the head is started with this venv's `ray` and this venv's bin first on
PATH, so the job's entrypoint shell resolves `gti` (and `python`) to the venv, as on a cluster
whose nodes installed the project; runtime_env's `py_modules` then puts the submitted
platform/gti first on PYTHONPATH. The submitting client runs in a subprocess so that its token
settings cannot mix with any Ray state of the pytest process.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def _default_to_stage() -> str:
    """The whole pipeline once every stage module exists; until then the longest runnable prefix
    (GTI_JOB_TEST_TO overrides)."""
    from gti.pipeline import STAGES

    last = STAGES[0].name
    for s in STAGES:
        if not (ROOT / "platform" / (s.module.replace(".", "/") + ".py")).is_file():
            break
        last = s.name
    return os.environ.get("GTI_JOB_TEST_TO", last)


TO_STAGE = _default_to_stage()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_env(token_file: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token_file),
        RAY_USAGE_STATS_ENABLED="0",
        DS_ACCELERATOR="cpu",
    )
    for k in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
        env.pop(k, None)
    return env


def start_head(tmp: Path, env: dict[str, str], num_cpus: int = 4) -> tuple[subprocess.Popen, int, Path]:
    """`ray start --head --block` as a child; returns (process, dashboard port, temp dir)."""
    dash = free_port()
    # Short temp dir: Ray's socket paths must stay under the AF_UNIX length limit.
    ray_tmp = Path(tempfile.mkdtemp(prefix="gtijob."))
    log = (tmp / "head.log").open("w")
    cmd = [
        str(VENV_BIN / "ray"), "start", "--head", "--block",
        f"--port={free_port()}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
        f"--num-cpus={num_cpus}", f"--temp-dir={ray_tmp}", f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
        f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
        "--disable-usage-stats",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    from gti import ledger

    ledger.note("ray", f"tests:ray start --head {ray_tmp}")  # the session's budget counts it
    return proc, dash, ray_tmp


def stop_head(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM to the `ray start --block` child: it drains and stops what it started."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.ray
def test_tiny_pipeline_as_ray_job(tmp_path, tiny_upstream):
    from testkit import adopt_tiny_upstream

    token = tmp_path / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = cluster_env(token)
    head, dash, ray_tmp = start_head(tmp_path, env)
    # ingest..pairs are the session's shared tiny stages (the job finds them up to date): the
    # job trains, evaluates and reports, which is what runs on a cluster after the data stages.
    run_dir = adopt_tiny_upstream(tiny_upstream, tmp_path / "run")
    address = f"http://127.0.0.1:{dash}"
    try:
        # Token auth is really on: a client without the token is refused.
        no_token = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
        no_token["RAY_AUTH_MODE"] = "disabled"
        refused = subprocess.run(
            [sys.executable, "jobs/submit.py", "--address", address, "--connect-timeout", "90",
             "--no-wait", "--", "true"],
            cwd=ROOT, env=no_token, capture_output=True, text=True, timeout=180,
        )
        assert refused.returncode != 0
        assert "refused the client" in refused.stderr, refused.stderr[-2000:]

        # The job's entrypoint finds the venv's `gti`, and imports the submitted package
        # (py_modules upload), not the installed one.
        probe = subprocess.run(
            [sys.executable, "jobs/submit.py", "--address", address, "--working-dir", ".",
             "--runtime-env", "jobs/runtime_env.yaml", "--timeout", "300", "--",
             "python", "-c", "import gti, shutil; print('GTI_FILE', gti.__file__); print('GTI_BIN', shutil.which('gti'))"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
        )
        assert probe.returncode == 0, (probe.stdout + probe.stderr)[-3000:]
        lines = dict(l.split(" ", 1) for l in probe.stdout.splitlines() if l.startswith("GTI_"))
        assert "py_modules_files" in lines["GTI_FILE"], lines
        assert Path(lines["GTI_BIN"]).parent == VENV_BIN, lines

        t0 = time.time()
        job = subprocess.run(
            [sys.executable, "jobs/submit.py", "--address", address, "--connect-timeout", "90",
             "--working-dir", ".", "--runtime-env", "jobs/runtime_env.yaml", "--timeout", "1500",
             "--", "gti", "run", "--config", "jobs/configs/tiny.yaml", f"run_dir={run_dir}",
             "--to", TO_STAGE],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700,
        )
        logs = job.stdout + job.stderr
        assert job.returncode == 0, logs[-4000:]
        assert "SUCCEEDED" in job.stderr
        print(f"job finished in {time.time() - t0:.0f}s")
    finally:
        stop_head(head)
    assert head.returncode is not None
    leftover = subprocess.run(["pgrep", "-f", str(ray_tmp)], capture_output=True, text=True)
    shutil.rmtree(ray_tmp, ignore_errors=True)

    from gti.pipeline import STAGE_NAMES

    for stage in STAGE_NAMES[: STAGE_NAMES.index(TO_STAGE) + 1]:
        manifest = json.loads((run_dir / stage / "_manifest.json").read_text())
        assert manifest["stage"] == stage
        for rel in manifest["outputs"].values():
            assert (run_dir / stage / rel).exists(), f"{stage}: output {rel} missing"
    assert f"{TO_STAGE}: done" in logs
    for stage in ("ingest", "embed", "sid", "pairs"):
        assert f"{stage}: up to date" in logs, stage
    # No Ray process of this head survives it.
    assert leftover.stdout.strip() == "", f"processes left behind: {leftover.stdout}"
    _check_tracking(run_dir, logs)  # needs the pipeline through evaluate (the default TO_STAGE)


# The sid stage's RQ-VAE curves and progress lines (checked here while the job ran the RQ-VAE)
# are checked by tests/stages/test_sid.py::test_two_worker_rqvae_assigns_every_item.


def _check_tracking(run_dir: Path, logs: str) -> None:
    """After the tiny pipeline, `tensorboard --logdir <run_dir>` has every training stage's
    curves and the evaluation's metrics, and the driver printed step progress with rate and ETA."""
    from gti import config
    from gti.tracking import read_scalars

    cfg = config.load(ROOT / "jobs" / "configs" / "tiny.yaml", [f"run_dir={run_dir}"])
    tb = run_dir / "tensorboard"
    assert sorted(p.name for p in tb.iterdir()) == ["evaluate", "ground", "sft"]  # the stages the job ran
    ground = read_scalars(tb / "ground")
    steps = cfg.ground.steps
    assert [s for s, _ in ground["train/loss"]] == list(range(1, steps + 1))
    assert {"train/lr", "train/grad_norm_new_rows", "train/tokens_per_s", "val/exact_match"} <= set(ground)
    assert [s for s, _ in ground["val/exact_match"]][-1] == steps
    sft = read_scalars(tb / "sft")
    assert [s for s, _ in sft["train/loss"]] == list(range(1, cfg.sft.steps + 1))
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "val/loss"} <= set(sft)
    ev = read_scalars(tb / "evaluate")
    metrics = json.loads((run_dir / "evaluate" / "metrics.json").read_text())
    assert ev["eval/test/recall_at_5"] == [(cfg.sft.steps, pytest.approx(metrics["splits"]["test"]["recall@5"]["value"]))]
    assert "eval/valid/mostpop/recall_at_5" in ev and "eval/test/markov/ndcg_at_5" in ev
    assert f"[ground] {steps}/{steps} steps (100.0%)" in logs
    assert "[evaluate] " in logs and "prompts (100.0%)" in logs
