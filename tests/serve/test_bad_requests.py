"""Every malformed request to gti/serve/app.py gets a 4xx with one line naming the problem, never
a 500 or a traceback (issue 51 item 2), through FastAPI's TestClient (HTTP in-process, no Ray)
and `call_asgi` (what a replica runs for a request the ingress forwards): JSON the parser cannot
hold (an integer past Python's 4,300-digit limit, nesting past the recursion limit, NaN), an
unpaired surrogate, a wrong Content-Type or charset, a body that is not UTF-8, a bad
Content-Length, and bad query parameters on every GET route (`limit=²`: isdigit passes, int
raises). Also `/info`: no filesystem path without the token."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from gti.config.serve import ServeConfig
from gti.serve.app import call_asgi, create_app, token_digest, without_paths
from gti.serve.reload import ServiceHolder

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def holder(serve_run, services):
    h = ServiceHolder(lambda v: services[v], serve_run["run"])
    h.load_initial(1)
    return h


@pytest.fixture
def client(holder):
    app = create_app(holder, ServeConfig(max_body_bytes=65536, max_k=15), token_digest(TOKEN))
    return TestClient(app, raise_server_exceptions=False)


def _one_line_4xx(r, status, message):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["status"] == status and message in body["error"], body
    assert "\n" not in body["error"] and len(body["error"]) < 300 and "Traceback" not in r.text


DEEP = 5000  # past the recursion limit (1000): the parser raises RecursionError
BODIES = [
    ("an integer of 5,000 digits", b'{"history": ["it1"], "k": ' + b"9" * 5000 + b"}", 400,
     "malformed JSON: Exceeds the limit (4300 digits)"),
    ("nesting past the recursion limit", b'{"history": ' + b"[" * DEEP + b"]" * DEEP + b"}", 400,
     "nested deeper than the parser allows"),
    ("nesting the parser holds, in a field", b'{"history": ["it1"], "x": ' + b"[" * 500 + b"]" * 500 + b"}", 422,
     "x: Extra inputs are not permitted"),
    ("nesting the parser holds, in the history", b'{"history": ' + b"[" * 500 + b"]" * 500 + b"}", 422,
     "history.0: Input should be a valid string"),
    ("NaN", b'{"history": ["it1"], "k": NaN}', 400, "NaN is not JSON"),
    ("Infinity", b'{"history": ["it1"], "k": -Infinity}', 400, "-Infinity is not JSON"),
    ("not UTF-8", b'{"history": ["it\xff1"]}', 400, "the body is not UTF-8 (byte 0xff at offset 16)"),
    ("UTF-16", json.dumps({"history": ["it1"]}).encode("utf-16"), 400, "the body is not UTF-8"),
    ("an unpaired surrogate", b'{"history": ["it1", "\\ud800"]}', 400,
     "body.history[1]: a string holds an unpaired surrogate ('\\ud800')"),
    ("an unpaired surrogate in a key", b'{"history": ["it1"], "\\udc00x": 1}', 400, "unpaired surrogate"),
    ("a huge negative k", b'{"history": ["it1"], "k": -' + b"9" * 4000 + b"}", 422,
     "k must be an integer >= 1, got -9999"),
    ("a huge k", b'{"history": ["it1"], "k": ' + b"9" * 4000 + b"}", 422, "exceeds the limit of 15"),
    ("a 60 kB unknown key", b'{"history": ["it1"], "' + b"z" * 60000 + b'": 1}', 422, "Extra inputs are not permitted"),
]


@pytest.mark.parametrize("name, body, status, message", BODIES, ids=[b[0] for b in BODIES])
def test_bodies_the_parser_cannot_hold_are_4xx(client, name, body, status, message):
    _one_line_4xx(client.post("/recommend", content=body, headers=JSON), status, message)


def test_the_same_on_batch_and_reload(client):
    big = b'{"histories": [["it1"]], "k": ' + b"1" * 5000 + b"}"
    _one_line_4xx(client.post("/recommend/batch", content=big, headers=JSON), 400, "4300 digits")
    deep = b'{"version": ' + b"[" * DEEP + b"]" * DEEP + b"}"
    _one_line_4xx(client.post("/admin/reload", content=deep, headers={**JSON, **AUTH}), 400, "nested deeper")
    _one_line_4xx(client.post("/admin/reload", json={"version": -1}, headers=AUTH), 422,
                  "version: Input should be greater than or equal to 0")


TYPES = [
    ("text/plain", 415, "Content-Type must be application/json, got 'text/plain'"),
    ("application/x-www-form-urlencoded", 415, "-H 'Content-Type: application/json'"),  # curl -d's default
    ("multipart/form-data; boundary=x", 415, "Content-Type must be application/json"),
    ("application/json; charset=latin-1", 415, "the body must be UTF-8, Content-Type says charset='latin-1'"),
]


@pytest.mark.parametrize("ctype, status, message", TYPES, ids=[t[0] for t in TYPES])
def test_a_wrong_content_type_is_415(client, ctype, status, message):
    body = json.dumps({"history": ["it1"], "k": 2}).encode()
    _one_line_4xx(client.post("/recommend", content=body, headers={"Content-Type": ctype}), status, message)
    _one_line_4xx(client.post("/recommend/batch", content=b'{"histories": [["it1"]]}', headers={"Content-Type": ctype}),
                  status, message)


@pytest.mark.parametrize("ctype", [None, "application/json", "Application/JSON; charset=UTF-8",
                                   "application/vnd.api+json", 'application/json; charset="utf-8"'])
def test_json_content_types_and_none_are_taken(client, ctype):
    body = json.dumps({"history": ["it1"], "k": 2}).encode()
    r = client.post("/recommend", content=body, headers={"Content-Type": ctype} if ctype else {})
    assert r.status_code == 200, r.text
    assert len(r.json()["items"]) == 2


def test_an_empty_reload_body_needs_no_content_type(client):
    r = client.post("/admin/reload", content=b"", headers={"Content-Type": "text/plain", **AUTH})
    assert r.status_code == 202, r.text
    _one_line_4xx(client.post("/admin/reload", content=b"{}", headers={"Content-Type": "text/plain", **AUTH}),
                  415, "Content-Type must be application/json")


GETS = [
    ("/items?limit=%C2%B2", 422, "limit must be an integer from 1 to 50 (serve.max_search_results), got '²'"),
    ("/items?limit=" + "9" * 5000, 422, "limit must be an integer from 1 to 50"),
    ("/items?limit=0", 422, "got '0'"),
    ("/items?limit=-1", 422, "got '-1'"),
    ("/items?limit=1.5", 422, "got '1.5'"),
    ("/items?limit=", 422, "got ''"),
    ("/items?limit=%EF%BC%95", 422, "got '５'"),  # a full-width 5: isdigit, and int() takes it
    ("/items?limit=1&limit=2", 422, "query parameter limit given more than once (GET /items)"),
    ("/items?q=%FF", 400, "GET /items: the query string is not UTF-8"),
    ("/items?x=1", 422, "unknown query parameter(s): x (GET /items takes q and limit)"),
    ("/items?" + "&".join(f"q{i}=1" for i in range(30)), 422, "too many query parameters"),
    ("/items?q=" + "a" * 201, 422, "q is 201 characters long; at most 200"),
    ("/healthz?x=1", 422, "unknown query parameter(s): x (GET /healthz takes no query parameters)"),
    ("/readyz?verbose", 422, "unknown query parameter(s): verbose (GET /readyz takes no query parameters)"),
    ("/info?%FF=1", 400, "GET /info: the query string is not UTF-8"),
    ("/?x=1", 422, "(GET / takes no query parameters)"),
    ("/nope", 404, "no such path: '/nope'"),
]


@pytest.mark.parametrize("url, status, message", GETS, ids=[g[0][:40] for g in GETS])
def test_bad_query_parameters_on_every_get_route(client, url, status, message):
    _one_line_4xx(client.get(url), status, message)


def test_good_queries_still_answer(client):
    assert client.get("/items?q=title%20of%20it1&limit=2").json()["limit"] == 2
    assert client.get("/items?q=%C3%A9").status_code == 200  # UTF-8, percent-encoded
    assert client.get("/items").json()["limit"] == 20
    for path in ("/healthz", "/readyz", "/info", "/"):
        assert client.get(path).status_code == 200, path
    r = client.get("/recommend")
    _one_line_4xx(r, 405, "GET is not allowed on '/recommend'")
    assert r.headers["allow"] == "POST"


def test_a_bad_content_length_through_call_asgi(client):
    """The replica's own path (the ingress forwards the client's headers): `"²".isdigit()` is
    True and `int("²")` raises; the length is not trusted, the body is read and checked."""
    body = json.dumps({"history": ["it1"], "k": 2}).encode()
    for length in ("²".encode(), b"abc", b"-1"):
        status, _, out = asyncio.run(call_asgi(client.app, "POST", "/recommend", b"",
                                               [(b"content-length", length), (b"content-type", b"application/json")],
                                               body))
        assert status == 200, (length, out)
    status, _, out = asyncio.run(call_asgi(client.app, "POST", "/recommend", b"",
                                           [(b"content-length", b"9" * 5000), (b"content-type", b"application/json")],
                                           body))
    assert status == 413 and b"over 65536 bytes" in out
    status, _, out = asyncio.run(call_asgi(client.app, "GET", "/items", "limit=²".encode(), [], b""))
    assert status == 422 and b"limit must be an integer" in out


# --------------------------------------------------------------------------- /info and paths
def _strings(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def test_info_shows_no_path_without_the_token(client, holder, serve_run):
    run_dir = str(serve_run["run"])
    holder._set(state="refused", message=f"{run_dir}/refresh/v2/sid/sid_map.parquet: not a descendant "
                                         "(see /home/someone/.cache/x)")
    anon = client.get("/info")
    assert anon.status_code == 200
    strings = list(_strings(anon.json()))
    assert not any(run_dir in s or "/home/" in s for s in strings), strings
    assert "run_dir" not in anon.json() and "model_dir" not in anon.json()
    assert anon.json()["reload"]["message"] == "<run_dir>/refresh/v2/sid/sid_map.parquet: not a descendant (see <path>)"
    assert anon.json()["map_hash"] == serve_run["v1_hash"] and anon.json()["catalog_size"] == 22
    owner = client.get("/info", headers=AUTH).json()
    assert owner["run_dir"] == run_dir and owner["model_dir"].startswith(run_dir)
    assert run_dir in owner["reload"]["message"]
    wrong = client.get("/info", headers={"Authorization": "Bearer nope"}).json()  # token_required is off
    assert "run_dir" not in wrong


def test_without_paths_keeps_what_is_not_a_path():
    out = without_paths({"model": "refresh/v1", "msg": "map abc/def at 1/2 s; /srv/x and ~/y, ./z", "n": 3,
                         "nested": [{"data_path": "/a"}, "/b"]}, {"<run_dir>": "/srv/run"})
    assert out == {"model": "refresh/v1", "msg": "map abc/def at 1/2 s; <path> and <path>, <path>", "n": 3,
                   "nested": [{}, "<path>"]}
