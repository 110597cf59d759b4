"""bench/serve/soak.py: how a cycle's version mix is read from the answers (pure), and (bench) the
--quick soak end to end (the tiny run, 2 replicas, 16 clients, ~50 s, refreshes published and
reloaded every 15 s): no failed request, every cycle settled with one version, RSS reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from testkit import load_bench

ROOT = Path(__file__).resolve().parents[2]


def test_a_cycle_is_mixed_when_answers_after_settling_name_two_versions():
    b = load_bench("serve/soak")
    marks = [{"version": 2, "refresh_s": 3.0, "reload_status": 202, "settle_s": 1.0, "t_start": 7.0,
              "t_reload": 10.0, "t_settled": 11.0, "rss_mb": {}},
             {"version": 3, "refresh_s": 3.0, "reload_status": 202, "settle_s": 1.0, "t_start": 17.0,
              "t_reload": 20.0, "t_settled": 21.0, "rss_mb": {}}]
    # 18.5: v3 published by the second cycle's refresh, taken by a poll before its reload: not a mix
    answers = [(10.5, True, 1, 0.1), (11.5, True, 2, 0.1), (15.0, True, 2, 0.1), (16.9, True, 2, 0.1),
               (18.5, True, 3, 0.1), (20.5, True, 2, 0.1), (21.5, True, 3, 0.1), (22.0, True, 2, 0.1),
               (23.0, False, None, 0.1), (12.0, True, 1, 2.0)]
    out = b.summarise(answers, marks, end=30.0)
    assert [c["versions_after_settle"] for c in out] == [[2], [2, 3]]
    assert [c["mixed"] for c in out] == [False, True]
    # (12.0, v1, 2.0 s): sent at 10.0, before the first cycle settled: an old answer in flight, not a mix
    assert [c["old_in_flight"] for c in out] == [1, 0]


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(1500)
def test_serve_soak_quick(serve_bench_work):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serve" / "soak.py"), "--quick", "--work",
                           str(serve_bench_work)], capture_output=True, text=True, timeout=1450, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["bench"] == "serve-soak" and out["replicas"] == 2 and out["clients"] == 16
    assert out["requests"] > 0 and out["failed_requests"] == 0 and out["cycle_errors"] == []
    assert len(out["cycles"]) >= 1 and out["mixed_cycles"] == 0
    # 409: the replicas' poll had taken the published version and was loading it when the
    # reload came; the cycle still has to settle with one version.
    assert all(c["reload_status"] in (202, 409) and len(c["versions_after_settle"]) <= 1 for c in out["cycles"])
    assert len(out["rss_mb_start"]) == 2 and all(v for v in out["rss_mb_end"].values())
    assert not list(serve_bench_work.glob("soak-*"))  # the run's copy is gone


def test_fleet_reads_until_every_replica_gave_its_memory(monkeypatch):
    """The router may send many /info calls in a row to one idle replica: the fleet's memory
    must still name every replica (the quick soak once ended with one replica's rss missing)."""
    import httpx

    b = load_bench("serve/soak")
    board = {"each": {"a": {"version": 1}, "b": {"version": 1}}}
    calls = []

    class _Resp:
        def __init__(self, rid):
            self.rid = rid

        def json(self):
            return {"replicas": board, "replica": {"id": self.rid, "rss_mb": 100.0 if self.rid == "a" else 200.0}}

    def get(url, timeout):
        calls.append(url)
        return _Resp("a" if len(calls) <= 15 else "b")  # 15 calls to a before b answers

    monkeypatch.setattr(httpx, "get", get)
    out = b.fleet("http://x", 12)
    assert out == {"a": {"version": 1, "rss_mb": 100.0}, "b": {"version": 1, "rss_mb": 200.0}}
    assert len(calls) == 16
    calls.clear()
    assert b.fleet("http://x", 6, most=6)["b"].get("rss_mb") is None and len(calls) == 6
