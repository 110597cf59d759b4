"""bench/refresh/full_group.py: how a placement is scored (pure: family kept, cosine to the
group's other items) and (bench) the --quick run end to end: 12 near-identical new items
overflow a group of the small map; adding tokens keeps them in the family's group and serves
them, widening moves them to other groups."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from testkit import load_bench

ROOT = Path(__file__).resolve().parents[2]


def test_placement_scores_family_and_group_similarity():
    b = load_bench("refresh/full_group")
    emb = {"src": np.array([1.0, 0.0]), "f0": np.array([1.0, 0.1]), "f1": np.array([0.9, 0.1]),
           "other": np.array([0.0, 1.0])}
    together = {"src": (1, 2), "f0": (1, 2), "f1": (1, 2), "other": (3, 4)}
    out = b.placement(together, emb, ["f0", "f1"], ["f0", "f1"], "src")
    assert out["family_kept"] == 1.0 and out["group_cosine"] > 0.99 and out["n"] == 2
    apart = {"src": (1, 2), "f0": (3, 4), "f1": (3, 4), "other": (3, 4)}
    far = b.placement(apart, emb, ["f0", "f1"], ["f0", "f1"], "src")
    assert far["family_kept"] == 0.0 and far["group_cosine"] < out["group_cosine"]


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(900)
def test_full_group_bench_quick(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "refresh" / "full_group.py"), "--quick",
                           "--work", str(tmp_path)], capture_output=True, text=True, timeout=850, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["overflow"] >= 1 and out["add_tokens"]["served"] is True
    assert out["add_tokens"]["family_kept"] == 1.0 and out["add_tokens"]["added_tokens"] >= 1
    assert out["widen"]["added_tokens"] == 0 and out["widen"]["placed"] == out["overflow"]
    assert out["widen"]["extra_quant_cost"] >= 1.0
