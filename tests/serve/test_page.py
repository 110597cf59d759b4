"""gti/serve/page.py and the HTTP calls it makes, through the app of gti/serve/app.py with
FastAPI's TestClient on the tiny run of conftest.py (no Ray, no browser): GET / is one
self-contained page (no external asset, data inserted as text) whose calls are relative to its
own path (it works at "/" and under a route prefix, opened as "/gti/" or "/gti": its script run
in node with a stand-in DOM until the page signals `gti-ready`; node comes with `make install`
and its absence fails the test), and the calls its script makes (GET
info, GET items?limit=20&q=..., POST recommend with the built history) answer what the page
reads, with the same 4xx and token rules as the rest of the service."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
from fastapi.testclient import TestClient

from gti.config.serve import ServeConfig
from gti.serve.app import create_app, token_digest
from gti.serve.page import PAGE
from gti.serve.reload import ServiceHolder

TOKEN = "page-token"


@pytest.fixture
def holder(serve_run, services):
    h = ServiceHolder(lambda v: services[v], serve_run["run"])
    h.load_initial(1)
    return h


def _client(holder, **cfg):
    return TestClient(create_app(holder, ServeConfig(**cfg), token_digest(TOKEN)), raise_server_exceptions=False)


def test_page_is_self_contained():
    assert PAGE.startswith("<!doctype html>") and PAGE.rstrip().endswith("</html>")
    assert not re.search(r"https?://|<link|\bsrc=|@import|url\(", PAGE)  # nothing fetched from elsewhere
    assert "innerHTML" not in PAGE  # titles and ids go in as text
    # The calls its script makes are the ones tested below.
    for call in ('call("GET", "info")', 'call("GET", "items?limit=20&q="', 'call("GET", "items?limit=1&q="',
                 'call("POST", "recommend"'):
        assert call in PAGE


def test_no_call_uses_an_absolute_path():
    """Under a route prefix (serve.route_prefix: /gti) "/info" would leave the app: every call is
    relative to the page's own folder, BASE."""
    calls = re.findall(r'call\("(?:GET|POST)", "([^"]*)"', PAGE)
    assert len(calls) == 4 and not [c for c in calls if c.startswith("/") or "//" in c], calls
    assert re.findall(r"fetch\(([^,]*),", PAGE) == ["BASE + path"]
    assert not re.search(r"""["'`]/(info|items|recommend|healthz|readyz|admin)""", PAGE)


# The page's script with a stand-in DOM: every URL it fetches, resolved as a browser would.
_NODE_HARNESS = """
const PATHNAME = process.env.PAGE_PATHNAME, urls = [];
function mk() { return {value: "", checked: true, textContent: "", className: "", children: [],
  append(...c) { this.children.push(...c); }, replaceChildren(...c) { this.children = c; },
  get lastChild() { return this.children[this.children.length - 1]; }}; }
const els = {k: Object.assign(mk(), {value: "5"})};
globalThis.document = {getElementById: id => (els[id] ||= mk()), createElement: () => mk()};
globalThis.location = {pathname: PATHNAME, hash: "#q=it&history=it1"};
const item = {item_id: "it1", title: "Title of it1", sid: "<a_1><b_2>", score: -1.5};
globalThis.fetch = async (url, opts) => {
  const u = new URL(url, "http://127.0.0.1:8000" + PATHNAME);
  urls.push([opts.method, u.pathname, u.search]);
  return {ok: true, status: 200, json: async () => ({items: [item], model: "m", version: 1, map_hash: "h",
    catalog_size: 1, history_used: 1, truncated: false})};
};
const listeners = {};
document.body = mk(); document.body.dataset = {};
document.addEventListener = (name, fn) => { (listeners[name] ||= []).push(fn); };
document.dispatchEvent = ev => { (listeners[ev.type] || []).forEach(fn => fn(ev)); return true; };
// Printed when the page says it is done (its own signal), not after a guessed delay; a page that
// never says so fails the test after 20 s instead of passing on whatever it fetched by then.
const guard = setTimeout(() => { console.error("the page never signalled gti-ready"); process.exit(3); }, 20000);
document.addEventListener("gti-ready", () => {
  clearTimeout(guard);
  console.log(JSON.stringify({urls, state: document.body.dataset.state}));
});
SCRIPT
"""


def _node() -> str:
    """node, which `make install` installs (Debian's nodejs) where it is missing: a missing
    node fails this test with one line rather than skipping it unseen."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed: `make install` installs it (apt-get install nodejs, as root); "
                    "the page's script cannot be checked without it")
    return node


@pytest.mark.parametrize("pathname, base", [("/", "/"), ("/gti/", "/gti/"), ("/gti", "/gti/"),
                                            ("/api/gti", "/api/gti/")])
def test_the_pages_calls_stay_under_its_path(pathname, base):
    """Opened at `pathname` (the root, or a route prefix with or without its trailing slash),
    the page's script fetches info, items and recommend under `base`, as a browser resolves them."""
    script = PAGE.split("<script>", 1)[1].split("</script>", 1)[0]
    out = subprocess.run([_node(), "-e", _NODE_HARNESS.replace("SCRIPT", script)], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PAGE_PATHNAME": pathname})
    assert out.returncode == 0, out.stderr
    done = json.loads(out.stdout)
    assert done["state"] == "ready"  # the page's own signal, after its first calls answered
    urls = done["urls"]
    assert {(m, p) for m, p, _ in urls} == {("GET", base + "info"), ("GET", base + "items"),
                                            ("POST", base + "recommend")}, urls
    assert ["?limit=1&q=it1", "?limit=20&q=it"] == sorted(q for _, p, q in urls if p.endswith("items"))


def test_get_root_serves_the_page(holder):
    r = _client(holder).get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html") and r.text == PAGE
    # The page holds no data: it is served without the token even when every call needs it.
    assert _client(holder, token_required=True).get("/").status_code == 200


def test_the_pages_calls(holder, serve_run):
    c = _client(holder)
    info = c.get("/info").json()  # the header line
    assert (info["model"], info["version"], info["catalog_size"]) == ("refresh/v1", 1, 22)
    hits = c.get("/items", params={"limit": 20, "q": "title of it1"}).json()  # typing in the search box
    assert [h["item_id"] for h in hits["items"]][:2] == ["it1", "it10"] and hits["version"] == 1
    assert hits["items"][0] == {"item_id": "it1", "title": "Title of it1", "sid": hits["items"][0]["sid"]}
    assert len(c.get("/items", params={"limit": 20, "q": ""}).json()["items"]) == 20  # the first view
    # A link /#history=it1,new0 looks each id up (the item with that id comes first).
    assert [c.get("/items", params={"limit": 1, "q": i}).json()["items"][0]["item_id"] for i in ("it1", "new0")] \
        == ["it1", "new0"]
    history = ["it1", "new0"]  # two "add" clicks
    rec = c.post("/recommend", json={"history": history, "k": 5, "exclude_history": True}).json()
    assert len(rec["items"]) == 5 and not set(history) & {x["item_id"] for x in rec["items"]}
    first = rec["items"][0]
    assert first["title"] == f"Title of {first['item_id']}" and isinstance(first["score"], float)
    assert rec["model"] == "refresh/v1" and rec["history_used"] == 2 and rec["truncated"] is False
    # What the page shows on a bad k: the error line.
    bad = c.post("/recommend", json={"history": history, "k": 0, "exclude_history": True})
    assert bad.status_code == 422 and "k must be an integer >= 1" in bad.json()["error"]


@pytest.mark.parametrize("params, message", [
    ({"limit": "0"}, "limit must be an integer from 1 to 50"),
    ({"limit": "51"}, "limit must be an integer from 1 to 50"),
    ({"limit": "ten"}, "got 'ten'"),
    ({"q": "x", "page": "2"}, "unknown query parameter(s): page"),
    ({"q": "x" * 201}, "q is 201 characters long"),
])
def test_bad_searches_get_a_422(holder, params, message):
    r = _client(holder).get("/items", params=params)
    assert r.status_code == 422 and message in r.json()["error"] and r.json()["status"] == 422


def test_search_follows_the_token_and_the_loading_rules(holder, serve_run):
    locked = _client(holder, token_required=True)
    assert locked.get("/items", params={"q": "it"}).status_code == 401
    r = locked.get("/items", params={"q": "it"}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.json()["limit"] == 20
    loading = ServiceHolder(lambda v: None, serve_run["run"])
    r = _client(loading).get("/items", params={"q": "it"})
    assert r.status_code == 503 and "loading" in r.json()["error"]
    assert _client(holder, max_search_results=3).get("/items", params={"limit": "4"}).status_code == 422
