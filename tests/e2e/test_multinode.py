"""The tiny pipeline as a Ray job on a simulated 2-node cluster, the way production runs go.

One cluster, one test (a job test and a two-node test used to start a Ray head each; issue 27):
- the cluster is `cluster/local_cluster.sh` (a head plus two worker nodes, each a `ray start
  --block` process with `gti_worker: 1`; token auth on with a private token file; dashboard on
  127.0.0.1; stopped by pid, and `stop` ends exactly the processes it started);
- the job goes in through `jobs/submit.py` (the Job Submission SDK, working_dir = the
  repository, runtime env = jobs/runtime_env.yaml); a client without the token is refused, and
  the job's entrypoint finds the venv's `gti` and imports the submitted package (py_modules);
- the job's grounding asks for `resources_per_worker: {CPU: 1, gti_worker: 1}` with two
  workers, which only one worker per worker node satisfies; which node each Train worker ran
  on is read back from Ray's actor table;
- the job's driver (`gti run`, its pid from the run lock) is SIGKILLed once grounding wrote its
  second checkpoint: a real driver failure. The same job submitted again takes the dead
  driver's lock, resumes the same Train run from its checkpoint (the TensorBoard curve does not
  restart at step 1), and runs sft (`sft.steps=0`: the grounded model exported as the run's
  model, no Train run), evaluate and report; while it runs a second `gti run` on the folder is
  refused in one line naming it (the run lock, issue 30);
- ingest..pairs are the session's shared tiny ones (tests/conftest.py::tiny_upstream), linked
  into the run folder: the job finds them up to date (asserted). What is checked after the
  job: every stage's manifest and outputs, the TensorBoard curves of ground and evaluate, the
  progress lines in the job's log. (SFT's Train run and curves are proven by
  tests/stages/test_sft.py; a third Train run on three nodes cost this test ~40 s.)

Why the job finds `gti`: the cluster is started with this venv's bin first on PATH, so the
job's entrypoint shell resolves `gti` (and `python`) to the venv, as on a cluster whose nodes
installed the project; runtime_env's `py_modules` then puts the submitted platform/gti first
on PYTHONPATH. The submitting clients run in subprocesses so that their token settings cannot
mix with any Ray state of the pytest process.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "cluster" / "local_cluster.sh"
VENV_BIN = Path(sys.executable).parent
STEPS = 8
PROBE_GTI = "import gti, shutil; print('GTI_FILE', gti.__file__); print('GTI_BIN', shutil.which('gti'))"

PROBE = """
import json, ray
from ray.util.state import list_actors
ray.init(logging_level="ERROR", log_to_driver=False)
workers = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
acts = list_actors(filters=[("class_name", "=", "RayTrainWorker")], detail=True, limit=10000,
                   raise_on_missing_output=False)
print(json.dumps({"nodes": {k: sorted(v) for k, v in workers.items()},
                  "train_workers": {a.actor_id: a.node_id for a in acts}}))
"""


def _env_from(file: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    for line in file.read_text().splitlines():
        key, value = line.removeprefix("export ").split("=", 1)
        env[key] = value
    return env


def _gti_cmd(run_dir: Path, to: str = "report") -> list[str]:
    """The job's `gti run`: the tiny pipeline with grounding on both worker nodes, the grounded
    model exported as the run's model (no SFT steps), evaluate and report."""
    return [
        "gti", "run", "--config", "jobs/configs/tiny.yaml", f"run_dir={run_dir}", "ray_address=auto",
        "ground.num_workers=2", "ground.resources_per_worker={CPU: 1, gti_worker: 1}", f"ground.steps={STEPS}",
        "ground.checkpoint_every=2", "ground.val_every=3", "sft.steps=0", "--to", to,
    ]


def _submit(env: dict[str, str], run_dir: Path, log: Path) -> subprocess.Popen:
    """`python jobs/submit.py ... -- bash -c '<probe of gti>; gti run ...'`, waiting for the job
    (its exit status: 0 only for SUCCEEDED; stdout: the job's log)."""
    entry = f"python -c {shlex.quote(PROBE_GTI)} && {shlex.join(_gti_cmd(run_dir))}"
    cmd = [sys.executable, "jobs/submit.py", "--address", env["GTI_DASHBOARD"], "--connect-timeout", "90",
           "--working-dir", ".", "--runtime-env", "jobs/runtime_env.yaml", "--timeout", "900", "--",
           "bash", "-c", entry]
    with log.open("w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)


def _lock_pid(run_dir: Path) -> int | None:
    """The pid in the run folder's lock (the `gti run` holding it), None before it is written."""
    try:
        return int(json.loads((run_dir / ".gti.lock").read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _probe(env: dict[str, str]) -> dict:
    """Alive nodes with their resources, and every RayTrainWorker actor -> its node."""
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-3000:]
    return json.loads(probe.stdout.strip().splitlines()[-1])


def _checkpoints(stage_dir: Path) -> list[Path]:
    return sorted(p for p in stage_dir.rglob("checkpoint_*") if p.is_dir())


def _recorded_steps(run_dir: Path) -> list[int]:
    """Steps of the ground stage's train/loss curve, in the order both attempts wrote them."""
    from gti.common.tracking import read_scalars

    return [step for step, _ in read_scalars(run_dir / "tensorboard" / "ground")["train/loss"]]


def _descendants(pids: list[int]) -> list[int]:
    """Every descendant of `pids` (from /proc; empty without procfs)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited while we looked
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], list(pids)
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _alive(pid: int) -> bool:
    """The process still runs: it exists and is not a zombie (an exited `ray start` that its
    parent, the reaper of the script's orphans, has not collected yet)."""
    if not Path("/proc/self/stat").exists():  # no procfs: signal 0 (a zombie counts as alive)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _rival_is_refused(run_dir: Path, job: subprocess.Popen, dead: int, env: dict[str, str]) -> None:
    """Two writers, one folder (issue 30): once the resubmitted job's `gti run` holds the run
    folder's lock (a live pid other than the killed driver `dead`), a second `gti run` on it is
    refused at once, in one line naming that pid."""
    deadline = time.time() + 300
    holder = None
    while time.time() < deadline and job.poll() is None:
        holder = _lock_pid(run_dir)
        if holder not in (None, dead) and _alive(holder):
            break
        time.sleep(0.2)
    assert job.poll() is None and holder not in (None, dead), "the resubmitted job ended before it held the lock"
    rival = subprocess.run(_gti_cmd(run_dir, to="ground"), env=env, capture_output=True, text=True, cwd=ROOT, timeout=120)
    line = rival.stderr.strip().splitlines()[-1] if rival.stderr.strip() else ""
    assert rival.returncode == 2, rival.stdout[-2000:] + rival.stderr[-2000:]
    assert line.startswith("gti: error: ") and f"pid {holder}" in line and "gti run" in line, rival.stderr[-2000:]


@pytest.fixture
def upstream_done(tiny_upstream, tmp_path) -> Path:
    """The run's stages before grounding: the session's shared tiny ingest..pairs
    (tests/conftest.py), hard-linked into this run folder. On the 3-node cluster they took ~5
    of the test's 11 min and they are not what the test is about. `ray_address` is not part of
    any stage's fingerprint, and neither is the `ground` section, so the cluster run finds them
    up to date (asserted below)."""
    from testkit import adopt_tiny_upstream

    return adopt_tiny_upstream(tiny_upstream, tmp_path / "run")


@pytest.fixture
def two_node_cluster(tmp_path):
    """cluster/local_cluster.sh start: 3 live processes, token auth on with a private token
    file, dashboard on 127.0.0.1; on teardown `stop` ends exactly those processes, removes the
    token and `status` reports no cluster."""
    d = tmp_path / "cluster"
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    run = lambda *a: subprocess.run(  # noqa: E731
        ["bash", str(SCRIPT), *a, "--dir", str(d)], env=env, capture_output=True, text=True, timeout=240
    )
    started = run("start", "--workers", "2", "--cpus", "2", "--timeout", "150")
    pids = [int(p) for p in (d / "pids").read_text().split()] if (d / "pids").exists() else []
    from gti.common import ledger

    for pid in pids:  # a head and two worker nodes: three Ray nodes for the session's budget
        ledger.note("ray", f"tests:local_cluster.sh node {pid}")
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        assert len(pids) == 3 and all(_alive(p) for p in pids)
        cluster_env = _env_from(d / "env")
        assert cluster_env["RAY_AUTH_MODE"] == "token"
        assert cluster_env["GTI_DASHBOARD"].startswith("http://127.0.0.1:")
        assert (d / "auth_token").stat().st_mode & 0o077 == 0, "token file readable by others"
        yield cluster_env
    finally:
        # Their children too (raylet, GCS, dashboard modules, agents): none may outlive `stop`.
        tree = pids + _descendants(pids)
        stopped = run("stop")
    assert stopped.returncode == 0, stopped.stderr
    deadline = time.time() + 15  # a pid that needed SIGKILL may take a moment to go
    while any(_alive(p) for p in tree) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in tree), [p for p in tree if _alive(p)]
    assert not (d / "auth_token").exists()
    assert "no cluster" in run("status").stdout


@pytest.mark.slow
@pytest.mark.ray
# Three Ray nodes on a 2-core machine: a job through grounding (killed and resubmitted), SFT,
# evaluate and report, over the suite's 480 s default; its subprocesses carry their own limits.
@pytest.mark.timeout(1200)
def test_pipeline_job_on_two_nodes_survives_a_killed_driver(upstream_done, two_node_cluster, tmp_path):
    env = two_node_cluster
    run_dir = upstream_done  # one path every node of this cluster sees: the shared storage
    # Without the token the cluster refuses a client (Ray's API and the job API): auth is on.
    no_token = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    no_token["RAY_AUTH_MODE"] = "disabled"
    refused = subprocess.run([sys.executable, "-c", PROBE], env=no_token, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    refused = subprocess.run(
        [sys.executable, "jobs/submit.py", "--address", env["GTI_DASHBOARD"], "--connect-timeout", "90",
         "--no-wait", "--", "true"], cwd=ROOT, env=no_token, capture_output=True, text=True, timeout=180)
    assert refused.returncode != 0 and "refused the client" in refused.stderr, refused.stderr[-2000:]

    # Job 1: killed (SIGKILL to its `gti run`) once grounding has written its second checkpoint:
    # by then Ray Train has registered the first one (a checkpoint directory can exist a moment
    # before Ray Train V2 records it, and a kill in that window restarts from the previous one).
    first = _submit(env, run_dir, tmp_path / "job1.log")
    partial = run_dir / ".ground.partial"
    deadline = time.time() + 600
    while time.time() < deadline and first.poll() is None and len(_checkpoints(partial)) < 2:
        time.sleep(0.5)
    driver = _lock_pid(run_dir)
    assert first.poll() is None and driver, "job 1 ended before any checkpoint: " + (tmp_path / "job1.log").read_text()[-3000:]
    os.kill(driver, signal.SIGKILL)
    assert first.wait(timeout=180) == 1  # the job ends FAILED
    log1 = (tmp_path / "job1.log").read_text()
    assert "FAILED" in log1, log1[-3000:]
    # The entrypoint found the venv's `gti` and imported the submitted package, not the installed one.
    lines = dict(l.split(" ", 1) for l in log1.splitlines() if l.startswith("GTI_"))
    assert "py_modules_files" in lines["GTI_FILE"], lines
    assert Path(lines["GTI_BIN"]).parent == VENV_BIN, lines
    before = {p.relative_to(partial) for p in _checkpoints(partial)}
    assert before, "no checkpoint survived the killed driver"
    assert not (run_dir / "ground" / "_manifest.json").exists()

    # Job 2, the same job again: takes the dead driver's lock, resumes, runs to the report.
    second = _submit(env, run_dir, tmp_path / "job2.log")
    _rival_is_refused(run_dir, second, driver, env)
    rc = second.wait(timeout=1000)
    logs = (tmp_path / "job2.log").read_text()
    assert rc == 0 and "SUCCEEDED" in logs, logs[-4000:]
    for stage in ("ingest", "embed", "sid", "pairs"):  # linked from the shared upstream, not redone
        assert f"{stage}: up to date" in logs, stage
    from gti.run.pipeline import STAGE_NAMES

    for stage in STAGE_NAMES:
        manifest = json.loads((run_dir / stage / "_manifest.json").read_text())
        assert manifest["stage"] == stage
        for rel in manifest["outputs"].values():
            assert (run_dir / stage / rel).exists(), f"{stage}: output {rel} missing"
    assert f"{STAGE_NAMES[-1]}: done" in logs
    assert json.loads((run_dir / "ground" / "_manifest.json").read_text())["facts"]["steps_done"] == STEPS
    # The rerun resumed the same Train run (same storage path and name) from its checkpoint:
    # the ground stage's TensorBoard curve holds the killed attempt's steps, then the steps
    # after the checkpointed one; a restart from scratch would record step 1 a second time.
    steps = _recorded_steps(run_dir)
    assert steps.count(1) == 1 and steps[-1] == STEPS, steps
    restarts = [i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]]
    assert all(steps[i] > 1 for i in restarts), steps
    _check_tracking(run_dir, logs)
    _check_ground_stage(run_dir)

    # The cluster: a head and two worker nodes with the custom resources placement relies on.
    info = _probe(env)
    assert len(info["nodes"]) == 3
    assert sorted(r for res in info["nodes"].values() for r in res if r.startswith("gti_node_")) == [
        "gti_node_1", "gti_node_2"]
    worker_nodes = {n for n, res in info["nodes"].items() if "gti_worker" in res}
    assert len(worker_nodes) == 2
    # Both grounding attempts started 2 workers; every worker ran on a worker node, and each
    # attempt spread its pair over both nodes (gti_worker: 1 allows nothing else).
    placed = list(info["train_workers"].values())
    assert len(placed) >= 4 and set(placed) == worker_nodes


def _check_ground_stage(run_dir: Path) -> None:
    """The job's ground stage (2 Train workers, ZeRO-2, on two nodes, resumed once): its facts,
    the distance the rows moved, and an export that loads with plain transformers, every old
    row the base model's and the new rows the grounded ones (the stage test's two-worker run
    used to check this on a Ray of its own: one Train run fewer)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gti import config
    from gti.lm import models

    f = json.loads((run_dir / "ground" / "_manifest.json").read_text())["facts"]
    assert f["grounded"] is True and f["arm"].startswith("gti")
    assert f["num_workers"] == 2 and f["zero_stage"] == 2 and f["train_pairs"] > 0
    assert f["val_exact_match"][-1]["step"] == STEPS and all(0.0 <= e["value"] <= 1.0 for e in f["val_exact_match"])
    init = load_file(str(run_dir / "ground" / "e_new_init.safetensors"))["e_new"]
    ground = load_file(str(run_dir / "ground" / "e_new_ground.safetensors"))["e_new"]
    moved = (ground.double() - init.double()).norm(dim=1)
    assert f["rows"]["moved_mean"] == pytest.approx(float(moved.mean()), rel=1e-6) and f["rows"]["moved_mean"] > 0
    folder = run_dir / "ground" / "model"
    model = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True)
    first, end = f["new_token_ids"]
    assert len(AutoTokenizer.from_pretrained(folder)) == end
    w = model.get_input_embeddings().weight.detach()
    base, _ = models.load_model_and_tokenizer(config.load(ROOT / "jobs" / "configs" / "tiny.yaml", []).model)
    assert w.shape[0] == end and torch.equal(w[first:end], ground)
    assert torch.equal(w[:first], base.get_input_embeddings().weight.detach()[:first])
    meta = json.loads((folder / "gti_meta.json").read_text())
    assert meta["sid_map_hash"] == f["sid_map_hash"] and meta["new_token_ids"] == [first, end]
    assert not (run_dir / "ground" / "ray_train").exists()


def _check_tracking(run_dir: Path, logs: str) -> None:
    """After the pipeline, `tensorboard --logdir <run_dir>` has every training stage's curves and
    the evaluation's metrics, and the driver printed step progress with rate and ETA."""
    from gti.common.tracking import read_scalars

    tb = run_dir / "tensorboard"
    assert sorted(p.name for p in tb.iterdir()) == ["evaluate", "ground"]  # SFT trained no step
    ground = read_scalars(tb / "ground")
    assert {"train/lr", "train/grad_norm_new_rows", "train/tokens_per_s", "val/exact_match"} <= set(ground)
    assert [s for s, _ in ground["val/exact_match"]][-1] == STEPS
    ev = read_scalars(tb / "evaluate")
    metrics = json.loads((run_dir / "evaluate" / "metrics.json").read_text())
    assert ev["eval/test/recall_at_5"] == [(0, pytest.approx(metrics["splits"]["test"]["recall@5"]["value"]))]
    assert "eval/valid/mostpop/recall_at_5" in ev and "eval/test/markov/ndcg_at_5" in ev
    assert f"[ground] {STEPS}/{STEPS} steps (100.0%)" in logs
    assert "[evaluate] " in logs and "prompts (100.0%)" in logs
