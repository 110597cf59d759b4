"""Benchmark: `gti serve` figures a user can plan with (issue 51, item 5).

At the serving defaults (`ServeConfig()`: history exclusion on, `serve.max_batch_size` 16
histories, the CPU's batch wait, the decode budget from the replica's memory), requests carry
histories of realistic length: the test-split histories of the run's own users (as evaluate
builds them, up to `data.max_history` items; their lengths are reported), k 10, no
`exclude_history` in the body (the default applies, so the beam width follows each history's
distinct items and one gathered batch may run as several searches). Two arms, each the whole
`gti serve` application (ingress + one replica) redeployed for its turn, the turns rotating per
round:
  `batched`: the defaults;
  `unbatched`: the same with `serve.max_batch_size: 1`.
Each arm at 1, 16 and 64 closed-loop clients (each sends its next request when the previous is
answered): requests/s, latency p50/p95/p99 (ms), errors, and the decode batch sizes the replica
ran (`GET /info` "replica" "searches" "sizes": {histories in one decode: decodes}, the
difference over the turn) and the histories each gathered batch held at most.

Catalog: a synthetic run of `--catalog-items` items (default 1M; --quick 50k) written without a
pipeline (a tiny Llama with 3 x 128 SID tokens, random distinct SIDs, titles drawn from a word
list), loaded as a replica loads it (`RecommenderService.load`) in a child process:
its resident memory after the imports, after the load (model, map, trie, titles) and after the
search index is built, and `GET /items`'s search (`RecommenderService.search`, limit 20)
latency p50/p95 for: the empty text (the page's first call), a common word, the last item's
title (one hit at the end of the scan), a text no title holds (the whole scan), an exact id. The model share of a real replica is the `--device`'s replica of the bench run
(`replica_rss_mb` from /info): replica memory at N items ~ that + the catalog's share above.

The model: the run `bench/serve/serve.py` builds and caches (`common.build_run`; `--work`, default
runs/bench-serve/: SmolLM2-135M, random SID rows, no training; --quick: the tiny config). Its
recommendations are meaningless; their cost is not.

GPU row: `--device cuda` deploys the replica with `serve.device: cuda`, `serve.num_gpus: 1`
(and the catalog child on cuda); not run on the 2-core CPU machine.

Usage: python bench/serve/plan.py [--quick] [--rounds R] [--requests N] [--catalog-items N]
                                  [--device cpu|cuda] [--work DIR]
The last line is one JSON object: per arm and client count (`batched@16`, ...) `requests_per_s`,
`p50_ms`, `p95_ms`, `p99_ms`, `errors`, `decode_sizes`, `largest_batch_histories`;
`batched_over_unbatched` per client count; `history_lengths` (min/p50/mean/max items given);
`catalog` (items, rss_mb at each step, index_build_s, search p50/p95 ms per query kind,
recommend_s: one request on that catalog); `replica_rss_mb`; `device`; load averages; `commit`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared module
import common  # noqa: E402

common.hf_offline()

ROOT = common.ROOT
K, CLIENTS = common.SERVE_K, (1, 16, 64)
MODES = {
    "quick": {"serve_mode": "quick", "rounds": 1, "requests": {1: 6, 16: 32, 64: 64}, "catalog_items": 50_000},
    "full": {"serve_mode": "full", "rounds": 2, "requests": {1: 24, 16: 160, 64: 320}, "catalog_items": 1_000_000},
}
WORDS = ("glass beaker flask pipette burette funnel tube rack clamp stand filter paper dish petri slide cover "
         "microscope lamp scale balance thermometer hotplate stirrer magnetic bottle cylinder graduated "
         "borosilicate plastic steel nitrile gloves goggles coat mask swab vial cap stopper tongs spatula").split()


log = common.stamped_log
percentiles = common.percentiles  # p50/p95/p99 ms; tests/bench/test_serve_plan.py reads it here


def size_diff(after: dict, before: dict) -> dict[str, int]:
    """{histories in one decode: decodes} run between two reads of the replica's counts."""
    out = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {k: v for k, v in sorted(out.items(), key=lambda kv: int(kv[0])) if v > 0}


def replica(port: int) -> dict:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/info", timeout=60).json()["replica"]


def arm_turn(arm: str, run_dir: Path, port: int, hist: list, mode: dict, acc: dict) -> None:
    """Deploy `arm`, then the load at each client count; figures accumulate in `acc`."""
    extra = {"max_batch_size": 1} if arm == "unbatched" else {}
    common.deploy(run_dir, port, hist[0], threads=mode["threads"], reload_poll_s=0, **extra,
                  **common.device_options(mode["device"]))
    bodies = [{"history": h, "k": K} for h in hist]  # exclude_history: the default (true)
    for n in CLIENTS:
        before = replica(port)
        url = f"http://127.0.0.1:{port}/recommend"
        res, wall = asyncio.run(common.closed_loop(url, bodies, mode["requests"][n], n))
        after = replica(port)
        ok = [r for r in res if r[1] == 200 and len(r[3]["items"]) == K]
        a = acc.setdefault(f"{arm}@{n}", {"ok": 0, "wall": 0.0, "lat": [], "errors": 0, "sizes": {}, "largest": 0})
        a["ok"], a["wall"], a["errors"] = a["ok"] + len(ok), a["wall"] + wall, a["errors"] + len(res) - len(ok)
        a["lat"] += [r[2] for r in ok]
        for size, count in size_diff(after["searches"]["sizes"], before["searches"]["sizes"]).items():
            a["sizes"][size] = a["sizes"].get(size, 0) + count
        a["largest"] = max(a["largest"], after["largest_batch_histories"])
        acc["replica_rss_mb"] = max(acc.get("replica_rss_mb") or 0, after.get("rss_mb") or 0)
        log(f"{arm}@{n}: {len(ok)}/{len(res)} ok in {wall:.1f}s = {len(ok) / max(wall, 1e-9):.2f} req/s, "
            f"{common.percentiles([r[2] for r in ok])}, decodes {a['sizes']}")


def arm_figures(acc: dict) -> dict:
    arms = [f"{a}@{n}" for a in ("batched", "unbatched") for n in CLIENTS if f"{a}@{n}" in acc]
    out: dict = {"requests_per_s": {}, "p50_ms": {}, "p95_ms": {}, "p99_ms": {}, "errors": {}, "decode_sizes": {},
                 "largest_batch_histories": {}}
    for a in arms:
        x = acc[a]
        out["requests_per_s"][a] = round(x["ok"] / max(x["wall"], 1e-9), 3)
        for key, val in common.percentiles(x["lat"]).items():
            out[key][a] = val
        out["errors"][a], out["decode_sizes"][a] = x["errors"], x["sizes"]
        out["largest_batch_histories"][a] = x["largest"]
    rps = out["requests_per_s"]
    out["batched_over_unbatched"] = {str(n): round(rps[f"batched@{n}"] / rps[f"unbatched@{n}"], 3)
                                     for n in CLIENTS if f"batched@{n}" in rps and rps.get(f"unbatched@{n}")}
    out["replica_rss_mb"] = acc.get("replica_rss_mb")
    return out


def history_lengths(hist: list[list[str]]) -> dict:
    import numpy as np

    n = np.asarray([len(h) for h in hist])
    return {"min": int(n.min()), "p50": float(np.median(n)), "mean": round(float(n.mean()), 2), "max": int(n.max()),
            "distinct_mean": round(float(np.mean([len(set(h)) for h in hist])), 2)}


# --------------------------------------------------------------------------- the synthetic catalog
def write_catalog_run(run: Path, n_items: int, codebook: int = 128, seed: int = 0) -> None:
    """A finished run of `n_items` items without a pipeline: a tiny Llama with 3 x `codebook`
    SID tokens, distinct random SIDs, synthetic titles (as tests/serve/conftest.py builds its
    20-item run). Written once (a `done` file marks it)."""
    import numpy as np
    import polars as pl
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gti import config as C
    from gti.lm.models import build_tiny
    from gti.lm.new_rows import export_model, extend_tokenizer
    from gti.run.manifest import Manifest
    from gti.sid.codec import SidCodec
    from gti.sid.versions import map_hash

    if (run / "done").is_file():
        return
    levels = 3
    model, tok = build_tiny(C.ModelConfig(name="tiny"), seed=seed)
    codec = SidCodec(levels, codebook)
    _, end = extend_tokenizer(tok, codec.tokens())
    model.resize_token_embeddings(end, mean_resizing=False)
    rng = np.random.default_rng(seed)
    flat = rng.choice(codebook ** levels, size=n_items, replace=False)
    codes = np.stack([flat // codebook ** 2, (flat // codebook) % codebook, flat % codebook], 1).astype(np.int32)
    ids = [f"item{i:07d}" for i in range(n_items)]
    words = np.asarray(WORDS)
    picks = rng.integers(0, len(words), size=(n_items, 3))
    titles = [f"{a} {b} {c} {i}" for i, (a, b, c) in enumerate(words[picks].tolist())]
    table = pa.table({"item_id": ids, "codes": pa.array(codes.tolist(), pa.list_(pa.int32())),
                      "sid": codec.to_strings(codes.tolist())})
    h = map_hash(table)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(C.dump(C.load(None, [])))
    (run / "sid").mkdir(exist_ok=True)
    pq.write_table(table, str(run / "sid" / "sid_map.parquet"))
    Manifest(stage="sid", fingerprint="f", config={}, outputs={"sid_map": "sid_map.parquet"},
             facts={"levels": levels, "codebook_sizes": [codebook] * levels, "token_format": codec.token_format,
                    "sid_map_hash": h, "n_items": n_items}).write(run / "sid")
    (run / "ingest").mkdir(exist_ok=True)
    pl.DataFrame({"item_id": ids, "title": titles}).write_parquet(run / "ingest" / "items.parquet")
    Manifest(stage="ingest", fingerprint="f", config={}, outputs={"items": "items.parquet"}).write(run / "ingest")
    export_model(model, tok, run / "sft" / "model", {"sid_map_hash": h})
    Manifest(stage="sft", fingerprint="f", config={}, outputs={"model": "model"}).write(run / "sft")
    (run / "done").write_text("ok\n")


def catalog_child(run: Path, device: str, reps: int) -> dict:
    """In its own process: what a replica holds at this catalog size and what a search costs."""
    import gc

    import torch  # noqa: F401 - counted in the baseline, as every replica imports it

    from gti.serve.deployment import rss_mb
    from gti.serve.service import RecommenderService

    gc.collect()
    out: dict = {"rss_mb": {"imports": rss_mb()}}
    t0 = time.perf_counter()
    svc = RecommenderService.load(run, 0, device=device)
    out["load_s"], out["rss_mb"]["loaded"] = round(time.perf_counter() - t0, 2), rss_mb()
    t0 = time.perf_counter()
    svc.search("", 20)  # builds the index (the page's first call)
    out["index_build_s"], out["rss_mb"]["indexed"] = round(time.perf_counter() - t0, 2), rss_mb()
    n = svc.catalog_size
    last = svc.run.item_ids[-1]
    # the page's first call; a word in a third of the titles; the last item's title (one hit, a
    # whole scan); a text no title holds (the worst case: every pass of the scan, no hit); an id
    queries = {"empty": "", "common": WORDS[0], "rare": svc.run.titles[last], "absent": "no such title",
               "exact_id": f"item{n // 2:07d}"}
    out["search_ms"] = {}
    for name, q in queries.items():
        secs = []
        for _ in range(reps):
            t = time.perf_counter()
            hits = svc.search(q, 20)
            secs.append(time.perf_counter() - t)
        pct = common.percentiles(secs)
        out["search_ms"][name] = {"p50": pct["p50_ms"], "p95": pct["p95_ms"], "hits": len(hits)}
    t0 = time.perf_counter()
    svc.recommend([[f"item{i:07d}" for i in range(5)]], K)
    out["recommend_s"] = round(time.perf_counter() - t0, 3)
    out["items"] = n
    return out


def catalog_figures(work: Path, n_items: int, device: str, reps: int) -> dict:
    run = work / f"catalog-{n_items}"
    t0 = time.perf_counter()
    write_catalog_run(run, n_items)
    log(f"catalog: {n_items:,} items written in {time.perf_counter() - t0:.1f}s")
    proc = subprocess.run([sys.executable, __file__, "--catalog-child", str(run), "--device", device,
                           "--reps", str(reps)], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"catalog child failed: {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    log(f"catalog: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny run, few requests, 50k items (make bench)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--requests", type=int, default=None, help="requests per arm at 16 clients (x2 at 64, /8 at 1)")
    ap.add_argument("--catalog-items", type=int, default=None)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the GPU row (one GPU)")
    ap.add_argument("--reps", type=int, default=20, help="repetitions of each catalog search")
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench-serve"), help="where the runs are built and cached")
    ap.add_argument("--catalog-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.catalog_child:
        print(json.dumps(catalog_child(Path(args.catalog_child), args.device, args.reps)))
        return 0
    mode = dict(MODES["quick" if args.quick else "full"], device=args.device)
    if args.requests:
        mode["requests"] = {1: max(2, args.requests // 8), 16: args.requests, 64: 2 * args.requests}
    mode["rounds"] = args.rounds or mode["rounds"]
    mode["threads"] = min(2, os.cpu_count() or 1)
    load_start, t0 = os.getloadavg(), time.perf_counter()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    run_dir = common.build_run(dict(common.SERVE_MODES[mode["serve_mode"]]), work)
    hist = common.windows(run_dir)["history"].to_list()
    hist = [hist[i % len(hist)] for i in range(max(mode["requests"].values()))]
    import torch

    torch.set_num_threads(mode["threads"])
    common.start_ray(max(4, os.cpu_count() or 1))
    from ray import serve

    from gti.serve.deployment import start_serve

    port = common.free_port()
    start_serve("127.0.0.1", port)
    acc: dict = {}
    try:
        for rnd in range(mode["rounds"]):
            for arm in (("batched", "unbatched") if rnd % 2 == 0 else ("unbatched", "batched")):
                log(f"round {rnd + 1}/{mode['rounds']}: {arm}")
                arm_turn(arm, run_dir, port, hist, mode, acc)
    finally:
        serve.shutdown()
    figures = arm_figures(acc)
    figures["catalog"] = catalog_figures(work, args.catalog_items or mode["catalog_items"], args.device, args.reps)
    load_end = os.getloadavg()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    from gti.config.serve import ServeConfig

    d = ServeConfig()
    print(json.dumps({"bench": "serve-plan", "mode": "quick" if args.quick else "full", "device": args.device,
                      "run_dir": str(run_dir), "clients": list(CLIENTS), "k": K, "rounds": mode["rounds"],
                      "defaults": {"exclude_history": d.exclude_history, "max_batch_size": d.max_batch_size,
                                   "batch_wait_timeout_s": d.batch_wait_for(args.device)},
                      "threads": mode["threads"], "history_lengths": history_lengths(hist), **figures,
                      "total_s": round(time.perf_counter() - t0, 1), "commit": commit.strip(),
                      "load_avg_start": [round(x, 2) for x in load_start],
                      "load_avg_end": [round(x, 2) for x in load_end]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
