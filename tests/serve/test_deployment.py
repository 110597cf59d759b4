"""gti/serve/deployment.py without starting Ray: the Serve options from the serve: section
(fixed replicas or autoscaling bounds, CPUs = threads), where `gti serve` takes its settings
(defaults < --config < serve.* overrides < flags; other overrides refused), and the
deployment's shape (FastAPI ingress, a batch method)."""

from __future__ import annotations

from argparse import Namespace

import pytest

pytest.importorskip("ray.serve")

from gti.config_serve import ServeConfig  # noqa: E402
from gti.errors import ConfigError  # noqa: E402
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
    base = {"config": None, "overrides": [], "host": None, "port": None, "replicas": None}
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


def test_deployment_shape():
    assert D.GtiRecommender.name == "gti-recommender"
    cls = D.GtiRecommender.func_or_class
    assert hasattr(cls, "__serve_build_asgi_app__") and hasattr(cls, "_batched")


def test_gti_serve_parser():
    from gti.cli import build_parser

    a = build_parser().parse_args(["serve", "--run-dir", "r", "--version", "1", "--port", "9000",
                                   "--replicas", "2", "serve.max_k=5"])
    assert (a.run_dir, a.version, a.port, a.replicas, a.host, a.overrides) == ("r", 1, 9000, 2, None, ["serve.max_k=5"])
    assert a.trust_remote_code is False


def test_local_ray_is_loopback_only_and_a_cluster_is_joined(monkeypatch):
    import ray
    from ray._private import ray_constants

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    monkeypatch.setenv(D.LOOPBACK_ENV, "1")
    D.start_ray(None)
    assert calls[-1]["include_dashboard"] is False and "address" not in calls[-1]
    assert ray_constants.ENABLE_RAY_CLUSTER is False
    import os

    assert os.environ[D.LOOPBACK_ENV] == "0"
    D.start_ray("ray://head:10001")
    assert calls[-1]["address"] == "ray://head:10001"


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
    bound = app._bound_deployment
    args = bound.init_args
    assert bound.num_replicas == 2
    assert args[0] == run and args[1] is None and args[2]["max_k"] == 5 and args[2]["replicas"] == 2
    assert args[3] == __import__("hashlib").sha256(b"tok").hexdigest() and args[4] is False
    assert "http://127.0.0.1:8123/" in capsys.readouterr().err
    # A missing version or run folder is one line, before Ray starts.
    assert main(["serve", "--run-dir", run, "--version", "9"]) == 2
    assert "no finished refresh version 9" in capsys.readouterr().err
    assert main(["serve", "--run-dir", run + "-missing"]) == 2
