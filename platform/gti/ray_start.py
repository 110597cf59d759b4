"""Starting or joining Ray, the same way for every caller (the stages, `gti refresh`, `gti vocab
ground`, `gti compare`/`gti tune`, `gti infer`, `gti doctor`).

What it is for: `ensure_ray(cfg)` joins `cfg.ray_address` (a cluster, "auto") or starts a local
Ray sized by `cfg.ray_num_cpus`; calling it twice is harmless. A local start that fails under
load is retried once, then named in one line (`RayStartError`). The run pins the Ray it started
or joined for every worker of the job; a local Ray is private to the run (loopback only, a
fresh auth token) and polls its Train workers more often than Ray's default. Ray Data's
per-operator progress bars are quiet when stdout is not a terminal.

What it does not know: what its callers run on Ray.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import socket
import sys
import time

from gti.common import ledger
from gti.common.errors import GtiError, one_line

START_RETRY_WAIT_S = 5.0
_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by `ray job submit` for the driver


class RayStartError(GtiError):
    """A local Ray could not be started (or a cluster joined); the message names the logs."""


def ensure_ray(cfg) -> None:
    import ray

    if ray.is_initialized():
        return
    from gti.config import LOCAL_RAY_ENV

    address = cfg.requested_ray_address()
    if address:
        _undo_private()
        _join(address)
        os.environ.pop(LOCAL_RAY_ENV, None)
    else:
        _start_local(cfg.ray_num_cpus)
    # This process (and anything it starts) talks to the same Ray from now on.
    gcs = ray.get_runtime_context().gcs_address
    os.environ["RAY_ADDRESS"] = gcs
    if not address:  # our own local Ray: a later start in this process must not join it once gone
        os.environ[LOCAL_RAY_ENV] = f"{os.getpid()}:{gcs}"
    ctx = ray.data.DataContext.get_current()
    interactive = sys.stderr.isatty()
    ctx.enable_progress_bars = interactive
    ctx.enable_operator_progress_bars = interactive
    ctx.print_on_execution_start = interactive


# The run pins its own Ray: the address it started or joined goes to every Ray worker of the
# job (runtime_env RAY_ADDRESS) and to this process's environment. Ray's own helpers that look
# the cluster up from inside a worker (Ray Train's PlacementGroupCleaner, the state API) would
# otherwise pick "the latest" of several Ray instances on the same host, or fail with
# "Found multiple active Ray instances". A local Ray runs without the dashboard, so Ray Train's
# once-a-second state query from its PlacementGroupCleaner cannot succeed; its warning line is
# filtered in the workers (`_quiet_state_api_warnings`).
def _pin_env(address: str) -> dict | None:
    """runtime_env giving every worker of this job RAY_ADDRESS=address, or None where the job
    (`ray job submit`) already sets RAY_ADDRESS for its workers (Ray refuses a second value)."""
    job = os.environ.get(_JOB_CONFIG_ENV)
    if job:
        try:
            env_vars = (json.loads(job).get("runtime_env") or {}).get("env_vars") or {}
        except (ValueError, AttributeError):
            env_vars = {}
        if "RAY_ADDRESS" in env_vars:
            return None
    return {"env_vars": {"RAY_ADDRESS": address}}


def _join(address: str) -> None:
    import ray

    if address == "auto" or "://" not in address:
        from ray._private import services

        try:
            # Ray's own rule for "auto"/host:port; gives the GCS address the workers need.
            address = services.canonicalize_bootstrap_address_or_die(address)
        except ConnectionError as err:
            raise RayStartError(f"ray_address {address}: {one_line(str(err))}") from None
    try:
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=True,
                 runtime_env=_pin_env(address) if "://" not in address else None)
    except ConnectionError as err:
        raise RayStartError(f"cannot join Ray at {address}: {one_line(str(err))}") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_local(num_cpus: int | None) -> None:
    """ray.init of a new local Ray whose GCS port we choose, so that its address is known before
    the workers start and can be pinned in their environment. Retried once."""
    import ray

    _make_private()
    for attempt in (1, 2):
        started = time.time()
        port = _free_port()
        address = f"{ray.util.get_node_ip_address()}:{port}"
        old_port = os.environ.get("RAY_GCS_SERVER_PORT")
        os.environ["RAY_GCS_SERVER_PORT"] = str(port)  # read by ray.init for a new head node
        try:
            env = _pin_env(address) or {}
            env["worker_process_setup_hook"] = _quiet_state_api_warnings()
            ray.init(num_cpus=num_cpus, ignore_reinit_error=True, log_to_driver=True,
                     include_dashboard=False, runtime_env=env)
            ledger.note("ray", f"local:{port}")
            return
        except Exception as err:  # noqa: BLE001 - any failure of a local start is reported the same way
            logs = _session_logs(started)
            _stop_partial_start(logs)
            if attempt == 1:
                print(f"gti: warning: local Ray did not start ({one_line(str(err))}); "
                      f"retrying in {START_RETRY_WAIT_S:g}s", file=sys.stderr, flush=True)
                time.sleep(START_RETRY_WAIT_S)
                continue
            raise RayStartError(
                f"local Ray did not start (twice): {one_line(str(err))}; read {logs}/raylet.out and "
                f"{logs}/gcs_server.out (or set ray_address to join a running cluster)"
            ) from None
        finally:
            if old_port is None:
                os.environ.pop("RAY_GCS_SERVER_PORT", None)
            else:
                os.environ["RAY_GCS_SERVER_PORT"] = old_port


# Ray's single-machine mode (ray_constants.ENABLE_RAY_CLUSTER false): every address 127.0.0.1.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Ray Train V2's controller poll interval (ray.train.v2._internal.constants; Ray's default 2 s).
# A local Ray polls every LOCAL_TRAIN_POLL_S unless the user set the variable (it is inherited by
# the processes Ray starts): `ray.train.report()` waits for the controller's next poll, so every
# metric report and checkpoint of a short run idled until then (bench/test-suite/RESULTS.md,
# "Demo and test-suite wall times"); a poll is one small actor call per worker. A joined cluster
# keeps its own setting (the controller runs there, with the cluster's environment).
TRAIN_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
LOCAL_TRAIN_POLL_S = "0.5"
# How long Ray Serve's controller waits for a new HTTP proxy to be ready before killing it and
# starting another (ray.serve._private.constants; Ray's default 5 s). A new worker process can
# take longer on a loaded machine, and serve.start then fails on the killed one (seen in CI).
# A local Ray's default; a value the user set is kept.
SERVE_PROXY_READY_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
LOCAL_SERVE_PROXY_READY_S = "60"
_PRIVATE_VARS = (LOOPBACK_ENV, "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", TRAIN_POLL_ENV,
                 SERVE_PROXY_READY_ENV)
_saved: dict | None = None  # what _make_private replaced, for _undo_private


# A local Ray is private to the run (`_make_private`): every port on 127.0.0.1 only (Ray's
# single-machine mode, the one it uses on macOS and Windows) and token authentication with a
# fresh token of this Ray alone, held in the environment of this process and of the processes
# Ray starts, so no other machine can reach it and no other local user can join it (Ray's own
# default token, ~/.ray/auth_token, is shared by every Ray of the user and written with the
# user's umask, often readable by others).
# Joining a cluster (`ray_address`) changes nothing of the kind: the cluster's own auth holds.
def _make_private() -> None:
    """The environment of a private local Ray, for this process and the processes Ray starts
    (GCS, raylet, workers inherit it): loopback only, token auth with a fresh per-run token,
    Ray Train's shorter poll interval and Serve's longer proxy ready check unless the user set
    them."""
    global _saved
    from ray._private import ray_constants

    if _saved is None:
        _saved = {"env": {k: os.environ.get(k) for k in _PRIVATE_VARS},
                  "cluster": ray_constants.ENABLE_RAY_CLUSTER}
    os.environ[LOOPBACK_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False  # read at call time by ray's node-address lookup
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # first of Ray's token sources
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    os.environ.setdefault(TRAIN_POLL_ENV, LOCAL_TRAIN_POLL_S)
    os.environ.setdefault(SERVE_PROXY_READY_ENV, LOCAL_SERVE_PROXY_READY_S)
    _reload_auth()


def _undo_private() -> None:
    """Back to the user's own settings before joining a cluster, in a process that started a
    private local Ray earlier (its token would be sent to the cluster and refused)."""
    global _saved
    if _saved is None:
        return
    from ray._private import ray_constants

    for k, v in _saved["env"].items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    ray_constants.ENABLE_RAY_CLUSTER = _saved["cluster"]
    _saved = None
    _reload_auth()


def _reload_auth() -> None:
    """Ray caches its auth mode (RayConfig) and token (C++ loader) per process: re-read both
    from the environment, as Ray's own `ray get-auth-token --generate` does."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _quiet_state_api_warnings():
    """A worker set-up hook for a local Ray, which runs without the dashboard (its API server is
    what Ray's state API calls): Ray Train's PlacementGroupCleaner asks that API every second
    whether the controller is alive and, finding no server, logs "Failed to query Ray Train
    Controller actor state" each time. The hook drops that one message in the workers; the
    cleaner keeps running. A closure, so Ray ships it by value (no import of gti needed)."""

    def hook() -> None:
        import logging

        class _DropStateApiWarning(logging.Filter):
            def filter(self, record: logging.LogRecord) -> bool:
                return "Failed to query Ray Train Controller actor state" not in record.getMessage()

        logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").addFilter(
            _DropStateApiWarning())

    return hook


def _session_logs(since: float) -> str:
    """The logs folder of the Ray session started at or after `since` (Ray's default temp dir,
    or RAY_TMPDIR), or the generic session_latest path when none is found."""
    root = os.environ.get("RAY_TMPDIR") or "/tmp/ray"
    sessions = [s for s in glob.glob(os.path.join(root, "session_2*")) if os.path.getmtime(s) >= since - 1]
    newest = max(sessions, key=os.path.getmtime) if sessions else os.path.join(root, "session_latest")
    return os.path.join(newest, "logs")


def _stop_partial_start(logs: str) -> None:
    """Stop what a failed ray.init left running: Ray's own state, then this process's child
    processes of that session (GCS, raylet), found by the session folder in their command line."""
    import ray

    try:
        ray.shutdown()
    except Exception:  # noqa: BLE001 - nothing to shut down after a failed start
        pass
    session = os.path.dirname(logs)
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                if any(session in arg for arg in child.cmdline()):
                    child.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    except ImportError:  # psutil comes with ray; without it the reaper stops them at exit
        pass
