"""gti/serve/app.py through FastAPI's TestClient on the tiny run of conftest.py (no Ray):
every endpoint, equality with `gti recommend`'s code path, every bad request's 4xx and
message, the bearer token, and reloads (a swap between requests; a map that does not descend
from the serving model's is refused with one log line while the old version keeps serving; a
rollback to an ancestor version is accepted)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from gti.config.serve import ServeConfig
from gti.common.errors import ConfigError
from gti.run.loaded import LoadedRun
from gti.serve.app import create_app, read_token, token_digest
from gti.serve.reload import ServiceHolder
from gti.serve.service import RecommenderService

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _holder(run_dir, services=None, version=0, logs=None):
    """A holder whose loads reuse the session's loaded services when given (fast)."""

    def load(v):
        if services is not None and v in services:
            return services[v]
        return RecommenderService.load(run_dir, v)

    h = ServiceHolder(load, run_dir, logger=(logs.append if logs is not None else None))
    h.load_initial(version)
    return h


def _client(holder, token=TOKEN, **cfg):
    return TestClient(create_app(holder, ServeConfig(**cfg), token_digest(token)), raise_server_exceptions=False)


@pytest.fixture
def client(serve_run, services):
    return _client(_holder(serve_run["run"], services, 1), max_body_bytes=2048, max_k=15)


def test_recommend_equals_gti_recommend(client, serve_run):
    hist = ["it3", "new0", "it1"]
    r = client.post("/recommend", json={"history": hist, "k": 5, "exclude_history": False})
    assert r.status_code == 200, r.text
    body = r.json()
    ref = LoadedRun.open(serve_run["run"]).recommend(hist, 5)  # `gti recommend --run-dir R`
    assert [x["item_id"] for x in body["items"]] == [x["item_id"] for x in ref]
    np.testing.assert_allclose([x["score"] for x in body["items"]], [x["score"] for x in ref], atol=1e-4)
    assert set(body["items"][0]) == {"item_id", "title", "score", "sid"}
    assert (body["version"], body["model"], body["map_hash"]) == (1, "refresh/v1", serve_run["v1_hash"])
    # The config default excludes the history.
    default = client.post("/recommend", json={"history": hist, "k": 5}).json()
    assert not set(hist) & {x["item_id"] for x in default["items"]} and len(default["items"]) == 5


def test_batch_status_and_info_endpoints(client, serve_run):
    r = client.post("/recommend/batch", json={"histories": [["it1"], ["it2", "it3"]], "k": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["results"]) == 2 and all(len(x["items"]) == 3 for x in body["results"])
    assert body["version"] == 1
    single = client.post("/recommend", json={"history": ["it2", "it3"], "k": 3}).json()
    assert [x["item_id"] for x in single["items"]] == [x["item_id"] for x in body["results"][1]["items"]]
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["version"] == 1
    info = client.get("/info").json()
    assert info["map_hash"] == serve_run["v1_hash"] and info["catalog_size"] == 22 and info["levels"] == 2
    assert info["decoder"]["beam_width"] == 20 and info["serve"]["max_k"] == 15
    assert info["reload"]["state"] == "idle"


def test_not_ready_is_503(serve_run):
    holder = ServiceHolder(lambda v: None, serve_run["run"])
    c = _client(holder)
    assert c.get("/healthz").status_code == 200
    for r in (c.get("/readyz"), c.post("/recommend", json={"history": ["it1"]})):
        assert r.status_code == 503 and "loading" in r.json()["error"]


BAD = [
    ("malformed", b'{"history": ["it1"', 400, "malformed JSON"),
    ("not an object", b'["it1"]', 400, "must be a JSON object"),
    ("empty body", b"", 400, "empty body"),
    ("too big", json.dumps({"history": ["it1"] * 600}).encode(), 413, "over 2048 bytes"),
    ("empty history", b'{"history": []}', 422, "history is empty"),
    ("k < 1", b'{"history": ["it1"], "k": 0}', 422, "k must be an integer >= 1"),
    ("k over limit", b'{"history": ["it1"], "k": 16}', 422, "exceeds the limit of 15"),
    ("k a string", b'{"history": ["it1"], "k": "5"}', 422, "k: Input should be a valid integer"),
    ("history of numbers", b'{"history": [1, 2]}', 422, "history.0: Input should be a valid string"),
    ("unknown field", b'{"history": ["it1"], "kk": 3}', 422, "kk: Extra inputs are not permitted"),
    ("only unknown ids", b'{"history": ["zz"]}', 422, "no item of the history is in the catalog"),
]


@pytest.mark.parametrize("name, body, status, message", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_their_4xx(client, name, body, status, message):
    r = client.post("/recommend", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert message in r.json()["error"] and r.json()["status"] == status
    assert "Traceback" not in r.text


def test_k_over_the_catalog_unknown_ids_and_long_histories(serve_run, services):
    c = _client(_holder(serve_run["run"], services, 0), max_k=100)
    r = c.post("/recommend", json={"history": ["it1"], "k": 21})
    assert r.status_code == 422 and "catalog size (20 items)" in r.json()["error"]
    r = c.post("/recommend", json={"history": ["it1", "nope"], "k": 2})
    assert r.status_code == 200 and r.json()["unknown_items"] == ["nope"]
    strict = _client(_holder(serve_run["run"], None, 0), unknown_items="error")
    r = strict.post("/recommend", json={"history": ["it1", "nope", "zz"], "k": 2})
    assert r.status_code == 422 and "unknown item id(s) in history: nope, zz" in r.json()["error"]
    assert r.json()["unknown_items"] == ["nope", "zz"]
    long = c.post("/recommend", json={"history": [f"it{i}" for i in range(9)], "k": 2}).json()
    assert long["truncated"] is True and long["history_used"] == 4 and long["history_given"] == 9


def test_bad_batches(client):
    r = client.post("/recommend/batch", json={"histories": []})
    assert r.status_code == 422 and "histories is empty" in r.json()["error"]
    r = client.post("/recommend/batch", json={"histories": [["it1"]] * 65})
    assert r.status_code == 422 and "exceed the limit of 64" in r.json()["error"]
    r = client.post("/recommend/batch", json={"histories": [["it1"], []], "k": 2})
    assert r.status_code == 422 and r.json()["error"] == "histories[1]: history is empty: give at least one item id"


def test_token_is_enforced(serve_run, services):
    holder = _holder(serve_run["run"], services, 1)
    open_app = _client(holder)
    assert open_app.get("/info").status_code == 200  # no token needed without token_required
    r = open_app.post("/admin/reload", json={"wait": True})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert open_app.post("/admin/reload", json={"wait": True},
                         headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert open_app.post("/admin/reload", json={"wait": True}, headers=AUTH).json()["state"] == "unchanged"
    no_token = _client(holder, token=None)
    r = no_token.post("/admin/reload", headers=AUTH)
    assert r.status_code == 403 and "GTI_SERVE_TOKEN" in r.json()["error"]
    locked = _client(holder, token_required=True)
    for path in ("/healthz", "/readyz", "/info"):
        assert locked.get(path).status_code == 401
        assert locked.get(path, headers=AUTH).status_code == 200
    assert locked.post("/recommend", json={"history": ["it1"]}).status_code == 401
    assert locked.post("/recommend", json={"history": ["it1"]}, headers=AUTH).status_code == 200


def test_read_token_from_env_or_file_never_the_config(tmp_path):
    cfg = ServeConfig()
    assert read_token(cfg, {"GTI_SERVE_TOKEN": " abc \n"}) == "abc"
    f = tmp_path / "tok"
    f.write_text("fromfile\n")
    assert read_token(cfg, {"GTI_SERVE_TOKEN_FILE": str(f)}) == "fromfile"
    assert read_token(cfg, {}) is None
    assert read_token(ServeConfig(token_env="MY_TOK"), {"MY_TOK": "x", "GTI_SERVE_TOKEN": "y"}) == "x"
    with pytest.raises(ConfigError, match="token_required is true but no token"):
        read_token(ServeConfig(token_required=True), {})
    with pytest.raises(ConfigError, match="GTI_SERVE_TOKEN_FILE"):
        read_token(cfg, {"GTI_SERVE_TOKEN_FILE": str(tmp_path / "missing")})
    assert token_digest("abc") != "abc" and token_digest(None) is None


def test_reload_swaps_between_requests(serve_run, services):
    holder = _holder(serve_run["run"], services, 0)
    c = _client(holder)
    before = c.post("/recommend", json={"history": ["it1", "new0"], "k": 3}).json()
    assert before["version"] == 0 and before["unknown_items"] == ["new0"]
    r = c.post("/admin/reload", json={}, headers=AUTH)
    assert r.status_code == 202 and r.json()["state"] in ("loading", "swapped")
    seen = []
    for _ in range(200):  # requests while the reload runs: none fails, each answered by one version
        res = c.post("/recommend", json={"history": ["it1"], "k": 3})
        assert res.status_code == 200, res.text
        seen.append((res.json()["version"], res.json()["map_hash"]))
        if holder.status()["state"] != "loading":
            break
    holder._thread.join()
    assert holder.status()["state"] == "swapped" and holder.status()["to"] == 1
    assert set(seen) <= {(0, serve_run["base_hash"]), (1, serve_run["v1_hash"])}
    after = c.post("/recommend", json={"history": ["it1", "new0"], "k": 3}).json()
    assert after["version"] == 1 and after["unknown_items"] == [] and after["map_hash"] == serve_run["v1_hash"]
    info = c.get("/info").json()
    assert info["version"] == 1 and info["reload"]["state"] == "swapped"


def test_non_descendant_map_is_refused_and_the_old_one_keeps_serving(bad_run, services):
    logs: list[str] = []
    holder = _holder(bad_run["run"], None, 1, logs)
    c = _client(holder)
    r = c.post("/admin/reload", json={"wait": True}, headers=AUTH)
    assert r.status_code == 200 and r.json()["state"] == "refused" and r.json()["to"] == 2
    assert "does not descend" in r.json()["message"]
    assert len(logs) == 1 and "refused, still serving version 1" in logs[0] and "\n" not in logs[0]
    ans = c.post("/recommend", json={"history": ["it1"], "k": 3})
    assert ans.status_code == 200 and ans.json()["version"] == 1
    assert c.get("/info").json()["reload"]["state"] == "refused"
    r = c.post("/admin/reload", json={"version": 7, "wait": True}, headers=AUTH)
    assert r.json()["state"] == "failed" and "no finished refresh version 7" in r.json()["message"]
    assert holder.current.version == 1 and len(logs) == 2
    # A rollback to the run's own stages is accepted (issue 51: replicas converge on a pinned
    # rollback): v1's map descends from v0's, so every item v0 knows keeps its SID, and v0
    # comes with its own model. Forward again to v1 is the ordinary descent.
    r = c.post("/admin/reload", json={"version": 0, "wait": True}, headers=AUTH)
    assert r.json()["state"] == "swapped" and holder.current.version == 0, r.json()
    assert c.post("/admin/reload", json={"version": 1, "wait": True}, headers=AUTH).json()["state"] == "swapped"


def test_call_asgi_answers_as_the_http_client_does(client):
    """What a replica does with a request the ingress forwards: the same status and body."""
    import asyncio

    from gti.serve.app import call_asgi

    body = json.dumps({"history": ["it3", "it1"], "k": 4}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    status, out_headers, content = asyncio.run(call_asgi(client.app, "POST", "/recommend", b"", headers, body))
    ref = client.post("/recommend", content=body, headers={"Content-Type": "application/json"})
    assert status == 200 and json.loads(content)["items"] == ref.json()["items"]
    assert (b"content-type", b"application/json") in out_headers
    status, _, content = asyncio.run(call_asgi(client.app, "GET", "/items", b"q=it2&limit=1", [], b""))
    assert status == 200 and [x["item_id"] for x in json.loads(content)["items"]] == ["it2"]
    status, _, content = asyncio.run(call_asgi(client.app, "POST", "/recommend", b"", headers, b"{"))
    assert status == 400 and "malformed JSON" in json.loads(content)["error"]
