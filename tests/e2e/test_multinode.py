"""Grounding on a simulated 2-node cluster: the two Ray Train workers land on different nodes,
checkpoints go to one shared storage path, and a run whose driver is killed mid-grounding
resumes from its checkpoint when the same command is run again.

The cluster is `cluster/local_cluster.sh` (a head plus two worker nodes, each a `ray start
--block` process with `gti_worker: 1`; token auth on; stopped by pid). Asking for
`resources_per_worker: {CPU: 1, gti_worker: 1}` with two workers can only be satisfied by one
worker per worker node. The `gti run` driver joins the cluster (RAY_ADDRESS from the script's
env file) as a separate process, so killing it is a real driver failure. Which node each worker
ran on is read back from Ray's actor table (class RayTrainWorker) after the run. The stages
before grounding are the session's shared tiny ones (tests/conftest.py::tiny_upstream), linked
into the run folder (they are not what the test is about, and three nodes on 2 cores made them
the slowest part).

The rerun after the kill takes the dead driver's lock, and while it runs a second `gti run` on
the same folder is refused in one line naming it (the run lock, issue 30).

The same test checks the script itself (it used to have a test of its own, which cost another
cluster start): the nodes and their custom resources, token auth refusing a client without the
token, a private token file, the dashboard on 127.0.0.1, and a `stop` that ends exactly the
processes it started.
"""

from __future__ import annotations

import json
import os
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


def _gti_cmd(run_dir: Path) -> list[str]:
    return [
        str(VENV_BIN / "gti"), "run", "--config", str(ROOT / "jobs" / "configs" / "tiny.yaml"),
        f"run_dir={run_dir}", "ray_address=auto", "ground.num_workers=2",
        "ground.resources_per_worker={CPU: 1, gti_worker: 1}", f"ground.steps={STEPS}",
        "ground.checkpoint_every=2", "ground.val_every=3", "--to", "ground",
    ]


def _probe(env: dict[str, str]) -> dict:
    """Alive nodes with their resources, and every RayTrainWorker actor -> its node."""
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-3000:]
    return json.loads(probe.stdout.strip().splitlines()[-1])


def _checkpoints(stage_dir: Path) -> list[Path]:
    return sorted(p for p in stage_dir.rglob("checkpoint_*") if p.is_dir())


def _recorded_steps(run_dir: Path) -> list[int]:
    """Steps of the ground stage's train/loss curve, in the order both attempts wrote them."""
    from gti.tracking import read_scalars

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


def _rival_is_refused(run_dir: Path, holder: subprocess.Popen, env: dict[str, str], cwd: Path) -> None:
    """Two writers, one folder (issue 30): once `holder` (a `gti run`) holds the run folder's
    lock, a second `gti run` on it is refused at once, in one line naming the holder's pid."""
    lock = run_dir / ".gti.lock"
    deadline = time.time() + 300
    while time.time() < deadline and holder.poll() is None:
        try:
            if json.loads(lock.read_text())["pid"] == holder.pid:
                break
        except (OSError, ValueError, KeyError):  # not written yet, or the dead driver's
            pass
        time.sleep(0.2)
    assert holder.poll() is None, "the rerun ended before it held the lock"
    rival = subprocess.run(_gti_cmd(run_dir), env=env, capture_output=True, text=True, cwd=cwd, timeout=120)
    line = rival.stderr.strip().splitlines()[-1] if rival.stderr.strip() else ""
    assert rival.returncode == 2, rival.stdout[-2000:] + rival.stderr[-2000:]
    assert line.startswith("gti: error: ") and f"pid {holder.pid}" in line and "gti run" in line, rival.stderr[-2000:]


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
    from gti import ledger

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
# Three Ray nodes on a 2-core machine: 11 min on an idle one with the upstream stages on the
# cluster, over the suite's 480 s default (a CI run timed out); its subprocesses carry their own
# limits.
@pytest.mark.timeout(1200)
def test_grounding_across_two_nodes_with_driver_kill_and_resume(upstream_done, two_node_cluster, tmp_path):
    env = two_node_cluster
    run_dir = upstream_done  # one path every node of this cluster sees: the shared storage
    # The cluster: a head and two worker nodes with the custom resources placement relies on.
    info = _probe(env)
    assert len(info["nodes"]) == 3
    assert sorted(r for res in info["nodes"].values() for r in res if r.startswith("gti_node_")) == [
        "gti_node_1", "gti_node_2"]
    # Without the token the cluster refuses a client: authentication is really on.
    no_token = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    no_token["RAY_AUTH_MODE"] = "disabled"
    refused = subprocess.run([sys.executable, "-c", PROBE], env=no_token, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    # The upstream stages are in place (upstream_done), so the kill below lands in grounding;
    # the cluster is fresh, so every RayTrainWorker it has seen afterwards is a grounding worker.
    log1 = (tmp_path / "attempt1.log").open("w")
    first = subprocess.Popen(_gti_cmd(run_dir), env=env, stdout=log1, stderr=subprocess.STDOUT, cwd=tmp_path)
    partial = run_dir / ".ground.partial"
    deadline = time.time() + 600
    # Kill the driver once grounding has written its second checkpoint: by then Ray Train has
    # registered the first one (a checkpoint directory can exist a moment before Ray Train V2
    # records it, and a kill in that window restarts from the previous registered one).
    while time.time() < deadline and first.poll() is None and len(_checkpoints(partial)) < 2:
        time.sleep(0.5)
    assert first.poll() is None, "the first attempt ended before any checkpoint: " + (tmp_path / "attempt1.log").read_text()[-3000:]
    first.send_signal(signal.SIGKILL)
    first.wait()
    before = {p.relative_to(partial) for p in _checkpoints(partial)}
    assert before, "no checkpoint survived the killed driver"
    assert not (run_dir / "ground" / "_manifest.json").exists()

    # The killed driver's lock is stale (its process is gone): the rerun takes it over.
    log2 = tmp_path / "attempt2.log"
    with log2.open("w") as f:
        second = subprocess.Popen(_gti_cmd(run_dir), env=env, stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path)
        _rival_is_refused(run_dir, second, env, tmp_path)
        second.wait(timeout=900)
    logs = log2.read_text()
    assert second.returncode == 0, logs[-4000:]
    # Upstream stages were not redone; grounding finished from where it stopped.
    for stage in ("ingest", "embed", "sid", "pairs"):
        assert f"{stage}: up to date" in logs
    manifest = json.loads((run_dir / "ground" / "_manifest.json").read_text())
    assert manifest["facts"]["steps_done"] == STEPS
    # The rerun resumed the same Train run (same storage path and name) from its checkpoint:
    # the ground stage's TensorBoard curve holds the killed attempt's steps, then the steps
    # after the checkpointed one; a restart from scratch would record step 1 a second time.
    steps = _recorded_steps(run_dir)
    assert steps.count(1) == 1 and steps[-1] == STEPS, steps
    restarts = [i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]]
    assert all(steps[i] > 1 for i in restarts), steps

    info = _probe(env)
    worker_nodes = {n for n, res in info["nodes"].items() if "gti_worker" in res}
    assert len(worker_nodes) == 2
    # Both attempts started 2 workers; every worker ran on a worker node, and each attempt
    # spread its pair over both nodes (gti_worker: 1 each allows nothing else).
    placed = list(info["train_workers"].values())
    assert len(placed) >= 4 and set(placed) == worker_nodes
