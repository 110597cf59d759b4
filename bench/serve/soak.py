"""Soak: `gti serve` left running under load, with refreshes published and reloads (issue 51, item 6).

For `--minutes` (default 10) `--clients` (16) closed-loop clients POST /recommend (test-split
histories of the run's users, k 10, the serving defaults) to the `gti serve` application with
`--replicas` (2) model replicas (`serve.reload_poll_s` at its default, 2 s). Every `--every`
seconds (120) a cycle runs beside the load: `gti refresh` publishes a new version (2 catalog
items the run does not hold yet, `refresh.ground_steps=0`: SIDs only, so a cycle costs seconds,
not a training run; the refresh's defaults otherwise), then `POST /admin/reload {"version": k}`
reaches one replica, and the cycle waits until every replica reports version k on GET /info
(`"replicas"`): settled. A cycle starts when the previous one has settled and its tick has
come.

It reports: requests and failed requests (any answer other than 200 with k items, and any
failed call), requests/s, latency p50/p99; each replica's resident memory (`rss_mb` of GET
/info "replica") at the start (after the warm-up) and at the end, and after each cycle settled;
per cycle the published version, the refresh's seconds, the seconds from the reload to settled,
and the versions of the answers completed between settling and the next cycle's start
(`mixed`: more than one version there). Target: 0 failed, no cycle mixed, RSS flat.

It runs on a COPY of the run `bench/serve/serve.py` builds (`common.build_run`; `--work`, default
runs/bench-serve/; the copy under `<work>/soak-<time>/`, deleted at the end unless --keep), so
the cached run gains no versions. --quick (make bench): the tiny run, 50 s, a cycle every 15 s.
Do not run the full soak beside the test suite on a 2-core machine: it holds both cores.

Usage: python bench/serve/soak.py [--quick] [--minutes M] [--every S] [--clients N]
                                  [--replicas R] [--device cpu|cuda] [--work DIR] [--keep]
The last line is one JSON object: `requests`, `failed_requests`, `requests_per_s`, `p50_ms`,
`p99_ms`, `rss_mb_start`, `rss_mb_end` ({replica: MiB}), `rss_growth_mb` (the largest end -
start), `cycles` ([{version, refresh_s, settle_s, versions_after_settle, mixed, rss_mb}]),
`mixed_cycles`, `cycle_errors` (a cycle that failed, e.g. a refresh refused), `minutes`, `every_s`, load averages, `commit`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared module
import common  # noqa: E402

common.hf_offline()

ROOT = common.ROOT
K, TOKEN = common.SERVE_K, common.SERVE_TOKEN
MODES = {"quick": {"serve_mode": "quick", "minutes": 50 / 60, "every": 15.0},
         "full": {"serve_mode": "full", "minutes": 10.0, "every": 120.0}}


log = common.stamped_log


def fleet(url: str, reads: int = 8, most: int = 60) -> dict:
    """{replica id: {"version", "rss_mb"}} from GET /info: at least `reads` calls, and more (up to
    `most`) until every replica on the board has answered one (each call answers from one
    replica: its own rss, and the board's table of every replica's version; the router may send
    many calls in a row to the same idle replica)."""
    import httpx

    out: dict = {}
    for n in range(most):
        info = httpx.get(f"{url}/info", timeout=60).json()
        for rid, rep in info["replicas"]["each"].items():
            out.setdefault(rid, {})["version"] = rep["version"]
        out.setdefault(info["replica"]["id"], {})["rss_mb"] = info["replica"].get("rss_mb")
        if n + 1 >= reads and all(r.get("rss_mb") for r in out.values()):
            break
    return out


def new_items(run: Path, n: int, used: set[str]):
    """`n` bundled catalog items that neither the run's newest map nor an earlier cycle holds."""
    import polars as pl

    from gti.data import bundled
    from gti.run.versions import resolve

    held = set(pl.read_parquet(resolve(run, None, note=lambda line: None, find_model=False).map_path,
                               columns=["item_id"])["item_id"].to_list())
    items = pl.read_parquet(bundled.resolve("bundled:amazon-scientific", "items"))
    items = items.filter(~pl.col("item_id").is_in(list(held | used))).head(n)
    used.update(items["item_id"].to_list())
    return items


def settle(url: str, version: int, timeout_s: float = 300.0) -> float:
    """Seconds until every replica reports `version` (board and /info agree); raises past `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        seen = fleet(url, 6, most=6)  # versions only: the board lists every replica
        if seen and all(r.get("version") == version for r in seen.values()):
            return time.monotonic() - t0
        time.sleep(0.5)
    raise RuntimeError(f"replicas did not settle on version {version} within {timeout_s:.0f} s: {fleet(url)}")


def cycles(run: Path, url: str, every: float, until: float, marks: list, stop: threading.Event,
           errors: list) -> None:
    """The cycles' thread: a failure is kept in `errors` (reported, and it ends the cycles)."""
    try:
        _cycles(run, url, every, until, marks, stop)
    except Exception as err:  # noqa: BLE001 - said in the JSON, not lost with the thread
        errors.append(f"{type(err).__name__}: {err}")
        log(f"cycle failed: {errors[-1]}")


def _cycles(run: Path, url: str, every: float, until: float, marks: list, stop: threading.Event) -> None:
    """The refresh + reload cycles (a thread beside the load): each appends its record to `marks`."""
    import httpx

    from gti.run.versions import current_versions

    used: set[str] = set()
    tick = time.monotonic() + every
    while not stop.is_set():
        stop.wait(max(0.0, tick - time.monotonic()))
        if stop.is_set() or time.monotonic() >= until:
            return
        rec: dict = {"t_start": time.monotonic()}
        path = run.parent / f"cycle{len(marks)}-items.parquet"
        new_items(run, 2, used).write_parquet(path)
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "gti", "refresh", "--run-dir", str(run), "--items", str(path),
                        "refresh.ground_steps=0"], check=True, cwd=ROOT, stdout=sys.stderr, stderr=sys.stderr)
        rec["refresh_s"] = round(time.monotonic() - t0, 1)
        rec["version"] = current_versions(run, note=lambda line: None)[-1].k
        rec["t_reload"] = time.monotonic()
        r = httpx.post(f"{url}/admin/reload", json={"version": rec["version"]},
                       headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        rec["reload_status"] = r.status_code
        rec["settle_s"] = round(settle(url, rec["version"]), 1)
        rec["t_settled"] = time.monotonic()
        rec["rss_mb"] = {rid: rep.get("rss_mb") for rid, rep in fleet(url).items()}
        log(f"cycle {len(marks)}: v{rec['version']} published in {rec['refresh_s']}s, settled "
            f"{rec['settle_s']}s after the reload; rss {rec['rss_mb']}")
        marks.append(rec)
        tick = max(tick + every, time.monotonic())


def summarise(answers: list, marks: list, end: float) -> list[dict]:
    """Per cycle: the versions of the answers to requests SENT from its settling to the next
    cycle's start (its refresh publishes a version the replicas' poll may take before its
    reload). A request sent before the settling may still be answered by the old version after
    it: counted apart as `old_in_flight`, not a mix. answers: (t_done, ok, version, seconds)."""
    out = []
    for i, m in enumerate(marks):
        stop = marks[i + 1]["t_start"] if i + 1 < len(marks) else end
        after = [(t - s, v) for t, ok, v, s in answers if ok and m["t_settled"] <= t < stop]
        versions = sorted({v for sent, v in after if sent >= m["t_settled"]})
        out.append({"version": m["version"], "refresh_s": m["refresh_s"], "reload_status": m["reload_status"],
                    "settle_s": m["settle_s"], "versions_after_settle": versions, "mixed": len(versions) > 1,
                    "old_in_flight": sum(sent < m["t_settled"] and v != m["version"] for sent, v in after),
                    "rss_mb": m["rss_mb"]})
    return out


async def load(url: str, bodies: list[dict], clients: int, until: float, answers: list) -> float:
    """`clients` closed-loop clients until `until` (monotonic): answers as (t_done, ok, version, s)."""
    import httpx

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        async def worker(w: int) -> None:
            i = w
            while time.monotonic() < until:
                t = time.monotonic()
                try:
                    r = await client.post(f"{url}/recommend", json=bodies[i % len(bodies)])
                    body = r.json() if r.status_code == 200 else {}
                    ok = r.status_code == 200 and len(body.get("items", [])) == K
                    answers.append((time.monotonic(), ok, body.get("version"), time.monotonic() - t))
                    if not ok:
                        log(f"failed: {r.status_code} {r.text[:200]}")
                except Exception as err:  # noqa: BLE001 - a failed call is counted, not raised
                    answers.append((time.monotonic(), False, None, time.monotonic() - t))
                    log(f"failed: {type(err).__name__}: {err}")
                i += clients
        t0 = time.monotonic()
        await asyncio.gather(*(worker(w) for w in range(clients)))
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny run, 50 s, a cycle every 15 s (make bench)")
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--every", type=float, default=None, help="seconds between cycles (refresh + reload)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench-serve"), help="where the run is built and cached")
    ap.add_argument("--keep", action="store_true", help="keep the soak's copy of the run")
    args = ap.parse_args(argv)
    mode = MODES["quick" if args.quick else "full"]
    minutes, every = args.minutes or mode["minutes"], args.every or mode["every"]
    load_start, t_begin = os.getloadavg(), time.perf_counter()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    base = common.build_run(dict(common.SERVE_MODES[mode["serve_mode"]]), work)
    run = work / f"soak-{time.strftime('%Y%m%d-%H%M%S')}" / "run"
    shutil.copytree(base, run, symlinks=True)
    hist = common.windows(run)["history"].to_list()
    threads = max(1, min(2, os.cpu_count() or 1) // args.replicas)
    common.start_ray(max(4, os.cpu_count() or 1))
    from ray import serve

    from gti.serve.deployment import start_serve

    port = common.free_port()
    url = f"http://127.0.0.1:{port}"
    start_serve("127.0.0.1", port)
    answers: list = []
    marks: list = []
    errors: list = []
    stop = threading.Event()
    try:
        common.deploy(run, port, hist[0], version=None, replicas=args.replicas, threads=threads,
                      **common.device_options(args.device))
        start = fleet(url, 12)
        log(f"deployed: {start}")
        until = time.monotonic() + minutes * 60
        th = threading.Thread(target=cycles, args=(run, url, every, until, marks, stop, errors),
                              daemon=True)
        th.start()
        wall = asyncio.run(load(url, [{"history": h, "k": K} for h in hist], args.clients, until, answers))
        stop.set()
        th.join(600)
        end_fleet = fleet(url, 12)
    finally:
        stop.set()
        serve.shutdown()
        if not args.keep:
            shutil.rmtree(run.parent, ignore_errors=True)
    end = time.monotonic()
    ok = [a for a in answers if a[1]]
    rss0 = {r: v.get("rss_mb") for r, v in start.items()}
    rss1 = {r: v.get("rss_mb") for r, v in end_fleet.items()}
    growth = [rss1[r] - rss0[r] for r in rss1 if rss0.get(r) and rss1.get(r)]
    # The start is read right after the deploy, before a replica has decoded under load (its
    # caches and allocator pools not yet grown): growth from the first settled cycle is the
    # leak figure, growth from the start the whole rise.
    warm = marks[0]["rss_mb"] if marks else {}
    growth_warm = [rss1[r] - warm[r] for r in rss1 if warm.get(r) and rss1.get(r)]
    per_cycle = summarise(answers, marks, end)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    pct = common.percentiles([a[3] for a in ok])
    print(json.dumps({"bench": "serve-soak", "mode": "quick" if args.quick else "full", "device": args.device,
                      "minutes": round(minutes, 3), "every_s": every, "clients": args.clients,
                      "replicas": args.replicas, "requests": len(answers), "failed_requests": len(answers) - len(ok),
                      "requests_per_s": round(len(ok) / max(wall, 1e-9), 3), "p50_ms": pct["p50_ms"],
                      "p99_ms": pct["p99_ms"], "rss_mb_start": rss0, "rss_mb_end": rss1,
                      "rss_growth_mb": round(max(growth), 1) if growth else None, "rss_mb_first_cycle": warm,
                      "rss_growth_from_first_cycle_mb": round(max(growth_warm), 1) if growth_warm else None,
                      "cycles": per_cycle,
                      "mixed_cycles": sum(c["mixed"] for c in per_cycle), "cycle_errors": errors,
                      "total_s": round(time.perf_counter() - t_begin, 1), "commit": commit.strip(),
                      "load_avg_start": [round(x, 2) for x in load_start],
                      "load_avg_end": [round(x, 2) for x in os.getloadavg()]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
