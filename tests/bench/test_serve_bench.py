"""bench/serve/serve.py: its pure parts (how a version switch is read from the answers, the top-K
comparison, the latency percentiles) and (bench) the --quick run end to end on the tiny run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from testkit import load_bench

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    return load_bench("serve/serve")


def test_a_switch_is_one_change_of_version_never_back():
    b = _bench()
    assert b.switch_seen([0, 0, 1, 1]) == "0->1"
    assert b.switch_seen([0, 0, 0]) is False  # never switched
    assert b.switch_seen([0, 1, 0, 1]) is False  # went back: answers of both versions interleaved
    assert b.switch_seen([]) is False


def test_top_k_of_the_service_arms_is_compared_with_recommend_on_its_histories():
    b = _bench()
    ref = {0: [("a", -1.0), ("b", -2.0)], 1: [("c", -1.0), ("d", -3.0)]}
    same = {"recommend": ref, "batched": {0: [("a", -1.00002), ("b", -2.0)], 5: [("x", 0.0)]},
            "unbatched": {1: [("c", -1.0), ("d", -3.0)]}}
    out = b.compare(same)
    assert out["identical_topk"] and out["topk_histories_compared"] == 2 and out["max_score_diff"] < 1e-4
    swapped = {**same, "unbatched": {1: [("d", -3.0), ("c", -1.0)]}}
    assert b.compare(swapped)["identical_topk"] is False
    assert b.compare({"recommend": ref})["identical_topk"] is False  # nothing compared proves nothing


def test_serve_figures_give_the_replica_busy_share_and_requests_per_decode():
    arm = lambda ok, wall, decode_s, decodes: {"ok": ok, "wall": wall, "lat": [0.1] * ok, "errors": 0,  # noqa: E731
                                               "decode_s": decode_s, "decodes": decodes, "decoded": ok}
    acc = {"answers": {}, "largest_batch": {"batched": 16, "unbatched": 1},
           "batched@16": arm(96, 12.0, 11.4, 6), "unbatched@16": arm(32, 16.0, 14.4, 32),
           "batched@64": arm(128, 20.0, 19.0, 8), "unbatched@64": arm(32, 16.0, 15.0, 32),
           "recommend": arm(4, 4.0, 0.0, 0)}
    out = _bench().serve_figures(acc)
    assert out["replica_busy"] == {"batched@16": 0.95, "unbatched@16": 0.9, "batched@64": 0.95, "unbatched@64": 0.938}
    assert out["mean_batch"]["batched@16"] == 16.0 and out["mean_batch"]["unbatched@16"] == 1.0
    assert "recommend" not in out["replica_busy"]  # not a service arm
    assert out["batched_over_unbatched"] == 4.0


def test_percentiles_are_in_milliseconds():
    out = _bench().percentiles([0.1] * 99 + [1.0])
    assert out["p50_ms"] == 100.0 and 100.0 < out["p99_ms"] <= 1000.0


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(1500)
def test_serve_bench_quick(tmp_path):
    """The tiny run built in tmp_path, every arm, the reload and infer vs evaluate; the last
    line is one JSON object with the issue's keys."""
    script = ROOT / "bench" / "serve" / "serve.py"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--work", str(tmp_path)],
                          capture_output=True, text=True, timeout=1450, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["bench"] == "serve" and out["mode"] == "quick"
    from gti.config.serve import ServeConfig
    assert out["batch_wait_timeout_s"] == ServeConfig().batch_wait_for("cpu") == 0.25  # no --batch-wait: the default
    arms = {"batched@16", "unbatched@16", "batched@64", "unbatched@64", "recommend"}
    assert set(out["requests_per_s"]) == set(out["p50_ms"]) == set(out["p99_ms"]) == arms
    assert all(v > 0 for v in out["requests_per_s"].values()) and out["batched_over_unbatched"] > 0
    assert out["errors"] == 0 and out["identical_topk"] is True and out["topk_histories_compared"] > 0
    assert out["largest_batch"]["unbatched"] == 1 and out["largest_batch"]["batched"] > 1
    assert out["reload_failed_requests"] == 0 and out["reload_version_switch_seen"] == "0->1"
    assert out["reload_bad_identity"] == 0 and out["reload_status"]["state"] == "swapped"
    assert out["infer_users_per_s"] > 0 and out["evaluate_decode_users_per_s"] > 0
    assert out["infer_matches_evaluate"] is True
    assert out["decode_batch_ceiling"] > 0 and out["decode_ceiling_histories"] == 16
    assert all(v > 0 for v in out["decode_ceiling_s"].values())
    assert len(out["load_avg_start"]) == len(out["load_avg_end"]) == 3
