"""The serve token never reaches a Ray worker's environment (issue 51 item 7): `gti serve`
reads it, then removes $GTI_SERVE_TOKEN and $GTI_SERVE_TOKEN_FILE from its own environment
before it starts the local Ray (whose workers, the replicas among them, inherit that
environment); the replicas get only its sha256. Ray and Serve are replaced by recorders here:
no cluster starts."""

from __future__ import annotations

import hashlib
import os

import pytest

pytest.importorskip("ray.serve")

from gti.config.serve import ServeConfig  # noqa: E402
from gti.serve import deployment as D  # noqa: E402
from gti.serve.app import take_token  # noqa: E402


def test_take_token_reads_then_removes_it(tmp_path):
    env = {"GTI_SERVE_TOKEN": " abc ", "GTI_SERVE_TOKEN_FILE": "/x", "OTHER": "1"}
    assert take_token(ServeConfig(), env) == "abc" and env == {"OTHER": "1"}
    f = tmp_path / "tok"
    f.write_text("fromfile\n")
    env = {"GTI_SERVE_TOKEN_FILE": str(f)}
    assert take_token(ServeConfig(), env) == "fromfile" and env == {}
    env = {"MY_TOK": "x", "GTI_SERVE_TOKEN": "y"}
    assert take_token(ServeConfig(token_env="MY_TOK"), env) == "x" and env == {"GTI_SERVE_TOKEN": "y"}
    assert take_token(ServeConfig(), {}) is None


@pytest.mark.parametrize("var", ["GTI_SERVE_TOKEN", "GTI_SERVE_TOKEN_FILE"])
def test_gti_serve_starts_ray_without_the_token_in_its_environment(serve_run, monkeypatch, tmp_path, var):
    from gti.cli import main

    f = tmp_path / "tok"
    f.write_text("tok\n")
    seen: dict = {}

    def start_ray(address):  # what a local Ray's raylet, and so every worker, would inherit
        seen["env"] = {k: v for k, v in os.environ.items() if k.startswith("GTI_SERVE_TOKEN")}

    monkeypatch.setattr(D, "start_ray", start_ray)
    monkeypatch.setattr(D.serve, "start", lambda **kw: None)
    monkeypatch.setattr(D.serve, "run", lambda app, **kw: seen.setdefault("app", app))
    monkeypatch.setattr(D.serve, "shutdown", lambda: None)
    monkeypatch.delenv("GTI_SERVE_TOKEN", raising=False)
    monkeypatch.delenv("GTI_SERVE_TOKEN_FILE", raising=False)
    monkeypatch.setenv(var, "tok" if var == "GTI_SERVE_TOKEN" else str(f))
    assert main(["serve", "--run-dir", str(serve_run["run"])]) == 0
    assert seen["env"] == {}
    replica_args = seen["app"]._bound_deployment.init_args[0]._bound_deployment.init_args
    assert replica_args[3] == hashlib.sha256(b"tok").hexdigest()
    assert "tok" not in [a for a in replica_args if isinstance(a, str)]


def test_the_serve_yaml_builder_takes_the_token_out_too(serve_run, monkeypatch):
    monkeypatch.setenv("GTI_SERVE_TOKEN", "tok")
    app = D.app_builder({"run_dir": str(serve_run["run"])})
    assert "GTI_SERVE_TOKEN" not in os.environ
    assert app._bound_deployment.init_args[0]._bound_deployment.init_args[3] == hashlib.sha256(b"tok").hexdigest()
