"""bench/refresh.py --quick end to end (tiny model, 300 items, 12 new): the three arms run and
the last line is one JSON object with their figures and wall times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(1500)
def test_refresh_bench_quick(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "refresh.py"), "--quick", "--work", str(tmp_path / "w")],
                          capture_output=True, text=True, timeout=1450, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["bench"] == "refresh" and out["mode"] == "quick" and out["assigned"] == 12
    assert set(out["arms"]) == {"refresh", "assign_only", "retrain"}
    for arm in out["arms"].values():
        assert arm["wall_s"] > 0
        assert arm["new_target"]["n_users"] == out["n_users"]["new_target"] > 0
        assert 0 <= arm["new_target"]["recall@5"] <= 1 and 0 < arm["new_target"]["mrr"] <= 1
    assert out["arms"]["refresh"]["steps"]["ground"] == 6
