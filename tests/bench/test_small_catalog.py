"""bench/small_catalog/small_catalog.py (bench): the --quick run end to end on tiny.yaml: both arms
run, their output tables are identical, and the JSON line carries every stage's ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.bench
@pytest.mark.timeout(900)
def test_quick_run_prints_ratios_and_same_outputs():
    p = subprocess.run([sys.executable, "bench/small_catalog/small_catalog.py", "--quick"], cwd=ROOT,
                       capture_output=True, text=True, timeout=850)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["same_outputs"] is True
    for s in ("ingest", "embed", "sid", "pairs", "total"):
        assert out[f"local_over_ray_{s}"] > 0
