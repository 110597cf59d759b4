"""Benchmark: catalog ingestion and content embedding throughput, and streaming memory.

Measures, side by side in one run:
- ingest items/s and hash-embedding items/s on synthetic catalogs of two sizes (10x apart:
  100k and 1M items; --quick: 5k and 50k), each size run by `gti.pipeline.run(to_stage="embed")`
  in its own subprocess with its own local Ray (2 CPUs);
- peak memory of each run's whole process tree (driver + Ray raylet/GCS/workers), sampled every
  0.25 s as the sum of PSS (proportional set size, so the shared object store is not counted
  once per process; RSS where PSS is unavailable), and the driver's own peak RSS. The ratio
  peak(10N) / peak(N) shows whether the stages stream (bounded memory) or hold the catalog;
- minilm items/s on the bundled demo catalog (first 128 items with --quick), encoder only.

The interactions are kept small and fixed (2,000 synthetic users) so the catalog dominates;
sequence building is a one-process polars step whose memory grows with the interaction count.

Usage: python bench/ingest_embed.py [--quick]. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
USERS = 2000


_KEYS = ("tree", "tree_anon", "tree_file", "tree_shmem", "driver", "driver_anon", "driver_file", "driver_shmem")


def _kb_fields(path: str, wanted: tuple[str, ...]) -> dict[str, int]:
    """`Name:   123 kB` lines of a /proc file -> {Name: bytes} for the wanted names."""
    out: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in wanted:
                out[name] = int(rest.split()[0]) * 1024
    return out


def _tree_memory(proc) -> dict[str, int]:
    """Memory of a process tree in bytes (the one sampler every bench script shares).

    tree*: sums over the process and all its descendants of PSS (proportional set size, so the
    shared Ray object store is not counted once per process), split into anonymous, file-backed
    (page cache of mapped files: reclaimable) and shared-memory (the /dev/shm object store)
    parts from /proc/<pid>/smaps_rollup. driver*: the process's own RSS and its RssAnon /
    RssFile / RssShmem split from /proc/<pid>/status. Where /proc lacks these (not Linux), the
    totals fall back to psutil's PSS or RSS and the splits read 0.
    """
    import psutil

    res = dict.fromkeys(_KEYS, 0)
    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.Error:
        return res
    for p in procs:
        try:
            try:
                m = _kb_fields(f"/proc/{p.pid}/smaps_rollup", ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem"))
            except OSError:
                m = {}
            if "Pss" in m:
                res["tree"] += m["Pss"]
                res["tree_anon"] += m.get("Pss_Anon", 0)
                res["tree_file"] += m.get("Pss_File", 0)
                res["tree_shmem"] += m.get("Pss_Shmem", 0)
            else:
                try:
                    mem = p.memory_full_info()
                    res["tree"] += getattr(mem, "pss", None) or mem.rss
                except (psutil.AccessDenied, AttributeError):
                    res["tree"] += p.memory_info().rss
            if p.pid == proc.pid:
                res["driver"] = p.memory_info().rss
                try:
                    st = _kb_fields(f"/proc/{p.pid}/status", ("RssAnon", "RssFile", "RssShmem"))
                except OSError:
                    st = {}
                res["driver_anon"] = st.get("RssAnon", 0)
                res["driver_file"] = st.get("RssFile", 0)
                res["driver_shmem"] = st.get("RssShmem", 0)
        except (psutil.Error, OSError):
            continue
    return res


class MemorySampler:
    """Samples `_tree_memory(psutil.Process(pid))` every `interval` s on a thread until
    `stop()`. `peak[key]` is each figure's own maximum; `at_peak["tree"]` / `at_peak["driver"]`
    hold the whole sample taken when the tree total / driver RSS peaked (so the anon/file
    split of that moment)."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.interval = interval
        self.peak = dict.fromkeys(_KEYS, 0)
        self.at_peak: dict[str, dict[str, int]] = {"tree": dict(self.peak), "driver": dict(self.peak)}
        self.samples = 0
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._loop, daemon=True)
        self._th.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            m = _tree_memory(self.proc)
            self.samples += 1
            for k in ("tree", "driver"):
                if m[k] > self.peak[k]:
                    self.at_peak[k] = m
            for k, v in m.items():
                self.peak[k] = max(self.peak[k], v)
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._th.join()


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
    sampler = MemorySampler(proc.pid)
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
    from gti import config, pipeline
    from gti.stages._ray import ensure_ray

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
