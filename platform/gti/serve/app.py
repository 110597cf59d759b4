"""The HTTP face of `gti serve`: a FastAPI app over a `ServiceHolder`.

What it is for: `create_app(holder, cfg, token_sha256, decode=None, stats=None)` returns the app
that each Ray Serve replica runs (`gti.serve.deployment`, through `call_asgi`, which runs one
request through the app in this process) and that the tests drive with FastAPI's TestClient.
Its routes and error statuses are listed above `create_app` and in docs/serving.md; bad requests
get one JSON line, never a traceback; reading and checking a body or query string is
`gti.serve.requests`.

What it does NOT know: Ray, model loading (gti.serve.service), or where the token comes from
(`read_token`: an environment variable or a file, never the config).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, MutableMapping

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException

from gti.config.serve import ServeConfig
from gti.common.errors import ConfigError
from gti.serve.reload import ReloadBusy, ServiceHolder
from gti.serve.requests import BatchBody, RecommendBody, ReloadBody, int_param, parse, read_json, read_query, short
from gti.serve.service import Query, RequestError

log = logging.getLogger("gti.serve")
Decode = Callable[[list[Query]], Awaitable[list[Any]]]


def read_token(cfg: ServeConfig, env: Mapping[str, str] | None = None) -> str | None:
    """The bearer token: $<token_env>, else the file named by $<token_env>_FILE, else None.
    ConfigError when `token_required` is set and there is none, or the file cannot be read."""
    env = os.environ if env is None else env
    token = (env.get(cfg.token_env) or "").strip()
    path = env.get(f"{cfg.token_env}_FILE")
    if not token and path:
        try:
            token = Path(path).expanduser().read_text().strip()
        except OSError as err:
            raise ConfigError(f"${cfg.token_env}_FILE={path}: {err.strerror or err}") from None
    if not token and cfg.token_required:
        raise ConfigError(f"serve.token_required is true but no token is set: put it in ${cfg.token_env} "
                          f"or in a file named by ${cfg.token_env}_FILE")
    return token or None


def take_token(cfg: ServeConfig, env: MutableMapping[str, str] | None = None) -> str | None:
    """`read_token`, then $<token_env> and $<token_env>_FILE removed from `env` (os.environ).
    Every process started after this one inherits its environment: the local Ray `gti serve`
    starts, its workers, Serve's replicas; they are to hold only the token's digest."""
    env = os.environ if env is None else env
    token = read_token(cfg, env)
    for name in (cfg.token_env, f"{cfg.token_env}_FILE"):
        env.pop(name, None)
    return token


def token_digest(token: str | None) -> str | None:
    """sha256 hex of the token (what the app and the replicas hold; None: no token)."""
    return hashlib.sha256(token.encode()).hexdigest() if token else None



class _AsciiJSON(JSONResponse):
    """An error's JSON, escaped to ASCII: it renders whatever text the message quotes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def holds_token(request: Request, token_sha256: str | None) -> bool:
    """Whether the request carries the bearer token (never, when none is set)."""
    if token_sha256 is None:
        return False
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    given = token_digest(value.strip()) or ""
    return scheme.lower() == "bearer" and hmac.compare_digest(given, token_sha256)


_PATH = re.compile(r"(?<![\w.~<>/-])(?:~|\.{1,2})?/[^\s'\"`,;()\[\]{}]+")


def without_paths(value: Any, known: Mapping[str, str]) -> Any:
    """`value` (a JSON-like structure) with no filesystem path left for a caller without the
    token: `known` paths become their names ({"<run_dir>": "/abs/run"}: "<run_dir>/sid"), any
    other absolute path "<path>"; keys ending in _dir or _path are dropped. A path says where
    the service runs, under whose home, and what the disk holds: not for anonymous readers."""
    if isinstance(value, dict):
        return {k: without_paths(v, known) for k, v in value.items()
                if not (isinstance(k, str) and k.endswith(("_dir", "_path")))}
    if isinstance(value, list):
        return [without_paths(v, known) for v in value]
    if isinstance(value, str):
        for name, path in sorted(known.items(), key=lambda kv: -len(kv[1])):  # the longest first
            if path and path != "/":
                value = value.replace(path, name)
        return _PATH.sub("<path>", value)
    return value


def _error(err: RequestError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return _AsciiJSON(err.body(), status_code=err.status, headers=headers)


def _local_decode(holder: ServiceHolder) -> Decode:
    """Decode in this process, one request at a time (no Ray): the service taken once."""
    lock = threading.Lock()

    def run(queries: list[Query]) -> list[Any]:
        with lock:
            return _service(holder).answer(queries)

    async def decode(queries: list[Query]) -> list[Any]:
        return await asyncio.to_thread(run, queries)

    return decode


def _service(holder: ServiceHolder) -> Any:
    svc = holder.current
    if svc is None:
        raise RequestError(503, "the model is still loading; retry shortly")
    return svc


# Routes (docs/serving.md):
# - GET / -> the page of `gti.serve.page` (static; it sends the token the user types);
# - GET /items?q=text&limit=20 -> {"items": [{item_id, title, sid}], "q", "limit", version...}:
#   catalog items whose title or id contains the text (limit 1..`serve.max_search_results`);
# - POST /recommend {"history": [ids, oldest first], "k": 10, "exclude_history": true} -> one
#   answer of `gti.serve.service` (items best first; the version, model and map hash that answered);
# - POST /recommend/batch {"histories": [[ids], ...], "k", "exclude_history"} -> {"results":
#   [answer, ...]} (one decode, one version for all of them);
# - GET /healthz (process up), /readyz (a run is loaded; 503 before), /info (the loaded run, the
#   last reload, "replicas": each replica's version and whether they agree, the limits, `stats()`;
#   the run's folders only to a caller holding the token);
# - POST /admin/reload {"version": k | null, "wait": false} -> 202 (200 with wait) and the reload
#   status (`gti.serve.reload`); 409 while one runs. The version is pinned for every replica.
# Errors, JSON {"error": one line, "status": code}: 400 a body that is not UTF-8, malformed JSON
# (NaN and Infinity included), JSON the parser cannot hold (an integer of more than 4,300 digits,
# nesting deeper than the recursion limit), an unpaired surrogate, not an object, or a query
# string that is not UTF-8; 413 a body over `serve.max_body_bytes`; 415 a Content-Type other than
# application/json (or a charset other than UTF-8; none is taken as JSON); 422 a wrong field, an
# empty history, unknown ids (with `serve.unknown_items: error`), k < 1 or over `serve.max_k` or
# the catalog, too many histories, and on every GET route a query parameter it does not take, one
# given twice, or a bad value; 404 / 405 an unknown path or method; 401 a missing or wrong bearer
# token (needed by /admin/* always, by every endpoint with `serve.token_required`), 403 /admin/*
# when no token is set; 503 while no run is loaded.
def create_app(holder: ServiceHolder, cfg: ServeConfig, token_sha256: str | None,
               decode: Decode | None = None, stats: Callable[[], dict] | None = None) -> FastAPI:
    """The app (routes and errors: the comment above); `token_sha256` =
    `token_digest(read_token(cfg))`: the app holds only the token's hash. `decode(queries) ->
    awaitable list of answers | RequestError` is how a replica decodes (Ray Serve: a
    `gti.serve.gather.Gatherer` gathering concurrent requests); None = in this process, one
    request at a time."""
    app = FastAPI(title="gti serve", docs_url=None, redoc_url=None, openapi_url=None)
    decode = decode or _local_decode(holder)

    def auth(request: Request, admin: bool = False) -> None:
        if not (admin or cfg.token_required):
            return
        if token_sha256 is None:
            raise RequestError(403, f"{request.url.path} needs a bearer token and none is set: put it in "
                                    f"${cfg.token_env} (or a file named by ${cfg.token_env}_FILE) and restart")
        if not holds_token(request, token_sha256):
            raise RequestError(401, "missing or wrong bearer token (Authorization: Bearer <token>)")

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, err: RequestError) -> JSONResponse:
        return _error(err)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, err: HTTPException) -> JSONResponse:
        # the router's own 404/405: the same one-line JSON as every other error, not {"detail"}
        what = {404: f"no such path: {short(request.url.path, 80)}",
                405: f"{request.method} is not allowed on {short(request.url.path, 80)}"}
        resp = _error(RequestError(err.status_code, what.get(err.status_code, str(err.detail))))
        for key, value in (err.headers or {}).items():  # 405's Allow
            resp.headers[key] = value
        return resp

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, err: Exception) -> JSONResponse:  # pragma: no cover - a bug, logged
        log.error("gti serve: %s: %s", type(err).__name__, err)
        return JSONResponse({"error": "internal error", "status": 500}, status_code=500)

    _add_query_routes(app, holder, cfg, auth, decode)
    _add_status_routes(app, holder, cfg, auth, stats, lambda request: holds_token(request, token_sha256))
    _add_page_routes(app, holder, cfg, auth)
    return app


def _add_page_routes(app: FastAPI, holder: ServiceHolder, cfg: ServeConfig, auth) -> None:
    """GET / (the page: no auth, it holds no data) and GET /items (catalog search)."""
    from gti.serve.page import PAGE

    @app.get("/")
    async def page(request: Request) -> HTMLResponse:
        read_query(request)
        return HTMLResponse(PAGE)

    @app.get("/items")
    async def items(request: Request) -> JSONResponse:
        auth(request)
        query = read_query(request, ("q", "limit"))
        q = query.get("q", "")
        if len(q) > 200:
            raise RequestError(422, f"q is {len(q)} characters long; at most 200")
        limit = int_param(query, "limit", 20, 1, cfg.max_search_results, " (serve.max_search_results)")
        svc = _service(holder)  # once: the hits and the version named come from the same run
        hits = await asyncio.to_thread(svc.search, q, limit)
        return JSONResponse({"items": hits, "q": q, "limit": limit, **svc.identity})


async def call_asgi(app: Any, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                    body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """One HTTP request through the ASGI `app` in this process -> (status, headers, body)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    done, sent = asyncio.Event(), False
    out: dict[str, Any] = {"status": 500, "headers": [], "body": bytearray()}

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()  # the client stays connected until the response is complete
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            out["status"], out["headers"] = message["status"], list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")
            if not message.get("more_body", False):
                done.set()

    try:
        await app(scope, receive, send)
    finally:
        done.set()
    return out["status"], out["headers"], bytes(out["body"])


def _add_query_routes(app: FastAPI, holder: ServiceHolder, cfg: ServeConfig, auth, decode: Decode) -> None:
    """POST /recommend and POST /recommend/batch."""

    def excl(flag: bool | None) -> bool:
        return cfg.exclude_history if flag is None else flag

    def check_k(k: int) -> None:
        if k < 1:
            raise RequestError(422, f"k must be an integer >= 1, got {short(k)}")
        if k > cfg.max_k:
            raise RequestError(422, f"k={short(k)} exceeds the limit of {cfg.max_k} (serve.max_k)")

    @app.post("/recommend")
    async def recommend(request: Request) -> JSONResponse:
        auth(request)
        body = parse(RecommendBody, await read_json(request, cfg.max_body_bytes))
        check_k(body.k)
        _service(holder)
        res = (await decode([Query(tuple(body.history), body.k, excl(body.exclude_history), cfg.unknown_items)]))[0]
        if isinstance(res, RequestError):
            raise res
        return JSONResponse(res)

    @app.post("/recommend/batch")
    async def recommend_batch(request: Request) -> JSONResponse:
        auth(request)
        body = parse(BatchBody, await read_json(request, cfg.max_body_bytes))
        check_k(body.k)
        if not body.histories:
            raise RequestError(422, "histories is empty: give at least one history")
        if len(body.histories) > cfg.max_batch_histories:
            raise RequestError(422, f"{len(body.histories)} histories exceed the limit of "
                                    f"{cfg.max_batch_histories} per request (serve.max_batch_histories)")
        _service(holder)
        queries = [Query(tuple(h), body.k, excl(body.exclude_history), cfg.unknown_items) for h in body.histories]
        results = await decode(queries)
        for i, res in enumerate(results):
            if isinstance(res, RequestError):
                raise RequestError(res.status, f"histories[{i}]: {res.message}", index=i, **res.extra)
        ident = {key: results[0][key] for key in ("version", "model", "map_hash")}
        return JSONResponse({"results": results, **ident})


def _add_status_routes(app: FastAPI, holder: ServiceHolder, cfg: ServeConfig, auth,
                       stats: Callable[[], dict] | None, trusted: Callable[[Request], bool]) -> None:
    """GET /healthz, /readyz, /info and POST /admin/reload."""

    @app.get("/healthz")
    async def healthz(request: Request) -> dict:
        auth(request)
        read_query(request)
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        auth(request)
        read_query(request)
        svc = _service(holder)
        return JSONResponse({"status": "ready", **svc.identity})

    @app.get("/info")
    async def info(request: Request) -> JSONResponse:
        auth(request)
        read_query(request)
        svc = _service(holder)
        limits = {key: getattr(cfg, key) for key in ("max_k", "max_body_bytes", "max_batch_histories",
                                                     "unknown_items", "exclude_history", "max_batch_size",
                                                     "batch_wait_timeout_s", "token_required",
                                                     "reload_poll_s", "max_search_results")}
        extra = {"replica": stats()} if stats is not None else {}
        # "replicas": the version every replica of the app reported last (the shared board)
        body = {**svc.info(), "reload": holder.status(), "replicas": holder.replicas(), "serve": limits, **extra}
        if not trusted(request):  # the folders only to a caller holding the token
            run = svc.run
            body = without_paths(body, {"<run_dir>": str(getattr(run, "run_dir", "") or holder.run_dir),
                                        "<model_dir>": str(getattr(run, "model_dir", "") or "")})
        return JSONResponse(body)

    @app.post("/admin/reload")
    async def reload(request: Request) -> JSONResponse:
        auth(request, admin=True)
        body = parse(ReloadBody, await read_json(request, cfg.max_body_bytes, required=False))
        try:
            if body.wait:
                status = await asyncio.to_thread(holder.reload, body.version, True)
            else:
                status = holder.reload(body.version)
        except ReloadBusy as err:
            raise RequestError(409, str(err)) from None
        return JSONResponse(status, status_code=200 if body.wait else 202)
