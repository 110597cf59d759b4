"""bench/proof/rl_vs_sft.py: per-user values from an evaluate output, the paired RL - SFT
differences, the refusal of unpaired runs, and the printed table and JSON line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from testkit import load_bench


def _bench():
    return load_bench("proof/rl_vs_sft")


def _metrics(ranks: list[int], hits10: list[float], users: list[str] | None = None, n_items: int = 5) -> dict:
    users = users or [f"u{i}" for i in range(len(ranks))]
    pu = {"user_ids": users, "exact_rank": ranks, "recall@10": hits10}
    for m in ("recall@5", "recall@20", "ndcg@10"):
        pu[m] = hits10
    table = {"value": 0.5, "ci": [0.1, 0.9]}
    return {"per_user": {"test": pu}, "ranks": {"test": {"n_items": n_items}},
            "slices": {"cold": {"test": {"n_users": 1, "model": {"recall@10": table},
                                         "ranks": {"mrr": table, "mean_percentile_rank": table}}}},
            "baselines": {"mostpop": {"test": {"recall@10": table, "ndcg@10": table}}},
            "baseline_ranks": {"mostpop": {"test": {"mrr": table}}}}


def test_per_user_rank_metrics_follow_rank_metrics_definitions():
    pu = _bench().per_user(_metrics([1, 2, 5], [1.0, 1.0, 0.0]))
    assert np.allclose(pu["mrr"], [1.0, 0.5, 0.2])
    assert np.allclose(pu["mean_percentile_rank"], [0.0, 0.25, 1.0])  # (rank - 1) / (N - 1), N = 5


def test_paired_differences_are_rl_minus_sft_on_the_same_users():
    b = _bench()
    sft, rl = _metrics([2, 2, 4, 4], [0.0, 0.0, 1.0, 0.0]), _metrics([1, 2, 4, 4], [1.0, 0.0, 1.0, 0.0])
    out = b.paired(sft, rl, boot=200)
    assert out["mrr"]["diff"] == pytest.approx((1.0 - 0.5) / 4)
    assert out["mrr"]["rl"] > out["mrr"]["sft"]
    assert out["recall@10"]["diff"] == pytest.approx(0.25)
    lo, hi = out["recall@10"]["ci"]
    assert 0.0 <= lo <= 0.25 <= hi  # only users who gained: the CI never goes below 0
    same = b.paired(sft, sft, boot=50)
    assert all(v["diff"] == 0.0 and v["ci"] == [0.0, 0.0] for v in same.values())


def test_runs_on_different_users_are_refused():
    b = _bench()
    with pytest.raises(SystemExit, match="different test users"):
        b.paired(_metrics([1, 2], [1.0, 0.0]), _metrics([1, 2], [1.0, 0.0], users=["u0", "x"]), boot=10)


def test_main_prints_the_table_and_one_json_line(tmp_path, monkeypatch, capsys):
    b = _bench()
    runs = {"a": _metrics([3, 3], [0.0, 0.0]), "b": _metrics([1, 3], [1.0, 0.0])}
    monkeypatch.setattr(b, "evaluate_output", lambda run_dir: runs[run_dir.name])
    monkeypatch.setattr(b, "rl_facts", lambda run_dir: {"best": {"step": 50}})
    out = tmp_path / "cmp.json"
    assert b.main(["--sft", str(tmp_path / "a"), "--rl", str(tmp_path / "b"), "--boot", "100", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| metric (test, 2 users)") and any(line.startswith("| mrr |") for line in lines)
    assert any(line.startswith("mostpop: recall@10 0.500 [0.100, 0.900]") for line in lines)
    figures = json.loads(lines[-1])
    assert figures == json.loads(out.read_text())
    assert figures["paired"]["recall@10"]["diff"] == pytest.approx(0.5)
    assert figures["rl_facts"] == {"best": {"step": 50}} and figures["cold"]["rl"]["n_users"] == 1
