"""gti.ray_start.ensure_ray: a local start retried once then one line naming the logs; the run
pins its own Ray (workers and driver get its address); Ray Train's state-API warning filtered;
a local Ray's Train poll interval shortened unless the user set it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gti import ray_start
from gti.config import LOCAL_RAY_ENV, RunConfig

ROOT = Path(__file__).resolve().parents[1]


class _FakeRay:
    """Stands in for `ray` in ensure_ray: init fails `fail` times, then succeeds."""

    def __init__(self, monkeypatch, fail: int) -> None:
        import ray

        self.calls: list[dict] = []
        self.fail = fail
        self.up = False
        monkeypatch.setattr(ray, "is_initialized", lambda: self.up)
        monkeypatch.setattr(ray, "init", self.init)
        monkeypatch.setattr(ray, "shutdown", lambda: None)

        class Ctx:
            gcs_address = "10.1.2.3:4567"

        monkeypatch.setattr(ray, "get_runtime_context", lambda: Ctx())
        monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.1.2.3")

    def init(self, **kwargs):
        self.calls.append({**kwargs, "gcs_port_env": os.environ.get("RAY_GCS_SERVER_PORT"),
                           "train_poll_env": os.environ.get(ray_start.TRAIN_POLL_ENV),
                           "proxy_ready_env": os.environ.get(ray_start.SERVE_PROXY_READY_ENV)})
        if len(self.calls) <= self.fail:
            raise Exception("The current node timed out during startup. This could happen because ...\nmore")
        self.up = True


@pytest.fixture
def no_wait(monkeypatch, tmp_path):
    monkeypatch.setattr(ray_start, "START_RETRY_WAIT_S", 0.0)
    for var in ("RAY_ADDRESS", LOCAL_RAY_ENV, "RAY_GCS_SERVER_PORT"):
        # setenv first: delenv of an unset variable records nothing, and the fake start's
        # RAY_ADDRESS would then outlive the test (a later session Ray in the same process
        # would join it: "num_cpus ... must not be provided").
        monkeypatch.setenv(var, "unset")
        monkeypatch.delenv(var)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    # The session's real Ray may be up in this process: its cached auth must not be re-read
    # from the private environment a fake start sets (and undone below).
    reloads = []
    monkeypatch.setattr(ray_start, "_reload_auth", lambda: reloads.append(os.environ.get("RAY_AUTH_TOKEN")))
    yield reloads
    ray_start._undo_private()


def test_local_start_is_retried_once(monkeypatch, no_wait, capsys):

    fake = _FakeRay(monkeypatch, fail=1)
    ray_start.ensure_ray(RunConfig(ray_num_cpus=3))
    assert len(fake.calls) == 2
    assert "local Ray did not start (The current node timed out during startup." in capsys.readouterr().err
    last = fake.calls[-1]
    assert last["num_cpus"] == 3 and last["include_dashboard"] is False
    # The GCS port is chosen before the start, so every worker gets the address in its env.
    port = last["gcs_port_env"]
    assert last["runtime_env"]["env_vars"] == {"RAY_ADDRESS": f"10.1.2.3:{port}"}
    assert callable(last["runtime_env"]["worker_process_setup_hook"])
    assert os.environ["RAY_ADDRESS"] == "10.1.2.3:4567"  # the driver pins what Ray reports
    assert "RAY_GCS_SERVER_PORT" not in os.environ  # restored
    # ... and marks it as its own local Ray: once that is shut down, the next start in this
    # process makes a new one instead of joining a dead address; a child process joins it.
    assert os.environ[LOCAL_RAY_ENV] == f"{os.getpid()}:10.1.2.3:4567"
    assert RunConfig().requested_ray_address() is None
    child = {"RAY_ADDRESS": "10.1.2.3:4567", LOCAL_RAY_ENV: "1:10.1.2.3:4567"}
    assert RunConfig().requested_ray_address(child) == "10.1.2.3:4567"
    assert RunConfig(ray_address="auto").requested_ray_address() == "auto"
    fake.up = False  # "ray.shutdown()": a second ensure_ray starts locally again
    ray_start.ensure_ray(RunConfig(ray_num_cpus=3))
    assert "address" not in fake.calls[-1] and fake.calls[-1]["num_cpus"] == 3


def test_a_local_start_is_private_and_joining_a_cluster_undoes_it(monkeypatch, no_wait):
    """The local Ray gets loopback-only addresses and a fresh token of its own (tokens differ
    from one start to the next); a later join in the same process gets the user's own auth
    settings back, so the cluster sees the user's token, not the local Ray's."""
    from ray._private import ray_constants

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/elsewhere/token")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    was_cluster = ray_constants.ENABLE_RAY_CLUSTER
    monkeypatch.setattr(ray_start.ledger, "note", lambda *a: None)  # fake starts: no Ray for the test budget
    fake = _FakeRay(monkeypatch, fail=0)
    ray_start.ensure_ray(RunConfig(ray_num_cpus=1))
    first = os.environ["RAY_AUTH_TOKEN"]
    assert os.environ["RAY_AUTH_MODE"] == "token" and "RAY_AUTH_TOKEN_PATH" not in os.environ
    assert len(first) == 64 and no_wait == [first]  # Ray's cached auth re-read with this token
    assert os.environ[ray_start.LOOPBACK_ENV] == "0" and ray_constants.ENABLE_RAY_CLUSTER is False
    fake.up = False
    ray_start.ensure_ray(RunConfig(ray_num_cpus=1))
    assert os.environ["RAY_AUTH_TOKEN"] != first
    fake.up = False
    ray_start.ensure_ray(RunConfig(ray_address="ray://10.1.2.3:10001"))
    assert fake.calls[-1]["address"] == "ray://10.1.2.3:10001"
    assert os.environ["RAY_AUTH_MODE"] == "disabled" and os.environ["RAY_AUTH_TOKEN_PATH"] == "/elsewhere/token"
    assert "RAY_AUTH_TOKEN" not in os.environ and ray_start.LOOPBACK_ENV not in os.environ
    assert ray_constants.ENABLE_RAY_CLUSTER == was_cluster and no_wait[-1] is None


@pytest.mark.parametrize("env, key, local", [
    (ray_start.TRAIN_POLL_ENV, "train_poll_env", "0.5"),
    (ray_start.SERVE_PROXY_READY_ENV, "proxy_ready_env", "60"),
])
def test_a_local_start_sets_rays_timings_unless_the_user_set_them(monkeypatch, no_wait, env, key, local):
    """Ray Train's controller poll (ray.train.report waits for it) is 0.5 s for a local Ray and
    Serve's proxy ready check 60 s: set before ray.init, so the processes Ray starts inherit
    them. A value the user set is kept, and joining a cluster leaves the user's setting (none
    here) as it was."""
    monkeypatch.setattr(ray_start.ledger, "note", lambda *a: None)  # fake starts: no Ray for the test budget
    monkeypatch.delenv(env, raising=False)
    fake = _FakeRay(monkeypatch, fail=0)
    ray_start.ensure_ray(RunConfig(ray_num_cpus=1))
    assert fake.calls[-1][key] == os.environ[env] == local
    fake.up = False
    ray_start.ensure_ray(RunConfig(ray_address="ray://10.1.2.3:10001"))
    assert fake.calls[-1][key] is None and env not in os.environ
    monkeypatch.setenv(env, "3")
    for cfg in (RunConfig(ray_num_cpus=1), RunConfig(ray_address="ray://10.1.2.3:10001")):
        fake.up = False
        ray_start.ensure_ray(cfg)
        assert fake.calls[-1][key] == os.environ[env] == "3"


def test_second_failure_is_one_line_naming_the_logs(monkeypatch, no_wait, tmp_path):

    session = tmp_path / "session_2099-01-01_00-00-00_000000_1"
    (session / "logs").mkdir(parents=True)
    fake = _FakeRay(monkeypatch, fail=2)
    with pytest.raises(ray_start.RayStartError) as e:
        ray_start.ensure_ray(RunConfig())
    assert len(fake.calls) == 2
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("local Ray did not start (twice): The current node timed out")
    assert f"read {session / 'logs'}/raylet.out and {session / 'logs'}/gcs_server.out" in msg


def test_the_cli_prints_a_start_failure_as_one_line(monkeypatch, no_wait, tmp_path, capsys):
    from gti.cli import main

    _FakeRay(monkeypatch, fail=2)
    items = tmp_path / "items.csv"
    items.write_text("item_id,title\n1,A\n")
    inter = tmp_path / "inter.csv"
    inter.write_text("user_id,item_id,ts\nu,1,1\n")
    rc = main(["run", "--to", "ingest", "-c", str(ROOT / "jobs/configs/tiny.yaml"), f"run_dir={tmp_path / 'run'}",
               f"data.items.path={items}", f"data.interactions.path={inter}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("gti: error: local Ray did not start (twice): ")
    assert not any("Traceback" in line for line in err)


def test_job_that_sets_ray_address_is_not_pinned_twice(monkeypatch):
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"env_vars": {"RAY_ADDRESS": "x:1"}}}))
    assert ray_start._pin_env("y:2") is None
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": "."}}))
    assert ray_start._pin_env("y:2") == {"env_vars": {"RAY_ADDRESS": "y:2"}}


def test_state_api_warning_is_filtered_and_nothing_else(caplog):
    name = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
    log = logging.getLogger(name)
    before = list(log.filters)
    try:
        ray_start._quiet_state_api_warnings()()
        with caplog.at_level(logging.WARNING, logger=name):
            log.warning("Failed to query Ray Train Controller actor state. State API may be temporarily unavailable.")
            log.warning("Failed to clean up placement group: boom")
        assert [r.getMessage() for r in caplog.records] == ["Failed to clean up placement group: boom"]
    finally:
        log.filters[:] = before


PROBE = """
import os, socket, subprocess, sys
import psutil, ray
from gti.config import RunConfig
from gti.ray_start import ensure_ray
ensure_ray(RunConfig(ray_num_cpus=1))
gcs = ray.get_runtime_context().gcs_address
seen = ray.get(ray.remote(lambda: os.environ.get("RAY_ADDRESS")).remote())
print("PINNED", gcs, os.environ.get("RAY_ADDRESS"), seen, flush=True)
listening = set()
for p in psutil.Process().children(recursive=True):  # GCS, raylet, agents, workers
    try:
        listening |= {c.laddr.ip for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    except psutil.Error:
        pass
print("LISTEN", " ".join(sorted(listening)), flush=True)
CLIENT = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
          "print(ray.get(ray.remote(lambda: 'JOINED').remote()))")
home = os.path.join(os.getcwd(), "home")
os.makedirs(os.path.join(home, ".ray"), exist_ok=True)
with open(os.path.join(home, ".ray", "auth_token"), "w") as f:  # a token of the user's other Rays
    f.write("f" * 64)
for name, auth in (("none", {}), ("default", {"RAY_AUTH_MODE": "token"}),
                   ("run", {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.environ["RAY_AUTH_TOKEN"]})):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    env.update(auth, HOME=home, RAY_gcs_server_port_wait_time_s="3")  # a refused client retries 3 s, not 20
    out = subprocess.run([sys.executable, "-c", CLIENT, gcs], env=env, capture_output=True, text=True, timeout=120)
    print("CLIENT", name, "JOINED" in out.stdout, "InvalidAuthToken" in out.stderr, flush=True)
ip = ray._private.services.node_ip_address_from_perspective()
try:
    socket.create_connection((ip, int(gcs.rsplit(":", 1)[1])), timeout=5).close()
    print("OTHER_ADDRESS", ip, "connected")
except OSError:
    print("OTHER_ADDRESS", ip, "refused")
ray.shutdown()
"""


@pytest.mark.slow
@pytest.mark.ray
def test_a_local_ray_is_pinned_for_its_workers_and_private(tmp_path):
    """A fresh process (its own Ray, beside any other on the host): a task sees the address of
    the Ray that started it, the same as the driver's RAY_ADDRESS. That Ray is the run's alone:
    every port listens on 127.0.0.1 only (the node's other address refuses the connection), and
    a client without the run's token is refused (no token; the user's ~/.ray/auth_token, which
    Ray's own default would share), while one given the run's token joins (so it is the token
    that is refused, not the client)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    lines = {ln.split()[0]: ln.split()[1:] for ln in out.stdout.splitlines() if ln.split()}
    lines.update({f"CLIENT {ln.split()[1]}": ln.split()[2:] for ln in out.stdout.splitlines()
                  if ln.startswith("CLIENT ")})
    assert "OTHER_ADDRESS" in lines, out.stdout[-2000:] + out.stderr[-3000:]
    gcs, driver, worker = lines["PINNED"]
    assert gcs == driver == worker and gcs.startswith("127.0.0.1:")
    assert lines["LISTEN"] and set(lines["LISTEN"]) <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, lines["LISTEN"]
    assert lines["CLIENT none"] == ["False", "True"]  # refused: InvalidAuthToken
    assert lines["CLIENT default"] == ["False", "True"]
    assert lines["CLIENT run"] == ["True", "False"]
    ip, result = lines["OTHER_ADDRESS"]
    if not ip.startswith("127."):  # a machine with only a loopback interface has no other address
        assert result == "refused"
