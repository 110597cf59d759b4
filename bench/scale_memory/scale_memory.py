"""Benchmark: peak memory of ingest, embed and sid on large synthetic catalogs (issue 8).

Measures, for two catalog sizes (default 1M and 5M items; --quick: 20k and 100k), each of the
stages ingest, embed (hash encoder, dim 256) and sid (rqkmeans, 4 levels x 256 codes, fitted on
`sid.kmeans_sample` items, then the same Ray Data actor-pool assignment as rqvae, then
collision resolution on the driver) run in its OWN subprocess with its own local Ray
(2 CPUs), so each stage has its own memory peak:
- `gti.run.pipeline.run(cfg, to_stage=<stage>)` without force on one run dir per size; the stages
  before <stage> must be skipped as up to date, and the worker checks that only <stage> ran;
- wall s (the stage's manifest duration, Ray start-up excluded) and items/s;
- peak memory of the subprocess tree (driver + raylet/GCS/workers) sampled every 0.25 s as the
  sum of PSS, split into anonymous / file-backed / shared-memory (the object store) parts;
- the driver's peak RSS, its RssAnon / RssFile / RssShmem split at that moment, and its own
  peak RssAnon. File-backed pages (a memory-mapped embeddings.parquet, libraries) count in RSS
  but are reclaimable page cache; anonymous memory is what the driver really holds.
The ratio peak(large) / peak(small) per stage shows whether the stage streams (about 1x) or
holds the catalog (about large/small = 5x); the driver's bytes per item is the slope
(peak(large) - peak(small)) / (large - small), to extrapolate to other catalog sizes.

The interactions are small and fixed (2,000 synthetic users), so the catalog dominates.
Data and run dirs go to a temporary dir (deleted at the end; --workdir DIR keeps them).

Usage: python bench/scale_memory/scale_memory.py [--quick] [--sizes 1000000,5000000]
       [--stages ingest,embed,sid] [--workdir DIR]
       (--stages sid --workdir DIR: rerun only sid on DIR's up-to-date data)
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared module
import common  # noqa: E402

STAGES = ("ingest", "embed", "sid")
USERS = 2000
MB = 2**20


def stage_overrides(stage_args: argparse.Namespace) -> list[str]:
    """The config overrides every stage subprocess loads (same for all stages of a size, so the
    fingerprints of the earlier stages match and they are skipped)."""
    a = stage_args
    ov = [
        f"run_dir={a.run_dir}", "ray_num_cpus=2",
        f"data.items.path={a.items_path}", f"data.interactions.path={a.inter_path}",
        "embed.encoder=hash", "embed.dim=256", f"embed.batch_size={a.batch_size}",
        "sid.method=rqkmeans", "sid.levels=4", "sid.codebook_size=256",
    ]
    if a.kmeans_sample:
        ov.append(f"sid.kmeans_sample={a.kmeans_sample}")
    return ov + list(a.set or [])


def parse_echo(lines: list[str]) -> tuple[list[str], list[str]]:
    """Pipeline echo lines -> (stages that ran, stages skipped as up to date)."""
    ran, skipped = [], []
    for line in lines:
        if not line.startswith("[") or "] " not in line:
            continue
        body = line.split("] ", 1)[1]
        name, _, rest = body.partition(": ")
        if rest.startswith("up to date, skipped"):
            skipped.append(name)
        elif rest.startswith("done in"):
            ran.append(name)
    return ran, skipped


def _worker(args) -> None:
    """Inside the subprocess: run the pipeline up to args.stage (earlier stages skipped)."""
    from gti import config
    from gti.run import pipeline
    from gti.ray_start import ensure_ray

    cfg = config.load(None, stage_overrides(args))
    ensure_ray(cfg)  # Ray start-up is not part of the stage timing
    echoed: list[str] = []
    done = pipeline.run(cfg, to_stage=args.stage, force=False, echo=echoed.append)
    ran, skipped = parse_echo(echoed)
    m = done[args.stage]
    f = m.facts
    n = f["items_rows_in"] if args.stage == "ingest" else f["n_items"]
    extra = {}
    if args.stage == "sid":
        extra = {k: f[k] for k in ("train_s", "assign_s", "assign_items_per_s", "collision_rate_before",
                                   "collision_rate_after_sinkhorn", "collision_rate_after", "levels",
                                   "sid_map_hash", "timing", "driver_peak_mb")}
    print(json.dumps({"stage": args.stage, "ran": ran, "skipped": skipped, "stage_items": n,
                      "wall_s": m.duration_s, "items_per_s": round(n / max(m.duration_s, 1e-9), 1),
                      "fingerprint": m.fingerprint, **extra}))


def _run_stage(stage: str, n_items: int, data: Path, run_dir: Path, args, attempts: int = 3) -> dict:
    """One stage in a subprocess, its memory sampled. A failing subprocess is retried (a local
    Ray can time out starting on an overloaded machine; a failed stage's partial dir is
    reused), except one killed by a signal (the OOM killer, an operator): that is reported
    with `error` and the peaks it reached, not retried."""
    cmd = [sys.executable, __file__, "--worker", "--stage", stage,
           "--items-path", str(data / "items"), "--inter-path", str(data / "interactions"),
           "--run-dir", str(run_dir), "--batch-size", str(args.batch_size)]
    if args.kmeans_sample:
        cmd += ["--kmeans-sample", str(args.kmeans_sample)]
    for ov in args.set or []:
        cmd += ["--set", ov]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", DS_ACCELERATOR="cpu")
    env.pop("RAY_ADDRESS", None)
    for i in range(attempts):
        log_path = run_dir.parent / f"worker_{n_items}_{stage}.log"
        with open(log_path, "w+") as errlog:
            t0 = time.time()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errlog, env=env, text=True)
            sampler = common.MemorySampler(proc.pid)
            out, _ = proc.communicate()
            sampler.stop()
            process_s = time.time() - t0
            if proc.returncode == 0:
                break
            errlog.seek(0)
            err = errlog.read()[-3000:]
        if proc.returncode < 0:
            res = {"stage": stage, "error": f"killed by signal {-proc.returncode} after {process_s:.0f}s",
                   "wall_s": None, "items_per_s": None}
            break
        if i == attempts - 1:
            raise SystemExit(f"{stage} for {n_items:,} items failed (rc {proc.returncode}): {err}")
        print(f"retrying {stage} at {n_items:,} items after rc {proc.returncode}: {err.splitlines()[-1:]}",
              file=sys.stderr)
    else:
        raise AssertionError("unreachable")
    if proc.returncode == 0:
        res = json.loads(out.strip().splitlines()[-1])
        if res["ran"] != [stage] or res["skipped"] != list(STAGES[: STAGES.index(stage)]):
            raise SystemExit(f"{stage} at {n_items:,} items: expected only {stage} to run and the earlier "
                             f"stages to be skipped, got ran={res['ran']} skipped={res['skipped']}")
    pk, at_t, at_d = sampler.peak, sampler.at_peak["tree"], sampler.at_peak["driver"]
    res.update(
        items=n_items, process_s=round(process_s, 1), samples=sampler.samples,
        peak_tree_mb=round(pk["tree"] / MB, 1),
        tree_anon_mb=round(at_t["tree_anon"] / MB, 1), tree_file_mb=round(at_t["tree_file"] / MB, 1),
        tree_shmem_mb=round(at_t["tree_shmem"] / MB, 1),
        peak_driver_mb=round(pk["driver"] / MB, 1),
        driver_anon_mb=round(at_d["driver_anon"] / MB, 1), driver_file_mb=round(at_d["driver_file"] / MB, 1),
        driver_shmem_mb=round(at_d["driver_shmem"] / MB, 1),
        peak_driver_anon_mb=round(pk["driver_anon"] / MB, 1),
    )
    return res


def summarise(runs: dict[int, dict[str, dict]], stages: list[str]) -> dict:
    """Ratios peak(large)/peak(small) and the driver's bytes per item, per stage."""
    small, large = sorted(runs)
    out = {}
    for st in stages:
        s, l = runs[small].get(st), runs[large].get(st)
        if s is None or l is None or "error" in s or "error" in l:  # killed or not run: no ratio
            out[st] = None
            continue
        out[st] = {
            "tree_ratio": round(l["peak_tree_mb"] / s["peak_tree_mb"], 3),
            "driver_ratio": round(l["peak_driver_mb"] / s["peak_driver_mb"], 3),
            "driver_anon_ratio": round(l["peak_driver_anon_mb"] / max(s["peak_driver_anon_mb"], 1e-9), 3),
            "driver_bytes_per_item": round((l["peak_driver_mb"] - s["peak_driver_mb"]) * MB / (large - small), 1),
            "driver_anon_bytes_per_item": round(
                (l["peak_driver_anon_mb"] - s["peak_driver_anon_mb"]) * MB / (large - small), 1),
            "tree_bytes_per_item": round((l["peak_tree_mb"] - s["peak_tree_mb"]) * MB / (large - small), 1),
        }
    return out


def _table(runs: dict[int, dict[str, dict]], stages: list[str], ratios: dict) -> None:
    small, large = sorted(runs)
    print(f"{'stage':<7} {'items':>10} {'wall s':>8} {'items/s':>9} {'tree PSS MB':>12} "
          f"{'(anon/file/shm)':>20} {'driver RSS MB':>14} {'(anon/file/shm)':>20} {'drv anon pk':>12}")
    for st in stages:
        for n in (small, large):
            r = runs[n].get(st)
            if r is None:
                continue
            timing = (f"{r['wall_s']:>8.1f} {r['items_per_s']:>9,.0f}" if r["wall_s"] is not None
                      else f"{'failed':>8} {'':>9}")
            print(f"{st:<7} {n:>10,} {timing} {r['peak_tree_mb']:>12,.0f} "
                  f"{r['tree_anon_mb']:>7,.0f}/{r['tree_file_mb']:>5,.0f}/{r['tree_shmem_mb']:>5,.0f} "
                  f"{r['peak_driver_mb']:>14,.0f} "
                  f"{r['driver_anon_mb']:>7,.0f}/{r['driver_file_mb']:>5,.0f}/{r['driver_shmem_mb']:>5,.0f} "
                  f"{r['peak_driver_anon_mb']:>12,.0f}" + (f"  ({r['error']})" if "error" in r else ""))
        q = ratios.get(st)
        if q is None:
            print(f"{'':<7} no ratio: a run did not finish")
            continue
        print(f"{'':<7} ratio {large / small:g}x items: tree {q['tree_ratio']:.2f}x, driver RSS "
              f"{q['driver_ratio']:.2f}x, driver anon {q['driver_anon_ratio']:.2f}x; driver "
              f"{q['driver_bytes_per_item']:.0f} B/item (anon {q['driver_anon_bytes_per_item']:.0f}), "
              f"tree {q['tree_bytes_per_item']:.0f} B/item")
        for n in (small, large):  # the stage's own per-phase peaks (facts.driver_peak_mb)
            peaks = (runs[n].get(st) or {}).get("driver_peak_mb")
            if peaks:
                print(f"{'':<7} {n:>10,} driver peak MB by phase: "
                      + ", ".join(f"{k.removesuffix('_peak_mb')} {v:,.0f}" for k, v in peaks.items()))


def parse_stages(text: str, workdir: str | None) -> list[str]:
    """--stages -> consecutive stage names; a start after ingest needs a kept --workdir."""
    stages = [s.strip() for s in text.split(",") if s.strip()]
    first = STAGES.index(stages[0]) if stages and stages[0] in STAGES else -1
    if first < 0 or stages != list(STAGES[first : first + len(stages)]):
        raise SystemExit(f"--stages must be consecutive stages of {','.join(STAGES)}, got {text!r}")
    if first > 0 and not workdir:
        raise SystemExit(f"--stages {text} starts after {STAGES[0]}: pass the --workdir of a run "
                         f"that did {','.join(STAGES[:first])}")
    return stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20k and 100k items, k-means on 4,096 items")
    ap.add_argument("--sizes", help="two catalog sizes, comma-separated (default 1000000,5000000)")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help="consecutive stages of ingest,embed,sid; with a later start (e.g. 'sid'), "
                    "the earlier stages must be up to date in --workdir from a previous run")
    ap.add_argument("--batch-size", type=int, default=2048, help="embed.batch_size")
    ap.add_argument("--kmeans-sample", type=int, default=None,
                    help="sid.kmeans_sample (default: the config's 65,536; 4,096 with --quick)")
    ap.add_argument("--workdir", help="keep data and run dirs here (default: a temp dir, deleted)")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="a further config override for every stage (repeatable), e.g. sid.resolve_cache_mb=128")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--items-path", help=argparse.SUPPRESS)
    ap.add_argument("--inter-path", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    if args.quick and args.kmeans_sample is None:
        args.kmeans_sample = 4096
    sizes = ([int(x) for x in args.sizes.split(",")] if args.sizes
             else [20_000, 100_000] if args.quick else [1_000_000, 5_000_000])
    if len(sizes) != 2 or sizes[0] >= sizes[1]:
        raise SystemExit("--sizes takes two increasing sizes")
    stages = parse_stages(args.stages, args.workdir)

    from gti.data import synth

    tmp = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gti_bench_scale_"))
    tmp.mkdir(parents=True, exist_ok=True)
    runs: dict[int, dict[str, dict]] = {}
    synth_s: dict[int, float] = {}
    try:
        for n in sizes:
            data, run_dir = tmp / f"synth_{n}", tmp / f"run_{n}"
            t0 = time.time()
            if not (data / "synth.json").is_file():
                synth.generate(n, USERS, data, seed=0, log=lambda m: None)
            synth_s[n] = round(time.time() - t0, 1)
            print(f"{n:,} items: synthetic catalog in {synth_s[n]:.0f}s", file=sys.stderr, flush=True)
            runs[n] = {}
            for st in stages:
                r = _run_stage(st, n, data, run_dir, args)
                runs[n][st] = r
                print(f"{n:,} items {st}: {r.get('error') or str(round(r['wall_s'])) + 's'}, tree "
                      f"{r['peak_tree_mb']:,.0f} MB, driver {r['peak_driver_mb']:,.0f} MB (anon "
                      f"{r['peak_driver_anon_mb']:,.0f}); {json.dumps(r)}", file=sys.stderr, flush=True)
                if "error" in r:
                    break  # later stages need this one
            if not args.workdir:  # free the disk before the next size
                shutil.rmtree(data, ignore_errors=True)
                shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        if not args.workdir:
            shutil.rmtree(tmp, ignore_errors=True)
    ratios = summarise(runs, stages)
    _table(runs, stages, ratios)
    keep = ("wall_s", "items_per_s", "process_s", "peak_tree_mb", "tree_anon_mb", "tree_file_mb",
            "tree_shmem_mb", "peak_driver_mb", "driver_anon_mb", "driver_file_mb", "driver_shmem_mb",
            "peak_driver_anon_mb", "assign_items_per_s", "collision_rate_before", "collision_rate_after",
            "sid_map_hash", "driver_peak_mb", "timing")
    print(json.dumps({
        "bench": "scale_memory",
        "quick": args.quick,
        "sizes": sizes,
        "kmeans_sample": args.kmeans_sample or 65536,
        "synth_s": {str(n): synth_s[n] for n in sizes},
        "stages": {st: {str(n): {k: runs[n][st][k] for k in keep + ("error",) if k in runs[n][st]}
                        for n in sizes if st in runs[n]} for st in stages},
        "ratios": ratios,
    }))


if __name__ == "__main__":
    main()
