"""Benchmark: catalog ingestion and content embedding throughput, and streaming memory.

Measures, side by side in one run:
- ingest items/s and hash-embedding items/s on synthetic catalogs of two sizes (10x apart:
  100k and 1M items; --quick: 5k and 50k), each size run by `gti.run.pipeline.run(to_stage="embed")`
  in its own subprocess with its own local Ray (2 CPUs);
- peak memory of each run's whole process tree (driver + Ray raylet/GCS/workers), sampled every
  0.25 s as the sum of PSS (proportional set size, so the shared object store is not counted
  once per process; RSS where PSS is unavailable), and the driver's own peak RSS. The ratio
  peak(10N) / peak(N) shows whether the stages stream (bounded memory) or hold the catalog;
- minilm items/s on the bundled demo catalog (first 128 items with --quick), encoder only.

The interactions are kept small and fixed (2,000 synthetic users) so the catalog dominates;
sequence building is a one-process polars step whose memory grows with the interaction count.

Usage: python bench/ingest_embed/ingest_embed.py [--quick]. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared module
import common  # noqa: E402

USERS = 2000


def _run_size(n_items: int, workdir: Path, batch_size: int, attempts: int = 3) -> dict:
    """`_run_once`, retried when the worker fails (a local Ray can time out starting on an
    overloaded machine; that is not what this benchmark measures)."""
    for i in range(attempts):
        try:
            return _run_once(n_items, workdir, batch_size)
        except RuntimeError as err:
            if i == attempts - 1:
                raise SystemExit(str(err)) from None
            print(f"retrying {n_items:,} items after: {str(err).splitlines()[0][:200]}", file=sys.stderr)
    raise AssertionError("unreachable")


def _run_once(n_items: int, workdir: Path, batch_size: int) -> dict:
    """Generate N synthetic items, run ingest + embed(hash) in a subprocess, sample its memory."""
    from gti.data import synth

    data = workdir / f"synth_{n_items}"
    t0 = time.time()
    if not (data / "synth.json").is_file():
        synth.generate(n_items, USERS, data, seed=0, log=lambda m: None)
    gen_s = time.time() - t0
    cmd = [sys.executable, __file__, "--worker", "--items-path", str(data / "items"),
           "--inter-path", str(data / "interactions"), "--run-dir", str(workdir / f"run_{n_items}"),
           "--batch-size", str(batch_size)]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", DS_ACCELERATOR="cpu")
    env.pop("RAY_ADDRESS", None)
    errlog = open(workdir / f"worker_{n_items}.log", "w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errlog, env=env, text=True)
    sampler = common.MemorySampler(proc.pid)
    out, _ = proc.communicate()
    sampler.stop()
    peak = sampler.peak
    if proc.returncode != 0:
        errlog.seek(0)
        raise RuntimeError(f"worker for {n_items} items failed (rc {proc.returncode}): {errlog.read()[-3000:]}")
    errlog.close()
    res = json.loads(out.strip().splitlines()[-1])
    res.update(items=n_items, synth_s=round(gen_s, 2), peak_tree_mb=round(peak["tree"] / 2**20, 1),
               peak_driver_mb=round(peak["driver"] / 2**20, 1))
    return res


def _worker(args) -> None:
    """Inside the subprocess: run ingest -> embed on the synthetic data and report timings."""
    from gti import config
    from gti.run import pipeline
    from gti.ray_start import ensure_ray

    cfg = config.load(None, [
        f"run_dir={args.run_dir}", "ray_num_cpus=2",
        f"data.items.path={args.items_path}", f"data.interactions.path={args.inter_path}",
        "embed.encoder=hash", "embed.dim=256", f"embed.batch_size={args.batch_size}",
    ])
    ensure_ray(cfg)  # Ray start-up is not part of the stage timings
    done = pipeline.run(cfg, to_stage="embed", force=True, echo=lambda m: None)
    ing, emb = done["ingest"], done["embed"]
    n = ing.facts["items_rows_in"]
    print(json.dumps({
        "ingest_s": ing.duration_s, "embed_s": emb.duration_s,
        "ingest_items_per_s": round(n / ing.duration_s, 1),
        "hash_embed_items_per_s": round(emb.facts["n_items"] / emb.duration_s, 1),
        "hash_embed_items_per_s_streaming": emb.facts["items_per_s"],
    }))


def _minilm(n: int | None) -> dict:
    """minilm encoder throughput on the bundled demo items (encoder only, this process)."""
    import pyarrow.parquet as pq

    from gti.config import EmbedConfig
    from gti.data import bundled
    from gti.embed.encoders import build_encoder, item_text

    cfg = EmbedConfig(encoder="minilm", batch_size=128)
    t = pq.read_table(bundled.resolve("bundled:amazon-scientific", "items"))
    rows = t.to_pylist()[: n or None]
    texts = [item_text(r["title"] or "", r["description"] or "", r["category"] or "",
                       f"brand: {r['brand']}" if r["brand"] else "", cfg.fields) for r in rows]
    enc = build_encoder(cfg)
    enc.encode(texts[:8])  # warm-up (first call allocates)
    t0 = time.time()
    for i in range(0, len(texts), cfg.batch_size):
        enc.encode(texts[i : i + cfg.batch_size])
    dt = time.time() - t0
    return {"minilm_items": len(texts), "minilm_s": round(dt, 2), "minilm_items_per_s": round(len(texts) / dt, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5k/50k items, 128 minilm items (< 60 s)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--items-path")
    ap.add_argument("--inter-path")
    ap.add_argument("--run-dir")
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--minilm-items", type=int, default=None,
                    help="encode only the first N demo items with minilm (default: all; 128 with --quick)")
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    small, large = (5_000, 50_000) if args.quick else (100_000, 1_000_000)
    with tempfile.TemporaryDirectory(prefix="gti_bench_ingest_") as tmp:
        runs = {n: _run_size(n, Path(tmp), args.batch_size) for n in (small, large)}
    mini = _minilm(args.minilm_items or (128 if args.quick else None))
    s, l = runs[small], runs[large]
    print(f"{'items':>10} {'ingest/s':>10} {'hash/s':>10} {'peak tree MB':>13} {'peak driver MB':>15}")
    for n, r in runs.items():
        print(f"{n:>10,} {r['ingest_items_per_s']:>10,.0f} {r['hash_embed_items_per_s']:>10,.0f} "
              f"{r['peak_tree_mb']:>13,.0f} {r['peak_driver_mb']:>15,.0f}")
    ratio = l["peak_tree_mb"] / s["peak_tree_mb"]
    driver_ratio = l["peak_driver_mb"] / s["peak_driver_mb"]
    print(f"peak memory ratio {large:,}/{small:,} items: tree {ratio:.2f}x, driver {driver_ratio:.2f}x")
    print(f"minilm: {mini['minilm_items_per_s']:.0f} items/s on {mini['minilm_items']} demo items; "
          f"hash/minilm speed ratio {l['hash_embed_items_per_s'] / mini['minilm_items_per_s']:.0f}x")
    print(json.dumps({
        "quick": args.quick,
        "sizes": [small, large],
        "rss_ratio_10x": round(ratio, 3),
        "driver_rss_ratio_10x": round(driver_ratio, 3),
        "ingest_items_per_s": l["ingest_items_per_s"],
        "hash_embed_items_per_s": l["hash_embed_items_per_s"],
        "ingest_items_per_s_small": s["ingest_items_per_s"],
        "hash_embed_items_per_s_small": s["hash_embed_items_per_s"],
        "peak_tree_mb": {str(small): s["peak_tree_mb"], str(large): l["peak_tree_mb"]},
        "peak_driver_mb": {str(small): s["peak_driver_mb"], str(large): l["peak_driver_mb"]},
        **mini,
    }))


if __name__ == "__main__":
    main()
