"""The shipped cluster files: they parse, carry the fields their tools require, bind the dashboard
to 127.0.0.1, keep token authentication on, and point at real gti commands and configs.

Nothing here starts Ray; `ray_cluster.yaml` is checked against the cluster launcher's own JSON
schema, `jobs/runtime_env.yaml` through Ray's own RuntimeEnv validation.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RAY_CLUSTER = ROOT / "ray_cluster.yaml"
RAYJOB = ROOT / "cluster" / "rayjob.yaml"
DOCKERFILE = ROOT / "cluster" / "Dockerfile"
LOCAL_SH = ROOT / "cluster" / "local_cluster.sh"
RUNTIME_ENV = ROOT / "jobs" / "runtime_env.yaml"
# Where cluster/Dockerfile puts the checkout inside the image (its WORKDIR).
IMAGE_ROOT = "/home/ray/gti"

SHIPPED_YAML = sorted(
    [RAY_CLUSTER, RUNTIME_ENV, *(ROOT / "cluster").glob("*.yaml"), *(ROOT / "jobs").glob("**/*.yaml")]
)
CLUSTER_FILES = [RAY_CLUSTER, *sorted(p for p in (ROOT / "cluster").iterdir() if p.is_file())]


def _load(path: Path):
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("path", SHIPPED_YAML, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_yaml_parses_and_opens_with_its_command(path):
    data = _load(path)
    assert isinstance(data, dict) and data, f"{path} is empty or not a mapping"
    first = path.read_text().splitlines()[0]
    # The first line says how to run the file, naming a real command.
    assert re.match(r"# (Run|Used by|Build[^:]*):\s+\S", first), first
    assert re.search(r"\b(gti|ray|kubectl|docker)\b", first), first


def test_ray_cluster_yaml_matches_launcher_schema():
    from ray.autoscaler._private.util import validate_config

    cfg = _load(RAY_CLUSTER)
    validate_config(cfg)  # raises jsonschema.ValidationError on a wrong or unknown field
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    gpu_types = [n for n, t in types.items() if t.get("resources", {}).get("GPU", 0) > 0]
    assert gpu_types, "no GPU worker node type"
    assert all(types[n].get("max_workers", 0) >= 1 for n in gpu_types)


def test_ray_cluster_installs_project_with_pinned_torch():
    cfg = _load(RAY_CLUSTER)
    for key in ("head_setup_commands", "worker_setup_commands"):
        cmds = cfg[key]
        torch_i = next(i for i, c in enumerate(cmds) if "torch==2.13.0" in c)
        gti_i = next(i for i, c in enumerate(cmds) if re.search(r"pip install .*-e ~/gti", c))
        assert torch_i < gti_i, f"{key}: torch must be pinned before the project is installed"
    assert "cu" in " ".join(cfg["worker_setup_commands"]), "GPU workers need a CUDA torch build"
    assert "~/gti" in cfg["file_mounts"], "the project checkout must reach the nodes"


def test_ray_cluster_keeps_auth_and_local_dashboard():
    cfg = _load(RAY_CLUSTER)
    head = " ".join(cfg["head_start_ray_commands"])
    assert "--head" in head and "--dashboard-host=127.0.0.1" in head
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in cfg[key] if "ray start" in c]
        assert starts and all("RAY_AUTH_MODE=token" in c for c in starts), key
    # The client's token reaches every node.
    assert "~/.ray/auth_token" in cfg["file_mounts"]
    assert "/mnt/cluster_storage" in " ".join(cfg["setup_commands"])


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_dashboard_bound_to_localhost_everywhere(path):
    text = path.read_text()
    assert "0.0.0.0" not in text, f"{path.name} binds something to all interfaces"
    hosts = re.findall(r"dashboard[-_]host[\"']?\s*[=:]\s*[\"']?([\w.]+)", text)
    for h in hosts:
        assert h == "127.0.0.1", f"{path.name}: dashboard host {h}"
    if path.suffix == ".yaml" or path.suffix == ".sh":
        # Files that start a head must say where its dashboard listens.
        if "--head" in text or "headGroupSpec" in text:
            assert hosts, f"{path.name} starts a head without --dashboard-host=127.0.0.1"


def test_local_cluster_script_never_calls_ray_stop():
    code = "\n".join(l for l in LOCAL_SH.read_text().splitlines() if not l.lstrip().startswith("#"))
    assert "ray stop" not in code and '"$RAY_BIN" stop' not in code
    assert "kill -TERM" in code and "RAY_AUTH_MODE=token" in code


def _rayjob():
    return _load(RAYJOB)


def test_rayjob_required_fields():
    job = _rayjob()
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == "2.60.0"
    assert cluster["authOptions"]["mode"] == "token"
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    # The submitter must reach a localhost-only job API: it has to live in the head Pod.
    assert spec["submissionMode"] == "SidecarMode"
    assert head["template"]["spec"]["restartPolicy"] == "Never"
    workers = cluster["workerGroupSpecs"]
    assert any(
        "nvidia.com/gpu" in c["resources"]["limits"]
        for w in workers
        for c in w["template"]["spec"]["containers"]
    )
    # Every Pod mounts the same run storage.
    for tmpl in [head["template"], *(w["template"] for w in workers)]:
        mounts = {m["mountPath"] for c in tmpl["spec"]["containers"] for m in c["volumeMounts"]}
        assert "/mnt/cluster_storage" in mounts
    yaml.safe_load(spec["runtimeEnvYAML"])


def test_rayjob_entrypoint_is_a_real_gti_command():
    from gti import cli, config

    argv = shlex.split(_rayjob()["spec"]["entrypoint"])
    assert argv[0] == "gti"
    ap = cli.build_parser()
    args, extra = ap.parse_known_args(argv[1:])
    assert args.command == "run"
    overrides = list(args.overrides or []) + extra
    assert args.config.startswith(IMAGE_ROOT + "/"), "config must be inside the image's checkout"
    local = ROOT / args.config[len(IMAGE_ROOT) + 1 :]
    assert local.is_file(), f"entrypoint config {local} does not exist"
    cfg = config.load(local, overrides)
    # Outputs go to the shared volume, not into a Pod's private disk.
    assert cfg.run_dir.startswith("/mnt/cluster_storage/")


def test_dockerfile_installs_into_rayjob_path():
    text = DOCKERFILE.read_text()
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.startswith("#")]
    assert lines[0].startswith("FROM ")
    assert f"WORKDIR {IMAGE_ROOT}" in text
    torch_i = next(i for i, l in enumerate(lines) if "torch==2.13.0" in l)
    proj_i = next(i for i, l in enumerate(lines) if re.search(r"pip install \.( |$)", l))
    assert torch_i < proj_i, "torch must be installed (pinned) before the project"
    assert "COPY jobs" in text, "the RayJob entrypoint reads jobs/configs from the image"
    assert "RAY_AUTH_MODE=token" in text


def test_runtime_env_is_valid_for_ray():
    from ray.runtime_env import RuntimeEnv

    raw = _load(RUNTIME_ENV)
    env = RuntimeEnv(**raw)  # Ray's own validation of field names and types
    for mod in raw["py_modules"]:
        assert (ROOT / mod / "__init__.py").is_file(), f"py_modules entry {mod} is not a package"
    # The heavy, machine-local folders never get uploaded.
    assert {".venv", ".git", "runs"} <= set(raw["excludes"])
    assert env["env_vars"]["HF_HUB_OFFLINE"] == "1"


def test_local_cluster_stop_waits_for_late_writers_in_the_temp_dir(tmp_path):
    """After the recorded processes exit, Ray's helpers can still write logs into the session
    folder for a moment; `stop` retries removing it instead of failing on "Directory not empty"."""
    import subprocess
    import sys
    import time

    d = tmp_path / "cluster"
    d.mkdir(mode=0o700)  # the script refuses a cluster folder others can enter
    t = tmp_path / "raytmp"
    (t / "session").mkdir(parents=True)
    # A recorded pid that has already exited, as after SIGTERM.
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (d / "pids").write_text(done.stdout.strip() + "\n")
    (d / "temp_dir").write_text(str(t))
    (d / "auth_token").write_text("x")
    # A late writer: keeps creating files in the session folder for 2 s.
    writer = subprocess.Popen([sys.executable, "-c", (
        "import time, pathlib; p = pathlib.Path(%r); end = time.time() + 2; i = 0\n"
        "while time.time() < end:\n"
        "    try: (p / f'log{i}').write_text('x')\n"
        "    except OSError: p.mkdir(parents=True, exist_ok=True)\n"
        "    i += 1\n") % str(t / "session")])
    try:
        time.sleep(0.3)
        stopped = subprocess.run(["bash", str(LOCAL_SH), "stop", "--dir", str(d)], capture_output=True,
                                 text=True, timeout=60)
    finally:
        writer.wait(timeout=30)
    assert stopped.returncode == 0, stopped.stderr
    assert "local_cluster.sh: stopped" in stopped.stdout
    assert not t.exists() and not (d / "auth_token").exists()


def test_local_cluster_stop_ends_children_of_a_hung_ray_start(tmp_path):
    """A recorded `ray start --block` that ignores SIGTERM gets SIGKILL after the grace time,
    and its children (raylet, dashboard, agents in real life) do not outlive it."""
    import os
    import subprocess
    import time

    d = tmp_path / "cluster"
    d.mkdir(mode=0o700)  # the script refuses a cluster folder others can enter
    # A stand-in for a hung `ray start`: ignores SIGTERM, and so does its child.
    hung = subprocess.Popen(["bash", "-c", "trap '' TERM; bash -c \"trap '' TERM; sleep 60\" & wait"],
                            start_new_session=True)
    time.sleep(0.5)
    child = int(subprocess.run(["pgrep", "-P", str(hung.pid)], capture_output=True, text=True).stdout.split()[0])
    (d / "pids").write_text(f"{hung.pid}\n")

    def alive(pid):
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    try:
        stopped = subprocess.run(["bash", str(LOCAL_SH), "stop", "--dir", str(d)], capture_output=True,
                                 text=True, timeout=60, env={**os.environ, "GTI_STOP_GRACE_S": "1"})
        hung.wait(timeout=10)
        deadline = time.time() + 5
        while alive(child) and time.time() < deadline:
            time.sleep(0.1)
        assert stopped.returncode == 0, stopped.stderr
        assert f"pid {hung.pid}" in stopped.stderr and "sending SIGKILL" in stopped.stderr
        assert not alive(child), "a child of the hung process outlived stop"
    finally:
        for pid in (hung.pid, child):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def _fake_tools(tmp_path: Path) -> dict[str, str]:
    """RAY_BIN / PYTHON stand-ins so `start` runs without Ray: each "node" is a `sleep`
    (recorded in calls.log), the wait for the nodes succeeds at once; free ports are real."""
    import os
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ray = bin_dir / "ray"
    ray.write_text(f'#!/usr/bin/env bash\necho "$*" >> {tmp_path / "calls.log"}\nexec sleep 60\n')
    py = bin_dir / "python"
    py.write_text(f'#!/usr/bin/env bash\nif [[ "$1" == -c ]]; then exec {sys.executable} "$@"; fi\ncat > /dev/null\n')
    for f in (ray, py):
        f.chmod(0o755)
    return {**os.environ, "RAY_BIN": str(ray), "PYTHON": str(py), "TMPDIR": str(tmp_path),
            "GTI_STOP_GRACE_S": "2"}


def _script(*args: str, env: dict[str, str]):
    import subprocess

    return subprocess.run(["bash", str(LOCAL_SH), *args], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("case", ["group-readable", "world-writable", "foreign", "symlink"])
def test_local_cluster_refuses_a_folder_that_is_not_private(tmp_path, case):
    """A cluster folder another local user could have made first (or can enter) is refused by
    every command, in one line, before anything is written into it or any node is started."""
    import os

    env = _fake_tools(tmp_path)
    d = tmp_path / "cluster"
    d.mkdir()
    if case == "group-readable":
        d.chmod(0o750)
    elif case == "world-writable":
        d.chmod(0o1777)
    elif case == "foreign":
        if os.geteuid() != 0:
            pytest.skip("making a folder owned by another user needs root")
        d.chmod(0o700)
        os.chown(d, 65534, 65534)
    else:
        (tmp_path / "mine").mkdir(mode=0o700)
        d.rmdir()
        d.symlink_to(tmp_path / "mine")
    (d / "pids").write_text("1\n") if case == "world-writable" else None  # a planted pid for stop
    before = sorted(p.name for p in d.iterdir())
    for args in (["start", "--workers", "1"], ["stop"], ["status"]):
        r = _script(*args, "--dir", str(d), env={**env, "GTI_CLUSTER_DIR": ""})
        err = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(err) == 1, (args, r.stdout, r.stderr)
        assert err[0].startswith(f"local_cluster.sh: refusing cluster folder {d}: "), err
        assert {"group-readable": "mode 750", "world-writable": "mode 1777", "foreign": "not by you",
                "symlink": "symlink"}[case] in err[0]
    assert sorted(p.name for p in d.iterdir()) == before  # nothing written (no token, no env file)
    assert not (tmp_path / "calls.log").exists()  # no node started


def test_local_cluster_defaults_to_a_fresh_private_folder_that_stop_finds(tmp_path):
    """Without --dir, `start` makes a new mode-700 folder (a name no one can guess), prints it,
    and its env file names it, so `stop` after `source DIR/env` ends exactly that cluster."""
    env = _fake_tools(tmp_path)
    env.pop("GTI_CLUSTER_DIR", None)
    started = _script("start", "--workers", "1", env=env)
    assert started.returncode == 0, started.stderr
    line = next(ln for ln in started.stdout.splitlines() if ln.startswith("local_cluster.sh: cluster folder "))
    d = Path(line.rsplit(" ", 1)[1])
    assert d.parent == tmp_path.resolve() and d.name.startswith("gti-cluster.")
    assert d.stat().st_mode & 0o777 == 0o700
    assert (d / "auth_token").stat().st_mode & 0o077 == 0
    exported = dict(ln.removeprefix("export ").split("=", 1) for ln in (d / "env").read_text().splitlines())
    assert exported["GTI_CLUSTER_DIR"] == str(d) and exported["RAY_AUTH_TOKEN_PATH"] == str(d / "auth_token")
    assert len((d / "pids").read_text().split()) == 2  # head + 1 worker, recorded for stop
    again = _script("start", "--workers", "1", env=env)  # a second cluster: its own folder
    other = Path(next(ln for ln in again.stdout.splitlines() if "cluster folder" in ln).rsplit(" ", 1)[1])
    assert other != d
    for folder in (d, other):
        stopped = _script("stop", env={**env, "GTI_CLUSTER_DIR": str(folder)})
        assert stopped.returncode == 0 and "local_cluster.sh: stopped" in stopped.stdout, stopped.stderr
        assert not (folder / "auth_token").exists()
    assert _script("stop", env=env).returncode == 2  # no folder named: refused, not guessed


def test_local_cluster_gives_every_node_its_own_temp_dir(tmp_path):
    """Each worker node gets a temp dir of its own under the head's (one `stop` removes them
    all): nodes sharing one session folder share its runtime_resources/, and one node's
    runtime-env agent then deleted a job's working_dir under another node's running driver
    (tests/e2e/test_multinode.py failed on it)."""
    import re

    env = _fake_tools(tmp_path)
    d = tmp_path / "cl"
    started = _script("start", "--workers", "2", "--dir", str(d), env=env)
    assert started.returncode == 0, started.stderr
    import time

    deadline = time.time() + 20  # the stand-in nodes start in the background: wait for all three
    while len((tmp_path / "calls.log").read_text().splitlines()) < 3 and time.time() < deadline:
        time.sleep(0.1)
    calls = (tmp_path / "calls.log").read_text().splitlines()
    dirs = {("head" if "--head" in c else "worker", re.search(r"--temp-dir=(\S+)", c).group(1)) for c in calls}
    head = (d / "temp_dir").read_text().strip()
    workers = [x for kind, x in dirs if kind == "worker"]
    assert len(calls) == 3 and ("head", head) in dirs
    assert len(set(workers)) == 2 and all(Path(x).parent == Path(head) for x in workers), dirs
    assert _script("stop", "--dir", str(d), env=env).returncode == 0
