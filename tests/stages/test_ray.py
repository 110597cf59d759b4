"""gti.stages._ray.ensure_ray: a local start retried once then one line naming the logs; the run
pins its own Ray (workers and driver get its address); Ray Train's state-API warning filtered."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gti.config import LOCAL_RAY_ENV, RunConfig
from gti.stages import _ray

ROOT = Path(__file__).resolve().parents[2]


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
        self.calls.append({**kwargs, "gcs_port_env": os.environ.get("RAY_GCS_SERVER_PORT")})
        if len(self.calls) <= self.fail:
            raise Exception("The current node timed out during startup. This could happen because ...\nmore")
        self.up = True


@pytest.fixture
def no_wait(monkeypatch, tmp_path):
    monkeypatch.setattr(_ray, "START_RETRY_WAIT_S", 0.0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(LOCAL_RAY_ENV, raising=False)  # restored at teardown: nothing leaks
    monkeypatch.delenv("RAY_GCS_SERVER_PORT", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))


def test_local_start_is_retried_once(monkeypatch, no_wait, capsys):

    fake = _FakeRay(monkeypatch, fail=1)
    _ray.ensure_ray(RunConfig(ray_num_cpus=3))
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
    _ray.ensure_ray(RunConfig(ray_num_cpus=3))
    assert "address" not in fake.calls[-1] and fake.calls[-1]["num_cpus"] == 3


def test_second_failure_is_one_line_naming_the_logs(monkeypatch, no_wait, tmp_path):

    session = tmp_path / "session_2099-01-01_00-00-00_000000_1"
    (session / "logs").mkdir(parents=True)
    fake = _FakeRay(monkeypatch, fail=2)
    with pytest.raises(_ray.RayStartError) as e:
        _ray.ensure_ray(RunConfig())
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
    assert _ray._pin_env("y:2") is None
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": "."}}))
    assert _ray._pin_env("y:2") == {"env_vars": {"RAY_ADDRESS": "y:2"}}


def test_state_api_warning_is_filtered_and_nothing_else(caplog):
    name = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
    log = logging.getLogger(name)
    before = list(log.filters)
    try:
        _ray._quiet_state_api_warnings()()
        with caplog.at_level(logging.WARNING, logger=name):
            log.warning("Failed to query Ray Train Controller actor state. State API may be temporarily unavailable.")
            log.warning("Failed to clean up placement group: boom")
        assert [r.getMessage() for r in caplog.records] == ["Failed to clean up placement group: boom"]
    finally:
        log.filters[:] = before


PROBE = """
import os, sys
import ray
from gti.config import RunConfig
from gti.stages._ray import ensure_ray
ensure_ray(RunConfig(ray_num_cpus=1))
gcs = ray.get_runtime_context().gcs_address
seen = ray.get(ray.remote(lambda: os.environ.get("RAY_ADDRESS")).remote())
print("PINNED", gcs, os.environ.get("RAY_ADDRESS"), seen)
ray.shutdown()
"""


@pytest.mark.slow
@pytest.mark.ray
def test_a_local_ray_is_pinned_for_its_workers(tmp_path):
    """A fresh process (its own Ray, beside any other on the host): a task sees the address of
    the Ray that started it, the same as the driver's RAY_ADDRESS."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("PINNED")), None)
    assert line is not None, out.stderr[-3000:]
    _, gcs, driver, worker = line.split()
    assert gcs == driver == worker
