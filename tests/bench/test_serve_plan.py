"""bench/serve/plan.py: its pure parts (percentiles p50/p95/p99, the decode sizes seen between two
reads of a replica's counts, the per-arm figures, the history lengths, the synthetic catalog
run) and (bench) the --quick run end to end: both arms at 1, 16 and 64 clients at the serving
defaults, the decode sizes, and the catalog's memory and search latency."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from testkit import load_bench

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    return load_bench("serve/plan")


def test_percentiles_p50_p95_p99_in_milliseconds():
    out = _bench().percentiles([0.1] * 90 + [1.0] * 10)
    assert out["p50_ms"] == 100.0 and out["p95_ms"] == 1000.0 and out["p99_ms"] == 1000.0


def test_decode_sizes_seen_are_the_difference_of_two_reads():
    b = _bench()
    assert b.size_diff({"1": 3, "16": 5, "7": 2}, {"1": 3, "16": 1}) == {"7": 2, "16": 4}
    assert b.size_diff({}, {}) == {}


def test_arm_figures_give_each_arm_at_each_client_count():
    b = _bench()
    acc = {f"{a}@{n}": {"ok": 10, "wall": 5.0 if a == "batched" else 20.0, "lat": [0.2] * 10, "errors": 0,
                        "sizes": {"4": 3}, "largest": 4} for a in ("batched", "unbatched") for n in b.CLIENTS}
    out = b.arm_figures({**acc, "replica_rss_mb": 700.0})
    assert out["requests_per_s"]["batched@16"] == 2.0 and out["batched_over_unbatched"] == {"1": 4.0, "16": 4.0,
                                                                                               "64": 4.0}
    assert out["p95_ms"]["unbatched@64"] == 200.0 and out["decode_sizes"]["batched@1"] == {"4": 3}
    assert out["replica_rss_mb"] == 700.0


def test_history_lengths():
    out = _bench().history_lengths([["a"], ["a", "b", "a"], ["c", "d"]])
    assert out == {"min": 1, "p50": 2.0, "mean": 2.0, "max": 3, "distinct_mean": 1.67}


def test_the_synthetic_catalog_run_loads_as_a_replica_loads_it(tmp_path):
    b = _bench()
    b.write_catalog_run(tmp_path / "run", 500)
    out = b.catalog_child(tmp_path / "run", "cpu", 2)
    assert out["items"] == 500 and out["search_ms"]["exact_id"]["hits"] == 1
    assert out["search_ms"]["rare"]["hits"] >= 1 and out["search_ms"]["absent"]["hits"] == 0
    assert out["search_ms"]["empty"]["hits"] == 20 and out["rss_mb"]["loaded"] > 0 and out["recommend_s"] > 0


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(1500)
def test_serve_plan_quick(serve_bench_work):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serve" / "plan.py"), "--quick", "--work",
                           str(serve_bench_work)], capture_output=True, text=True, timeout=1450, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    arms = {f"{a}@{n}" for a in ("batched", "unbatched") for n in (1, 16, 64)}
    assert out["bench"] == "serve-plan" and out["defaults"]["exclude_history"] is True
    assert set(out["requests_per_s"]) == set(out["p95_ms"]) == set(out["p99_ms"]) == arms
    assert all(v == 0 for v in out["errors"].values()) and all(v > 0 for v in out["requests_per_s"].values())
    assert set(out["batched_over_unbatched"]) == {"1", "16", "64"}
    assert all(set(s) == {"1"} for a, s in out["decode_sizes"].items() if a.startswith("unbatched"))
    assert max(int(k) for k in out["decode_sizes"]["batched@16"]) > 1  # gathered
    assert out["catalog"]["items"] == 50_000 and out["catalog"]["rss_mb"]["indexed"] > 0
