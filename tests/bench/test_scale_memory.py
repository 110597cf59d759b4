"""bench/scale_memory/scale_memory.py: the pure parts (echo parsing, overrides, ratios), the
memory sampler of the shared bench/common.py, and (slow) one tiny end-to-end run."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from testkit import load_bench

ROOT = Path(__file__).resolve().parents[2]




@pytest.fixture(scope="module")
def sm():
    return load_bench("scale_memory/scale_memory")


def test_parse_echo_splits_ran_and_skipped(sm):
    lines = [
        "[1/3] ingest: up to date, skipped",
        "[2/3] embed: up to date, skipped",
        "[3/3] sid: RQ-VAE semantic IDs ...",
        "[3/3] sid: done in 12.3s -> /tmp/run/sid",
        "something else",
    ]
    assert sm.parse_echo(lines) == (["sid"], ["ingest", "embed"])


def test_overrides_load_and_keep_earlier_stages_identical(sm, tmp_path):
    from gti import config

    ns = argparse.Namespace(run_dir=str(tmp_path / "run"), items_path=str(tmp_path / "i"),
                            inter_path=str(tmp_path / "u"), batch_size=512, kmeans_sample=1024, set=None)
    cfg = config.load(None, sm.stage_overrides(ns))
    assert cfg.sid.method == "rqkmeans" and cfg.sid.levels == 4 and cfg.sid.codebook_size == 256
    assert cfg.sid.kmeans_sample == 1024 and cfg.embed.encoder == "hash" and cfg.embed.dim == 256
    assert cfg.ray_num_cpus == 2
    # --set adds overrides to every stage (here the sid stage's memory knobs).
    ns.set = ["sid.resolve_cache_mb=128", "sid.resolve_bucket_rows=524288"]
    cfg = config.load(None, sm.stage_overrides(ns))
    assert cfg.sid.resolve_cache_mb == 128 and cfg.sid.resolve_bucket_rows == 524288


def test_stages_are_consecutive_and_a_late_start_needs_a_workdir(sm):
    assert sm.parse_stages("ingest,embed", None) == ["ingest", "embed"]
    assert sm.parse_stages("sid", "/kept") == ["sid"]
    assert sm.parse_stages("embed, sid", "/kept") == ["embed", "sid"]
    with pytest.raises(SystemExit, match="consecutive"):
        sm.parse_stages("ingest,sid", None)
    with pytest.raises(SystemExit, match="consecutive"):
        sm.parse_stages("tune", None)
    with pytest.raises(SystemExit, match="--workdir of a run that did ingest,embed"):
        sm.parse_stages("sid", None)


def test_summarise_ratios_and_bytes_per_item(sm):
    def r(tree, drv, anon):
        return {"peak_tree_mb": tree, "peak_driver_mb": drv, "peak_driver_anon_mb": anon}

    runs = {1_000: {"sid": r(100.0, 50.0, 40.0)}, 5_000: {"sid": r(150.0, 100.0, 60.0)}}
    q = sm.summarise(runs, ["sid"])["sid"]
    assert q["tree_ratio"] == 1.5 and q["driver_ratio"] == 2.0 and q["driver_anon_ratio"] == 1.5
    assert q["driver_bytes_per_item"] == round(50 * 2**20 / 4_000, 1)
    assert q["driver_anon_bytes_per_item"] == round(20 * 2**20 / 4_000, 1)


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc")
def test_tree_memory_sees_children_and_splits_the_driver():
    import psutil

    mem = load_bench("common")
    child = subprocess.Popen([sys.executable, "-c",
                              "import time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); "
                              "time.sleep(30)"])
    try:
        time.sleep(1.5)
        parent = mem.tree_memory(psutil.Process())
        parts = parent["tree_anon"] + parent["tree_file"] + parent["tree_shmem"]
        assert parts == pytest.approx(parent["tree"], rel=0.05)
        assert parent["tree_anon"] >= 60 << 20  # the tree includes the child's touched 64 MB
        sampler = mem.MemorySampler(child.pid, interval=0.05)
        time.sleep(0.5)
        sampler.stop()
        assert sampler.samples >= 2
        pk, at = sampler.peak, sampler.at_peak["driver"]
        assert pk["driver_anon"] >= 60 << 20  # the touched 64 MB bytearray is anonymous memory
        assert at["driver_anon"] + at["driver_file"] + at["driver_shmem"] == pytest.approx(at["driver"], rel=0.05)
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.ray
def test_quick_run_prints_per_stage_figures(tmp_path):
    """A tiny run (2k/4k items): every stage in its own subprocess, earlier stages skipped."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale_memory" / "scale_memory.py"), "--quick", "--sizes", "2000,4000",
         "--kmeans-sample", "1024", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=460,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["sizes"] == [2000, 4000] and set(res["stages"]) == {"ingest", "embed", "sid"}
    for st, by_size in res["stages"].items():
        for n, r in by_size.items():
            assert r["peak_tree_mb"] > r["peak_driver_mb"] > 0, (st, n, r)
            assert r["wall_s"] > 0 and r["items_per_s"] > 0
    assert set(res["ratios"]) == {"ingest", "embed", "sid"}
    sid = res["stages"]["sid"]["4000"]
    assert sid["collision_rate_after"] == 0.0
    # The stage's own per-phase driver peaks are carried through and printed.
    assert sid["driver_peak_mb"]["assign_peak_mb"] > 0 and "driver peak MB by phase: " in out.stdout


def test_summarise_gives_no_ratio_for_a_killed_or_missing_stage(sm):
    ok = {"peak_tree_mb": 1.0, "peak_driver_mb": 1.0, "peak_driver_anon_mb": 1.0}
    killed = dict(ok, error="killed by signal 9 after 60s")
    runs = {10: {"embed": ok, "sid": ok}, 20: {"embed": killed}}
    assert sm.summarise(runs, ["embed", "sid"]) == {"embed": None, "sid": None}
