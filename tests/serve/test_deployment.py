"""gti/serve/deployment.py without starting Ray: the Serve options from the serve: section
(fixed replicas or autoscaling bounds, CPUs = threads), where `gti serve` takes its settings
(defaults < --config < serve.* overrides < flags; other overrides refused), the deployment's
shape (an ingress forwarding to the model replicas, a batch method), the ingress handing the app
paths relative to the route prefix and answering 503 + Retry-After when the replica dies
mid-request, and jobs/serve.yaml (a valid Serve config whose import path builds the application)."""

from __future__ import annotations

from argparse import Namespace

import pytest

pytest.importorskip("ray.serve")

from gti.config.serve import ServeConfig  # noqa: E402
from gti.common.errors import ConfigError  # noqa: E402
from gti.serve import deployment as D  # noqa: E402


def test_options_fixed_replicas_and_autoscaling():
    opts = D.deployment_options(ServeConfig(replicas=3, threads=2, max_batch_size=8))
    assert opts["num_replicas"] == 3 and "autoscaling_config" not in opts
    assert opts["ray_actor_options"] == {"num_cpus": 2} and opts["max_ongoing_requests"] == 16
    assert D.deployment_options(ServeConfig(num_gpus=1))["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}
    auto = D.deployment_options(ServeConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=3))
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 3}


def _args(**kw):
    base = {"config": None, "overrides": [], "host": None, "port": None, "route_prefix": None, "replicas": None}
    return Namespace(**{**base, **kw})


def test_serve_config_precedence(tmp_path):
    assert D.serve_config(_args()) == ServeConfig()
    conf = tmp_path / "c.yaml"
    conf.write_text("serve:\n  port: 9001\n  max_k: 7\n  replicas: 2\n")
    cfg = D.serve_config(_args(config=str(conf), overrides=["serve.max_k=9"], replicas=5))
    assert (cfg.host, cfg.port, cfg.max_k, cfg.replicas) == ("127.0.0.1", 9001, 9, 5)
    assert D.serve_config(_args(host="0.0.0.0", port=8080)).host == "0.0.0.0"
    with pytest.raises(ConfigError, match="only serve.\\* overrides"):
        D.serve_config(_args(overrides=["sft.lr=1"]))
    with pytest.raises(Exception, match="port"):
        D.serve_config(_args(port=0))
    assert D.serve_config(_args(overrides=["serve.route_prefix=/a"], route_prefix="/gti")).route_prefix == "/gti"
    with pytest.raises(ConfigError, match="route_prefix.*'gti/'"):  # one line, not pydantic's report
        D.serve_config(_args(route_prefix="gti/"))


def test_deployment_shape():
    assert (D.GtiRecommender.name, D.GtiIngress.name) == ("gti-recommender", "gti-ingress")
    cls = D.GtiRecommender.func_or_class
    assert hasattr(cls, "forward") and hasattr(cls, "_batched")
    opts = D.ingress_options(ServeConfig(replicas=3, max_batch_size=8))
    assert opts["ray_actor_options"] == {"num_cpus": 0} and opts["num_replicas"] == 3
    assert opts["max_ongoing_requests"] == 64


def _request(body: bytes, path: str = "/recommend", root_path: str | None = None):
    from starlette.requests import Request

    chunks = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"k=1",
             "headers": [(b"content-type", b"application/json")]}
    if root_path is not None:
        scope["root_path"] = root_path
    return Request(scope, receive)


class _Model:
    """A stand-in for the model handle: `forward.remote(...)` awaits `result` (or raises it)."""

    def __init__(self, result):
        self.calls, outer = [], self

        class _Forward:
            def remote(self, *args):
                outer.calls.append(args)

                async def answer():
                    if isinstance(result, BaseException):
                        raise result
                    return result
                return answer()
        self.forward = _Forward()


def test_ingress_forwards_and_a_dead_replica_is_a_retryable_503():
    import asyncio
    import json

    from ray.exceptions import ActorDiedError, ActorUnavailableError

    ingress_cls = D.GtiIngress.func_or_class
    model = _Model((200, [(b"content-type", b"application/json"), (b"content-length", b"2")], b"{}"))
    resp = asyncio.run(ingress_cls(model, 64)(_request(b'{"history": ["a"]}')))
    assert resp.status_code == 200 and resp.body == b"{}"
    assert model.calls[0][:3] == ("POST", "/recommend", b"k=1") and model.calls[0][4] == b'{"history": ["a"]}'
    # A body over the limit is cut after limit+1 bytes: the replica's app answers 413 on it.
    asyncio.run(ingress_cls(model, 64)(_request(b"x" * 500)))
    assert len(model.calls[1][4]) == 65
    for died in (ActorDiedError(), ActorUnavailableError("unreachable", None)):
        resp = asyncio.run(ingress_cls(_Model(died), 64)(_request(b"{}")))
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert json.loads(resp.body) == {"error": D.RETRY_MESSAGE, "status": 503}


@pytest.mark.parametrize("path, root_path, seen", [
    ("/recommend", None, "/recommend"), ("/recommend", "", "/recommend"), ("/", "", "/"),
    # Serve's proxy keeps the full path and puts the prefix in root_path (ray/serve/_private/proxy.py)
    ("/gti/recommend", "/gti", "/recommend"), ("/gti/recommend/batch", "/gti", "/recommend/batch"),
    ("/gti/", "/gti", "/"), ("/gti", "/gti", "/"),
    ("/proxy/gti/info", "/proxy/gti", "/info"),  # http_options.root_path + the route prefix
])
def test_the_app_sees_paths_relative_to_the_route_prefix(path, root_path, seen):
    import asyncio

    scope = {"path": path} if root_path is None else {"path": path, "root_path": root_path}
    assert D.app_path(scope) == seen
    model = _Model((200, [], b"{}"))
    asyncio.run(D.GtiIngress.func_or_class(model, 64)(_request(b"{}", path, root_path)))
    assert model.calls[0][1] == seen


def test_service_url_names_the_prefix():
    assert D.service_url(ServeConfig(port=8123)) == "http://127.0.0.1:8123/"
    assert D.service_url(ServeConfig(host="0.0.0.0", route_prefix="/api/gti")) == "http://0.0.0.0:8000/api/gti/"


def test_gti_serve_parser():
    from gti.cli import build_parser

    a = build_parser().parse_args(["serve", "--run-dir", "r", "--version", "1", "--port", "9000",
                                   "--replicas", "2", "serve.max_k=5"])
    assert (a.run_dir, a.version, a.port, a.replicas, a.host, a.overrides) == ("r", 1, 9000, 2, None, ["serve.max_k=5"])
    assert a.trust_remote_code is False and a.route_prefix is None
    assert build_parser().parse_args(["serve", "--run-dir", "r", "--route-prefix", "/gti"]).route_prefix == "/gti"


def test_serve_starts_a_private_local_ray_or_joins_the_cluster(monkeypatch):
    """`gti serve` starts Ray as every gti command does (gti.ray_start.ensure_ray: loopback only
    and a fresh token of its own, tests/test_ray_start.py), or joins --ray-address."""
    from gti import ray_start

    asked = []
    monkeypatch.setattr(ray_start, "ensure_ray", lambda cfg: asked.append(cfg.requested_ray_address({})))
    D.start_ray(None)
    D.start_ray("ray://head:10001")
    assert asked == [None, "ray://head:10001"]


def test_cli_main_wires_the_app_without_starting_ray(serve_run, monkeypatch, capsys):
    """`gti serve` parses, checks the run and the token, and hands Serve the bound app with
    the HTTP options of the flags (Ray and Serve replaced by recorders)."""
    from gti.cli import main

    seen = {}
    monkeypatch.setattr(D, "start_ray", lambda address: seen.setdefault("ray", address))
    monkeypatch.setattr(D.serve, "start", lambda **kw: seen.setdefault("start", kw))
    monkeypatch.setattr(D.serve, "run", lambda app, **kw: seen.setdefault("run", (app, kw)))
    monkeypatch.setattr(D.serve, "shutdown", lambda: seen.setdefault("shutdown", True))
    monkeypatch.setenv("GTI_SERVE_TOKEN", "tok")
    run = str(serve_run["run"])
    assert main(["serve", "--run-dir", run, "--port", "8123", "--replicas", "2", "serve.max_k=5"]) == 0
    assert seen["ray"] is None and seen["start"] == {"http_options": {"host": "127.0.0.1", "port": 8123}}
    app, kw = seen["run"]
    assert kw == {"name": "gti", "route_prefix": "/", "blocking": True} and seen["shutdown"]
    ingress = app._bound_deployment
    assert ingress.name == "gti-ingress" and ingress.init_args[1] == ServeConfig().max_body_bytes
    bound = ingress.init_args[0]._bound_deployment
    args = bound.init_args
    assert bound.name == "gti-recommender" and bound.num_replicas == 2
    assert args[0] == run and args[1] is None and args[2]["max_k"] == 5 and args[2]["replicas"] == 2
    assert args[3] == __import__("hashlib").sha256(b"tok").hexdigest() and args[4] is False
    board = args[5]._bound_deployment  # the replicas' shared version board: start pin, newest, forget_s
    assert board.name == "gti-versions" and board.num_replicas == 1 and board.init_args == (None, 1, 30.0)
    assert "http://127.0.0.1:8123/" in capsys.readouterr().err
    # A missing version or run folder is one line, before Ray starts.
    assert main(["serve", "--run-dir", run, "--version", "9"]) == 2
    assert "no finished refresh version 9" in capsys.readouterr().err
    assert main(["serve", "--run-dir", run + "-missing"]) == 2
    # Mounted at a prefix: Serve gets it, the line printed names it; a bad one is one line.
    seen.clear()
    assert main(["serve", "--run-dir", run, "--port", "8123", "--route-prefix", "/gti"]) == 0
    assert seen["run"][1]["route_prefix"] == "/gti"
    assert "http://127.0.0.1:8123/gti/ (POST http://127.0.0.1:8123/gti/recommend" in capsys.readouterr().err
    seen.clear()
    assert main(["serve", "--run-dir", run, "--route-prefix", "/gti/"]) == 2
    assert "'route_prefix'" in capsys.readouterr().err and "run" not in seen


def test_jobs_serve_yaml_is_a_serve_config_whose_import_path_builds_the_app(serve_run, tmp_path, monkeypatch):
    import importlib
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    path = Path(__file__).resolve().parents[2] / "jobs" / "serve.yaml"
    conf = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    app_conf = conf.applications[0]
    assert conf.http_options.host == "127.0.0.1" and app_conf.route_prefix == "/"
    module, attr = app_conf.import_path.split(":")
    builder = getattr(importlib.import_module(module), attr)
    assert builder is D.app_builder
    monkeypatch.setenv("GTI_SERVE_TOKEN", "tok")
    args = {**app_conf.args, "run_dir": str(serve_run["run"]), "overrides": ["serve.replicas=2"]}
    bound = builder(args)._bound_deployment.init_args[0]._bound_deployment
    assert bound.num_replicas == 2 and bound.init_args[0] == str(serve_run["run"]) and bound.init_args[1] is None
    with pytest.raises(ConfigError, match="unknown: \\['port'\\]"):
        builder({**args, "port": 1})
    with pytest.raises(Exception, match="run directory not found"):
        builder({**args, "run_dir": str(tmp_path / "missing")})


def test_start_serve_waits_for_a_proxy_that_serve_start_gave_up_on(monkeypatch):
    """serve.start fails on a slow proxy (its 60 s, or the controller killed the first one): the
    second call joins the controller, and start_serve returns once Serve says a proxy is HEALTHY."""
    import ray

    said = []
    for err in (TimeoutError("HTTP proxies not available after 60s."), ray.exceptions.ActorDiedError()):
        calls, polls = [], iter([{}, {"n1": "STARTING"}, {"n1": "HEALTHY"}])

        def start(http_options, err=err):
            calls.append(http_options)
            if len(calls) == 1:
                raise err

        monkeypatch.setattr(D.serve, "start", start)
        monkeypatch.setattr("time.sleep", lambda s: None)
        D.start_serve("127.0.0.1", 8123, wait_s=10, echo=said.append, status=lambda: next(polls))
        assert calls == [{"host": "127.0.0.1", "port": 8123}] * 2
        assert next(polls, "spent") == "spent"  # it polled until HEALTHY, not before
    assert len(said) == 2 and "slow to start (HTTP proxies not available after 60s.)" in said[0]


def test_start_serve_names_the_port_when_no_proxy_gets_healthy(monkeypatch):
    from gti.common.errors import GtiError

    calls = []

    def start(http_options):
        calls.append(http_options)
        if len(calls) == 1:
            raise TimeoutError("HTTP proxies not available after 60s.")

    monkeypatch.setattr(D.serve, "start", start)
    with pytest.raises(GtiError, match="proxy on 127.0.0.1:8123 was not healthy within 62 s"):
        D.start_serve("127.0.0.1", 8123, wait_s=2, echo=lambda m: None, status=lambda: {"n1": "UNHEALTHY"})


def test_start_serve_passes_other_errors_and_a_quick_start_through(monkeypatch):
    calls = []
    monkeypatch.setattr(D.serve, "start", lambda http_options: calls.append(http_options))
    D.start_serve("0.0.0.0", 8123)
    assert calls == [{"host": "0.0.0.0", "port": 8123}]

    def refused(http_options):
        raise ValueError("port in use")

    monkeypatch.setattr(D.serve, "start", refused)
    with pytest.raises(ValueError, match="port in use"):
        D.start_serve("127.0.0.1", 8123)


def test_rss_and_the_board_client():
    """A replica's memory for GET /info; the board handle called from a helper thread (as in
    the replica's constructor, where the event loop refuses a blocking `.result()`)."""
    import threading

    assert D.rss_mb() > 10

    class _Resp:
        def __init__(self, value):
            self.value = value

        def result(self, timeout_s=None):
            return self.value

    calls = []

    class _Method:
        def __init__(self, name):
            self.name = name

        def remote(self, *args):
            calls.append((self.name, args, threading.current_thread().name))
            return _Resp({"pin": {"version": args[0] if self.name == "pin" else 1}, "replicas": {}})

    class _Handle:
        pin, sync = _Method("pin"), _Method("sync")

    c = D.BoardClient(_Handle())
    assert c.pin(3, 4)["pin"]["version"] == 3 and c.sync("r", None)["pin"]["version"] == 1
    assert [n for n, _, _ in calls] == ["pin", "sync"] and all(t.startswith("gti-board") for _, _, t in calls)
