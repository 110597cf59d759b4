"""cluster/local_cluster.sh really starts a multi-node Ray (head + workers with the custom
resources the multi-node tests rely on, token auth on, dashboard on 127.0.0.1) and `stop` ends
exactly the processes it started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "cluster" / "local_cluster.sh"

PROBE = """
import json, ray
ray.init(logging_level="ERROR", log_to_driver=False)
nodes = [n for n in ray.nodes() if n["Alive"]]
print(json.dumps({"n": len(nodes), "resources": ray.cluster_resources()}))
"""


def _env_from(file: Path) -> dict[str, str]:
    env = dict(os.environ)
    for line in file.read_text().splitlines():
        key, value = line.removeprefix("export ").split("=", 1)
        env[key] = value
    return env


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.ray
def test_local_cluster_start_probe_stop(tmp_path):
    d = tmp_path / "cl"
    bin_dir = str(Path(sys.executable).parent)
    base = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"]}
    run = lambda *a, **kw: subprocess.run(  # noqa: E731
        ["bash", str(SCRIPT), *a, "--dir", str(d)], env=base, capture_output=True, text=True,
        timeout=180, **kw,
    )
    started = run("start", "--workers", "2", "--cpus", "1")
    pids = [int(p) for p in (d / "pids").read_text().split()] if (d / "pids").exists() else []
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        assert len(pids) == 3 and all(_alive(p) for p in pids)
        env = _env_from(d / "env")
        assert env["RAY_AUTH_MODE"] == "token" and env["GTI_DASHBOARD"].startswith("http://127.0.0.1:")
        assert (d / "auth_token").stat().st_mode & 0o077 == 0, "token file readable by others"

        probe = subprocess.run(
            [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
        )
        assert probe.returncode == 0, probe.stderr[-2000:]
        info = json.loads(probe.stdout.strip().splitlines()[-1])
        assert info["n"] == 3
        res = info["resources"]
        assert res["gti_worker"] == 2 and res["gti_node_1"] == 1 and res["gti_node_2"] == 1

        # Without the token the cluster refuses a client: authentication is really on.
        no_token = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
        no_token["RAY_AUTH_MODE"] = "disabled"
        refused = subprocess.run(
            [sys.executable, "-c", PROBE], env=no_token, capture_output=True, text=True, timeout=120
        )
        assert refused.returncode != 0
    finally:
        stopped = run("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert not any(_alive(p) for p in pids)
    assert not (d / "auth_token").exists()
    assert "no cluster" in run("status").stdout
