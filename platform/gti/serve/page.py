"""The page `GET /` of `gti serve`: try the recommender in a browser.

What it is for: `PAGE`, one self-contained HTML document (inline CSS and JavaScript, no external
asset, no framework) that calls the service's own endpoints from the same origin: `GET info`,
`GET items?q=&limit=` (search the catalog), `POST recommend` (the history built on the page ->
items with titles, scores and SIDs). How it finds its endpoints, and what its test waits on, is
beside `PAGE`.

What it does NOT know: the run, the endpoints' rules (gti.serve.app), or any data: the page
is static, so serving it reveals nothing.
"""

from __future__ import annotations

# Every call is relative to the page's own path (`BASE`, from `location.pathname`): the page works
# at "/" and under a route prefix, opened as "/gti/" or as "/gti" (where a plain relative URL
# would resolve against "/"). A bearer token typed into the page is sent with each call (needed
# when `serve.token_required` is set). Titles and ids are inserted as text, never as HTML. A link
# `<page>#q=text&history=id1,id2` opens the page with that search and history. When its first
# calls (info, search, recommend) have answered, it sets `<body data-state="ready">` and
# dispatches a `gti-ready` event on the document: the signal its test (and a browser check)
# waits on instead of a fixed delay.
PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>gti serve</title>
<style>
 body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
 header{background:#1d2330;color:#fff;padding:10px 18px;display:flex;gap:16px;align-items:baseline}
 header h1{font-size:17px;margin:0} header small{opacity:.75}
 main{display:grid;grid-template-columns:1fr 1fr 1.4fr;gap:14px;padding:14px 18px}
 section{background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:10px 12px}
 h2{font-size:14px;margin:0 0 8px} input{font:inherit;padding:4px 6px}
 #q{width:100%;box-sizing:border-box} ul{list-style:none;padding:0;margin:6px 0}
 li{display:flex;justify-content:space-between;align-items:center;gap:8px;padding:3px 0;
    border-bottom:1px solid #eef0f3}
 button{font:inherit;cursor:pointer;border:1px solid #b9c0cc;background:#fff;border-radius:4px;padding:1px 8px}
 button.go{background:#2456d6;color:#fff;border-color:#2456d6;padding:4px 12px}
 table{width:100%;border-collapse:collapse} td,th{text-align:left;padding:3px 4px;border-bottom:1px solid #eef0f3}
 td.n{text-align:right;font-variant-numeric:tabular-nums} code{font-size:12px;color:#555;white-space:nowrap}
 .note{color:#666;font-size:12px} .err{color:#b00020}
</style></head><body>
<header><h1>gti serve</h1><small id="info">loading...</small>
 <span style="margin-left:auto"><input id="token" type="password" size="24"
  placeholder="bearer token (if required)"></span>
</header>
<main>
 <section><h2>Catalog</h2><input id="q" placeholder="search titles or ids" autofocus>
  <ul id="hits"></ul><div class="note" id="hitnote"></div></section>
 <section><h2>History <span class="note">(oldest first)</span></h2><ul id="history"></ul>
  <div>k <input id="k" type="number" min="1" value="10" style="width:4em">
   <label><input id="excl" type="checkbox" checked> leave history out</label></div>
  <p><button class="go" id="go">Recommend</button> <button id="clear">Clear</button></p></section>
 <section><h2>Recommendations</h2><div class="note" id="meta"></div>
  <table><thead><tr><th>#</th><th>title</th><th>item</th><th>score</th><th>sid</th></tr></thead>
  <tbody id="recs"></tbody></table><div class="err" id="err"></div></section>
</main>
<script>
const $ = id => document.getElementById(id);
// The folder the page is served from ("/", or "/gti/" under a route prefix, also when opened as
// "/gti"): every call below is a path relative to it, never an absolute one.
const BASE = location.pathname.endsWith("/") ? location.pathname : location.pathname + "/";
const hist = [];
function el(tag, text, cls) { const e = document.createElement(tag); if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls; return e; }
async function call(method, path, body) {
  const headers = {"Content-Type": "application/json"}, tok = $("token").value.trim();
  if (tok) headers["Authorization"] = "Bearer " + tok;
  const r = await fetch(BASE + path, {method, headers, body: body === undefined ? undefined : JSON.stringify(body)});
  const data = await r.json().catch(() => ({error: r.statusText}));
  if (!r.ok) throw new Error(r.status + ": " + (data.error || r.statusText));
  return data;
}
async function info() {
  try { const i = await call("GET", "info");
    $("info").textContent = i.model + " \\u00b7 version " + i.version + " \\u00b7 map " + i.map_hash +
      " \\u00b7 " + i.catalog_size + " items";
  } catch (e) { $("info").textContent = e.message; }
}
let searchSeq = 0;
async function search() {
  const seq = ++searchSeq, q = $("q").value;
  try { const r = await call("GET", "items?limit=20&q=" + encodeURIComponent(q));
    if (seq !== searchSeq) return;
    $("hits").replaceChildren(...r.items.map(it => { const li = el("li"), b = el("button", "add");
      b.onclick = () => { hist.push(it); showHistory(); recommend(); };
      li.append(el("span", it.title || it.item_id), b); return li; }));
    $("hitnote").textContent = r.items.length ? "" : "no item matches";
  } catch (e) { $("hitnote").textContent = e.message; }
}
function showHistory() {
  $("history").replaceChildren(...hist.map((it, i) => { const li = el("li"), b = el("button", "\\u00d7");
    b.title = "remove"; b.onclick = () => { hist.splice(i, 1); showHistory(); recommend(); };
    li.append(el("span", it.title || it.item_id), b); return li; }));
}
async function recommend() {
  $("err").textContent = "";
  if (!hist.length) { $("recs").replaceChildren(); $("meta").textContent = "add items to the history"; return; }
  try { const r = await call("POST", "recommend", {history: hist.map(it => it.item_id),
        k: parseInt($("k").value, 10), exclude_history: $("excl").checked});
    $("meta").textContent = "answered by " + r.model + " (version " + r.version + "), " + r.history_used +
      " history item(s) used" + (r.truncated ? ", cut to the newest" : "");
    $("recs").replaceChildren(...r.items.map((it, i) => { const tr = el("tr");
      tr.append(el("td", String(i + 1), "n"), el("td", it.title), el("td", it.item_id),
                el("td", it.score.toFixed(3), "n"), el("td")); tr.lastChild.append(el("code", it.sid)); return tr; }));
  } catch (e) { $("err").textContent = e.message; }
}
$("q").oninput = search; $("go").onclick = recommend; $("k").onchange = recommend; $("excl").onchange = recommend;
$("clear").onclick = () => { hist.length = 0; showHistory(); recommend(); };
$("token").onchange = () => { info(); search(); };
async function fromHash() {  // a link such as <page>#q=filament&history=0,2 opens with that search and history
  const p = new URLSearchParams(location.hash.slice(1));
  if (p.get("q")) $("q").value = p.get("q");
  for (const id of (p.get("history") || "").split(",").filter(Boolean)) {
    try { const r = await call("GET", "items?limit=1&q=" + encodeURIComponent(id));
      hist.push(r.items.find(it => it.item_id === id) || {item_id: id, title: ""}); } catch (e) {}
  }
  showHistory();
}
// The page's own completion signal: <body data-state="ready"> and a "gti-ready" event once the
// first info, search and recommend calls have answered (a test or a monitor waits on it).
Promise.all([info(), fromHash().then(() => Promise.all([search(), recommend()]))]).then(() => {
  document.body.dataset.state = "ready"; document.dispatchEvent(new Event("gti-ready")); });
</script></body></html>
"""
