"""The Ray Serve shell of `gti serve`: replicas holding the loaded run, requests batched.

What it is for: `GtiRecommender`, a Serve deployment whose replicas each load the run once and
run the FastAPI app of `gti.serve.app` (the same app the tests drive); `GtiIngress` in front
forwards each HTTP request to a replica; `GtiVersions` (one replica, no CPU) holds the app's
`gti.serve.reload.VersionBoard`, so all replicas converge on one version. `deployment_options`
maps the `serve:` section to Serve's options, `app_builder(args)` is the import path of a Serve
config (jobs/serve.yaml), and `cli_main` is `gti serve` (docs/serving.md). The bearer token is
removed from the environment before Ray starts: the replicas get only its sha256.

What it does NOT know: how requests are checked or decoded (gti.serve.app, gti.serve.service).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

from ray import serve

from gti.config.serve import ServeConfig
from gti.common.errors import GtiError
from gti.serve.gather import Gatherer

APP_NAME = "gti"
log = logging.getLogger("gti.serve")


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


RETRY_MESSAGE = "the replica answering this request went away (Serve restarts it); retry the request"


@serve.deployment(name="gti-recommender")
class GtiRecommender:
    """One replica: the loaded run, its reloads (POST /admin/reload, and a poll of the run
    folder for versions `gti refresh` publishes every `serve.reload_poll_s`), the app (built per
    replica around its `gti.serve.reload.ServiceHolder`), and the batched decode.

    Every replica reports to the `GtiVersions` board and reads the pin back at each poll
    (`BoardClient`), so all replicas converge on one version within `serve.reload_poll_s` plus
    one load, and a replica Serve restarts loads the agreed version, not the start one.
    Concurrent requests are gathered by `gti.serve.gather.Gatherer` (`serve.max_batch_size`,
    `serve.batch_wait_timeout_s`) into one `answer_batches` call, all answered by the same loaded
    version, in as few constrained beam searches as `serve.decode_budget_tokens` allows
    (`replica_decode_budget`: the setting, or a share of the replica's memory over the model's
    cache bytes per token)."""

    def __init__(self, run_dir: str, version: int | None, serve_cfg: dict, token_sha256: str | None,
                 trust_remote_code: bool = False, board: Any = None) -> None:
        import torch

        from gti.serve.app import create_app
        from gti.serve.reload import ServiceHolder
        from gti.serve.service import RecommenderService, replica_decode_budget

        self.cfg = cfg = ServeConfig.model_validate(serve_cfg)
        torch.set_num_threads(cfg.threads)
        device = None if cfg.device == "auto" else cfg.device

        def load(v: int | None) -> RecommenderService:
            svc = RecommenderService.load(run_dir, v, device=device, trust_remote_code=trust_remote_code,
                                          unknown_items=cfg.unknown_items, max_k=cfg.max_k)
            svc.decode_budget = replica_decode_budget(svc.run, cfg)
            if svc.worst_case() > svc.decode_budget:  # said once per load, not per refused request
                log.warning("gti serve: the largest request history needs %s decode tokens, over the budget of "
                            "%s (serve.decode_budget_tokens): such requests are refused with 413",
                            f"{svc.worst_case():,}", f"{svc.decode_budget:,}")
            return svc

        replica = serve.get_replica_context().replica_id.to_full_id_str()
        self.holder = ServiceHolder(load, run_dir, board=BoardClient(board) if board is not None else None,
                                    replica=replica)
        svc = self.holder.load_initial(version)  # raises if the run cannot be loaded
        self.holder.watch(cfg.reload_poll_s)
        on = next(svc.run.model.parameters()).device.type
        # /info reports the wait in force, not `None`
        self.cfg = cfg = cfg.model_copy(update={"batch_wait_timeout_s": cfg.batch_wait_for(on)})
        # a batch is measured in histories (a request's queries): 16 requests of 64 histories
        # are not gathered into 1,024, and each batch runs within the decode budget
        self._gather = Gatherer(self._decode_batch, cfg.max_batch_size, cfg.batch_wait_timeout_s, size=len)
        # the replica's actor name (namespace "serve"): which replica answered /info
        self._stats = {"id": replica,
                       "decodes": 0, "requests": 0, "largest_batch": 0, "largest_batch_histories": 0,
                       "decode_s": 0.0}
        self.app = create_app(self.holder, cfg, token_sha256, decode=self._batched, stats=self.stats)

    def stats(self) -> dict[str, Any]:
        """This replica's batching so far (GET /info "replica"): batches ("decodes", each one or
        more searches) < requests = gathered; the loaded version's searches, their peak tokens
        and how many histories each held ("sizes"); the replica's resident memory ("rss_mb")."""
        svc = self.holder.current
        searches = dict(svc.decodes, sizes=dict(svc.decodes["sizes"]), budget_tokens=svc.decode_budget) \
            if svc is not None else {}
        return {**self._stats, "searches": searches, "rss_mb": rss_mb()}

    async def forward(self, method: str, path: str, query: bytes, headers: list, body: bytes) -> tuple:
        """One HTTP request the ingress forwards, answered by this replica's app."""
        from gti.serve.app import call_asgi

        return await call_asgi(self.app, method, path, query, headers, body)

    async def _batched(self, queries: list[Any]) -> list[Any]:
        """One request's queries, answered in the decode of the batch it is gathered into."""
        return await self._gather(queries)

    def _decode_batch(self, requests: list[list[Any]]) -> list[list[Any]]:
        """Each request is a list of queries; all of them go into one decode (a worker thread)."""
        from gti.serve.service import RequestError, answer_batches

        svc = self.holder.current  # once per batch: one version answers all of it
        if svc is None:
            err = RequestError(503, "the model is still loading; retry shortly")
            return [[err] * len(r) for r in requests]
        st = self._stats
        st["decodes"], st["requests"] = st["decodes"] + 1, st["requests"] + len(requests)
        st["largest_batch"] = max(st["largest_batch"], len(requests))
        st["largest_batch_histories"] = max(st["largest_batch_histories"], sum(len(r) for r in requests))
        t0 = time.perf_counter()
        try:
            return answer_batches(svc, requests)
        finally:  # busy share = decode_s over the wall time: what the gaps between batches cost
            st["decode_s"] = round(st["decode_s"] + time.perf_counter() - t0, 3)

    def __del__(self) -> None:
        holder = getattr(self, "holder", None)
        if holder is not None:
            holder.close()


def rss_mb() -> float | None:
    """This process's resident memory now, in MiB (Linux /proc; None elsewhere): GET /info
    "replica" reports it so that a soak can see a replica's memory over hours."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


class BoardClient:
    """The `GtiVersions` handle as the board `ServiceHolder` calls (`pin`, `sync`): blocking,
    each call in a helper thread (the replica's constructor runs in its event loop, where a
    handle's `.result()` is refused) and bounded by `timeout_s` (the holder keeps its last pin)."""

    def __init__(self, handle: Any, timeout_s: float = 30.0) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.handle, self.timeout_s = handle, timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gti-board")

    def _call(self, method: str, *args: Any) -> Any:
        def call() -> Any:
            return getattr(self.handle, method).remote(*args).result(timeout_s=self.timeout_s)
        return self._pool.submit(call).result(timeout=self.timeout_s + 5)

    def pin(self, version: int | None, published: int | None) -> dict[str, Any]:
        return self._call("pin", version, published)

    def sync(self, replica: str, report: dict[str, Any] | None) -> dict[str, Any]:
        return self._call("sync", replica, report)


@serve.deployment(name="gti-versions", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
class GtiVersions:
    """The app's version board (`gti.serve.reload.VersionBoard`): one replica, no CPU. If Serve
    restarts it, it starts again from the app's start pin: a pin set by POST /admin/reload since
    is lost, and the replicas follow the start pin again, together (they still agree)."""

    def __init__(self, version: int | None, published: int | None, forget_s: float) -> None:
        from gti.serve.reload import VersionBoard

        self.board = VersionBoard(version, published, forget_s)

    def pin(self, version: int | None, published: int | None) -> dict[str, Any]:
        return self.board.pin(version, published)

    def sync(self, replica: str, report: dict[str, Any] | None) -> dict[str, Any]:
        return self.board.sync(replica, report)


@serve.deployment(name="gti-ingress")
class GtiIngress:
    """The HTTP entry: forwards each request to a `GtiRecommender` replica. It exists so that a
    replica dying mid-request answers 503 with Retry-After (Serve's proxy answers 500 then)."""

    def __init__(self, model: Any, max_body_bytes: int) -> None:
        self.model, self.max_body_bytes = model, int(max_body_bytes)

    async def __call__(self, request: Any) -> Any:
        from ray.exceptions import RayActorError, RayTaskError
        from starlette.responses import JSONResponse, Response

        body = bytearray()
        async for chunk in request.stream():  # the replica's app answers 413 past the limit
            body += chunk
            if len(body) > self.max_body_bytes:
                break
        scope, body = request.scope, bytes(body[:self.max_body_bytes + 1])
        try:
            status, headers, content = await self.model.forward.remote(
                scope["method"], app_path(scope), scope.get("query_string", b""), list(scope["headers"]), body)
        except RayActorError:
            return JSONResponse({"error": RETRY_MESSAGE, "status": 503}, status_code=503, headers={"Retry-After": "1"})
        except RayTaskError as err:  # a bug in the replica: one line, no traceback to the client
            log.error("gti serve: replica error: %s", str(err).splitlines()[0] if str(err) else type(err).__name__)
            return JSONResponse({"error": "internal error", "status": 500}, status_code=500)
        return Response(content, status_code=status, headers={k.decode("latin-1"): v.decode("latin-1")
                                                              for k, v in headers if k.lower() != b"content-length"})


def app_path(scope: dict[str, Any]) -> str:
    """The request's path relative to where the app is mounted. Ray Serve's proxy keeps the
    full path in scope["path"] and sets scope["root_path"] to its HTTP root path plus the route
    prefix (ray/serve/_private/proxy.py; "" at the prefix "/"), as ASGI asks: the app's routes
    are what follows it. The prefix itself ("/gti") is the app's "/"."""
    path, root = scope["path"], (scope.get("root_path") or "").rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    return path or "/"


def service_url(cfg: ServeConfig) -> str:
    """Where `gti serve` answers: http://host:port/prefix/ (the page; the endpoints below it)."""
    return f"http://{cfg.host}:{cfg.port}{cfg.route_prefix.rstrip('/')}/"


def ingress_options(cfg: ServeConfig) -> dict[str, Any]:
    """The ingress: no CPU of its own, as many replicas as the model (or the same bounds)."""
    opts = deployment_options(cfg)
    opts["ray_actor_options"] = {"num_cpus": 0}
    opts["max_ongoing_requests"] = 4 * opts["max_ongoing_requests"]
    return opts


def build_app(run_dir: str | Path, version: int | None, cfg: ServeConfig, token_sha256: str | None,
              trust_remote_code: bool = False):
    """The bound Serve application (what `serve.run` and a Serve config's import path take):
    the ingress over the model replicas, which share one version board (the start pin:
    `version` as of the newest version published now; None follows the newest)."""
    from gti.run.versions import chosen_version

    run_dir = Path(run_dir).expanduser().resolve()
    newest = chosen_version(run_dir, None, note=lambda line: None)
    # a replica not heard from in 5 polls (at least 30 s) has left: Serve replaced it
    board = GtiVersions.bind(version, newest.k if newest is not None else 0, max(30.0, 5 * cfg.reload_poll_s))
    model = GtiRecommender.options(**deployment_options(cfg)).bind(
        str(run_dir), version, cfg.model_dump(mode="json"), token_sha256, trust_remote_code, board)
    return GtiIngress.options(**ingress_options(cfg)).bind(model, cfg.max_body_bytes)


APP_ARGS = {"run_dir", "version", "config", "overrides", "trust_remote_code"}


def app_builder(args: dict[str, Any]):
    """The import path of a Serve config (jobs/serve.yaml): `args` = {run_dir, version
    (null: the newest), config (a gti config file: its serve: section), overrides (serve.*),
    trust_remote_code}; the token from $GTI_SERVE_TOKEN (or _FILE) where the app is built."""
    from argparse import Namespace

    from gti.common.errors import ConfigError
    from gti.run.versions import RunDirError, chosen_version
    from gti.serve.app import take_token, token_digest

    args = dict(args or {})
    unknown = sorted(set(args) - APP_ARGS)
    if unknown or not args.get("run_dir"):
        raise ConfigError(f"gti serve app args: run_dir is required; known keys {sorted(APP_ARGS)}"
                          + (f", unknown: {unknown}" if unknown else ""))
    version = args.get("version")
    cfg = serve_config(Namespace(config=args.get("config"), overrides=list(args.get("overrides") or [])))
    run_dir = Path(str(args["run_dir"])).expanduser().resolve()
    if not run_dir.is_dir():
        raise RunDirError(f"run directory not found: {run_dir}")
    chosen_version(run_dir, version)  # a missing version fails here, in one line
    # taken out of this process's environment: what it starts later does not inherit it
    return build_app(run_dir, version, cfg, token_digest(take_token(cfg)), bool(args.get("trust_remote_code")))


def serve_config(args) -> ServeConfig:
    """The `serve:` section from defaults, `--config`, `serve.*` overrides, then the flags."""
    from pydantic import ValidationError

    from gti import config as C
    from gti.config.io import format_error
    from gti.common.errors import ConfigError

    overrides = list(getattr(args, "overrides", None) or [])
    bad = [o for o in overrides if not o.startswith("serve.")]
    if bad:
        raise ConfigError(f"gti serve takes only serve.* overrides, got: {' '.join(bad)}")
    cfg = C.load(getattr(args, "config", None), overrides).serve
    flags = {key: getattr(args, key, None) for key in ("host", "port", "route_prefix", "replicas")}
    flags = {key: val for key, val in flags.items() if val is not None}
    try:
        return ServeConfig.model_validate({**cfg.model_dump(), **flags}) if flags else cfg
    except ValidationError as err:  # a bad --port / --route-prefix: one line, not a traceback
        raise ConfigError(format_error(err, "gti serve flags")) from None


def start_ray(address: str | None) -> None:
    """Join `address` (else $RAY_ADDRESS), or start a private local Ray: `gti.ray_start.ensure_ray`,
    as every gti command does (loopback addresses only, and token auth with a fresh token of this
    Ray alone rather than Ray's ~/.ray/auth_token, which every Ray of the user shares and which is
    often readable by others). A joined cluster keeps its own auth."""
    from gti.config import RunConfig
    from gti.ray_start import ensure_ray

    ensure_ray(RunConfig(ray_address=address))


class ServeStartError(GtiError):
    """Serve's HTTP proxy never came up (`start_serve`)."""


# How long `start_serve` waits for Serve's HTTP proxy beyond serve.start's own 60 s: on a loaded
# 2-core machine a new Ray worker process can take minutes to start (seen in CI).
PROXY_WAIT_S = 300.0


def start_serve(host: str, port: int, wait_s: float = PROXY_WAIT_S, echo=None, status=None) -> None:
    """serve.start on host:port, waiting for a slow HTTP proxy instead of failing. serve.start
    gives the proxy 60 s, and Serve's controller kills one not ready within
    RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S (5 s by default; `gti.ray_start` raises it for a local
    Ray) and starts another, which serve.start does not wait for. Either way the controller is
    up and keeps starting proxies: join it and poll `serve.status().proxies` (or `status`, a
    callable returning {node: status}) until one is HEALTHY or `wait_s` runs out (then
    `ServeStartError`, one line)."""
    import time

    import ray

    options = {"host": host, "port": port}
    try:
        serve.start(http_options=options)
        return
    except (TimeoutError, ray.exceptions.RayActorError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        (echo or log.warning)(f"gti serve: Serve's HTTP proxy is slow to start ({first}); "
                              f"waiting up to {wait_s:.0f} s more")
    serve.start(http_options=options)  # joins the controller started above
    status = status or (lambda: serve.status().proxies)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if any(str(getattr(v, "value", v)) == "HEALTHY" for v in status().values()):
            return
        time.sleep(1.0)
    raise ServeStartError(f"Serve's HTTP proxy on {host}:{port} was not healthy within {60 + wait_s:.0f} s; "
                          "Serve's logs are in session_latest/logs/serve under Ray's temp folder")


def cli_main(args) -> int:
    """`gti serve --run-dir R [--version k] [--host 127.0.0.1] [--port 8000] [--route-prefix
    /gti] [--replicas N] [--config FILE] [serve.key=value ...]`: blocks until interrupted.

    The serve settings come from the defaults, the `serve:` section of `--config`, the overrides
    and the flags (never from the run folder, nor `trust_remote_code`: `--trust-remote-code`
    says it). It starts a private local Ray (`start_ray`) or joins `--ray-address`, and runs the
    application mounted at `serve.route_prefix` (`app_path`). The bearer token is read here and
    removed from the environment before Ray starts (`gti.serve.app.take_token`): no Ray worker
    or replica inherits it."""
    from gti.run.versions import RunDirError, chosen_version
    from gti.serve.app import take_token, token_digest

    cfg = serve_config(args)
    run_dir = Path(args.run_dir).expanduser().resolve()
    if not run_dir.is_dir():
        raise RunDirError(f"run directory not found: {run_dir}")
    chosen_version(run_dir, args.version)  # a missing version fails here, in one line
    # Out of the environment before Ray starts: the local Ray's workers (the replicas among
    # them) would inherit it, and the replicas are to hold only its digest.
    digest = token_digest(take_token(cfg))
    start_ray(getattr(args, "ray_address", None))
    start_serve(cfg.host, cfg.port)
    app = build_app(run_dir, args.version, cfg, digest, bool(getattr(args, "trust_remote_code", False)))
    url = service_url(cfg)
    print(f"gti serve: {run_dir} on {url} (POST {url}recommend, GET {url}info); Ctrl-C stops",
          file=sys.stderr, flush=True)
    try:
        serve.run(app, name=APP_NAME, route_prefix=cfg.route_prefix, blocking=True)
    finally:
        serve.shutdown()
    return 0
