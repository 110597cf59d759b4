"""The Ray Serve shell of `gti serve`: replicas holding the loaded run, requests batched.

What it is for: `GtiRecommender`, a Serve deployment whose replicas each load the run once
(`gti.serve.reload.ServiceHolder` over `gti.serve.service.RecommenderService`) and serve the
FastAPI app of `gti.serve.app` (`@serve.ingress()` with `__serve_build_asgi_app__`: the same
app the tests drive, built per replica around its holder). Concurrent requests of a replica
are gathered by `@serve.batch` (`serve.max_batch_size`, `serve.batch_wait_timeout_s`) into one
`answer_batches` call: one constrained beam search for all of them, all answered by the same
loaded version. `deployment_options(cfg)` maps the `serve:` section to Serve's options
(replicas or autoscaling bounds, CPUs = torch threads, GPUs per replica).

`cli_main` is `gti serve --run-dir R [--version k] [--host 127.0.0.1] [--port 8000]
[--replicas N] [--config FILE] [serve.key=value ...]`: the serve settings come from the
defaults, the `serve:` section of `--config` and the overrides (never from the run folder,
nor `trust_remote_code`: `--trust-remote-code` says it); it starts a local Ray bound to
127.0.0.1 without the dashboard (or joins `--ray-address`) and runs the application until
interrupted. The bearer token is read here (`gti.serve.app.read_token`) and the replicas get
only its sha256.

What it does NOT know: how requests are checked or decoded (gti.serve.app, gti.serve.service).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from ray import serve

from gti.config_serve import ServeConfig

APP_NAME = "gti"


def deployment_options(cfg: ServeConfig) -> dict[str, Any]:
    """Serve `.options()` for the `serve:` section: a fixed replica count or autoscaling
    bounds, and each replica's CPUs (its torch threads) and GPUs."""
    actor: dict[str, Any] = {"num_cpus": cfg.threads}
    if cfg.num_gpus:
        actor["num_gpus"] = cfg.num_gpus
    opts: dict[str, Any] = {"ray_actor_options": actor, "max_ongoing_requests": max(2 * cfg.max_batch_size, 4)}
    if cfg.autoscaling:
        opts["autoscaling_config"] = {"min_replicas": cfg.min_replicas, "max_replicas": cfg.max_replicas,
                                      "target_ongoing_requests": cfg.target_ongoing_requests}
    else:
        opts["num_replicas"] = cfg.replicas
    return opts


@serve.deployment(name="gti-recommender")
@serve.ingress()
class GtiRecommender:
    """One replica: the loaded run, its reloads and the batched decode."""

    def __init__(self, run_dir: str, version: int | None, serve_cfg: dict, token_sha256: str | None,
                 trust_remote_code: bool = False) -> None:
        import torch

        from gti.serve.reload import ServiceHolder
        from gti.serve.service import RecommenderService

        self.cfg = cfg = ServeConfig.model_validate(serve_cfg)
        self.token_sha256 = token_sha256
        torch.set_num_threads(cfg.threads)
        device = None if cfg.device == "auto" else cfg.device

        def load(v: int | None) -> RecommenderService:
            return RecommenderService.load(run_dir, v, device=device, trust_remote_code=trust_remote_code,
                                           unknown_items=cfg.unknown_items, max_k=cfg.max_k)

        self.holder = ServiceHolder(load, run_dir)
        self.holder.load_initial(version)
        self._batched.set_max_batch_size(cfg.max_batch_size)
        self._batched.set_batch_wait_timeout_s(cfg.batch_wait_timeout_s)

    def __serve_build_asgi_app__(self):
        from gti.serve.app import create_app

        return create_app(self.holder, self.cfg, self.token_sha256, decode=self._batched)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def _batched(self, requests: list[list[Any]]) -> list[list[Any]]:
        """Each request is a list of queries; all of them go into one decode."""
        from gti.serve.service import RequestError, answer_batches

        svc = self.holder.current  # once per batch: one version answers all of it
        if svc is None:
            err = RequestError(503, "the model is still loading; retry shortly")
            return [[err] * len(r) for r in requests]
        return await asyncio.to_thread(answer_batches, svc, requests)


def build_app(run_dir: str | Path, version: int | None, cfg: ServeConfig, token_sha256: str | None,
              trust_remote_code: bool = False):
    """The bound Serve application (what `serve.run` and a Serve config's import path take)."""
    return GtiRecommender.options(**deployment_options(cfg)).bind(
        str(Path(run_dir).expanduser().resolve()), version, cfg.model_dump(mode="json"), token_sha256,
        trust_remote_code)


def serve_config(args) -> ServeConfig:
    """The `serve:` section from defaults, `--config`, `serve.*` overrides, then the flags."""
    from gti import config as C
    from gti.errors import ConfigError

    overrides = list(getattr(args, "overrides", None) or [])
    bad = [o for o in overrides if not o.startswith("serve.")]
    if bad:
        raise ConfigError(f"gti serve takes only serve.* overrides, got: {' '.join(bad)}")
    cfg = C.load(getattr(args, "config", None), overrides).serve
    flags = {key: getattr(args, key, None) for key in ("host", "port", "replicas")}
    flags = {key: val for key, val in flags.items() if val is not None}
    return ServeConfig.model_validate({**cfg.model_dump(), **flags}) if flags else cfg


LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray takes the loopback address as the node's


def start_ray(address: str | None) -> None:
    """Join `address`, or start a local Ray on the loopback address only, without the
    dashboard: Ray's own single-machine mode (the one it uses on macOS and Windows), set for
    this process (`ray_constants.ENABLE_RAY_CLUSTER`) and the processes Ray starts (env)."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, ignore_reinit_error=True)
        return
    from ray._private import ray_constants

    os.environ[LOOPBACK_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(include_dashboard=False, ignore_reinit_error=True)


def cli_main(args) -> int:
    """`gti serve` (see the module docstring): blocks until interrupted."""
    from gti.run_artifacts import RunDirError, chosen_version
    from gti.serve.app import read_token, token_digest

    cfg = serve_config(args)
    run_dir = Path(args.run_dir).expanduser().resolve()
    if not run_dir.is_dir():
        raise RunDirError(f"run directory not found: {run_dir}")
    chosen_version(run_dir, args.version)  # a missing version fails here, in one line
    digest = token_digest(read_token(cfg))
    start_ray(getattr(args, "ray_address", None))
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    app = build_app(run_dir, args.version, cfg, digest, bool(getattr(args, "trust_remote_code", False)))
    print(f"gti serve: {run_dir} on http://{cfg.host}:{cfg.port}/ (POST /recommend, GET /info); Ctrl-C stops",
          file=sys.stderr, flush=True)
    try:
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=True)
    finally:
        serve.shutdown()
    return 0
