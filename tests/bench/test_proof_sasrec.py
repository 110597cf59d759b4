"""bench/proof/proof_sasrec.py: the paired rows on toy records, and (bench) its quick mode end to end on
the proof configuration's data, built from the bundled set in process (no Ray), with
bench/proof/proof_summary.py reading its output and rebuilding the report from it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from testkit import load_bench

ROOT = Path(__file__).resolve().parents[2]




def _record(arm: str, seed: int, recall: list[float], ranks: list[float], users=("a", "b", "c", "d")):
    from gti.diagnostics.runs import RunRecord

    pu = {"user_ids": list(users), "recall@5": recall, "exact_rank": ranks}
    return RunRecord(arm=arm, seed=seed, config={"seed": seed},
                     metrics={"per_user": {"test": pu}, "ranks": {"test": {"n_items": 11}}})


def test_rows_and_pairs_pair_each_record_and_each_pooled_arm_with_sasrec():
    """A record's row is the mean of its per-user values; the pooled row averages each user over
    the arm's seeds; a paired difference is mean(arm - SASRec) over the same users, whose CI holds it."""
    ps = load_bench("proof/proof_sasrec")
    users = ["a", "b", "c", "d"]
    recs = [({}, _record("gti", 0, [1, 0, 1, 0], [1, 2, 1, 5])), ({}, _record("gti", 1, [1, 1, 0, 0], [1, 1, 3, 11])),
            ({}, _record("mean", 0, [0, 0, 0, 1], [6, 6, 6, 1]))]
    sas = _record("sasrec", 0, [0, 1, 1, 0], [2, 1, 1, 4])
    rows, pairs = ps.rows_and_pairs(recs, sas, users, n_boot=200, seed=0)
    assert list(rows) == ["gti seed 0", "gti seed 1", "gti (2 seeds pooled)", "mean seed 0", "SASRec"]
    assert rows["gti seed 0"]["recall@5"]["value"] == 0.5
    assert rows["gti (2 seeds pooled)"]["recall@5"]["value"] == 0.5
    assert abs(rows["gti seed 1"]["mrr"]["value"] - np.mean([1, 1, 1 / 3, 1 / 11])) < 1e-12
    assert rows["gti seed 1"]["mean_percentile_rank"]["value"] == np.mean([0, 0, 0.2, 1.0])
    d = pairs["gti (2 seeds pooled) - SASRec"]["mrr"]
    want = np.mean([(1 + 1) / 2 - 1 / 2, (1 / 2 + 1) / 2 - 1, (1 + 1 / 3) / 2 - 1, (1 / 5 + 1 / 11) / 2 - 1 / 4])
    assert abs(d["diff"] - want) < 1e-12 and d["ci"][0] <= d["diff"] <= d["ci"][1]
    assert set(pairs) == {f"{k} - SASRec" for k in rows if k != "SASRec"}
    assert ps.f3(-0.0001, sign=True) == "+.000" and ps.f3(0.1234) == ".123"


def test_records_with_other_test_users_are_refused():
    ps = load_bench("proof/proof_sasrec")
    recs = [({}, _record("gti", 0, [1, 0, 1, 0], [1, 2, 1, 5])),
            ({}, _record("mean", 0, [1, 0, 1, 0], [1, 2, 1, 5], users=("a", "b", "d", "c")))]
    with pytest.raises(SystemExit, match="other test users"):
        ps.test_users(recs)



def test_given_epochs_turn_the_valid_sweep_off():
    """--quick's 2 epochs train: eval.sasrec.sweep (on by default, its own epochs values) is off
    whenever epochs are given; without them the config's block is passed as it is."""
    from gti.config.eval import SasrecConfig

    ps = load_bench("proof/proof_sasrec")
    block = SasrecConfig().model_dump()
    assert block["sweep"]["enabled"]
    assert ps.sasrec_params(block, None) == block
    quick = ps.sasrec_params(block, 2)
    assert quick["epochs"] == 2 and quick["sweep"]["enabled"] is False
    assert {**quick, "epochs": block["epochs"], "sweep": block["sweep"]} == block
    assert block["sweep"]["enabled"] and block["epochs"] == SasrecConfig().epochs  # not changed in place


def test_reference_feeds_sasrec_its_own_histories(monkeypatch):
    """SASRec reads each test user's whole training sequence (train items + valid item), as the
    evaluate stage's `reference_frames` passes it, not the LM's last data.max_history items."""
    from types import SimpleNamespace

    import polars as pl

    from gti.config.eval import EvalConfig
    from gti.eval import reference as R

    seqs = pl.DataFrame({"user_id": ["u1", "u2"], "train_items": [["a", "b", "c", "d"], ["b", "c"]],
                         "valid_item": ["e", "d"], "test_item": ["f", "a"]})
    seen: dict = {}

    class Model:
        facts = {"epochs": 2, "train_seconds": 0.1}

        def ranked_and_ranks(self, histories, targets, k, exact_rank):
            seen["histories"], seen["targets"] = histories, targets
            return [["a"] * k for _ in targets], [1.0 for _ in targets]

    def fit(seqs_, catalog, names, max_history, params, seed, log):
        seen["params"] = params
        return {"sasrec": Model()}

    monkeypatch.setattr(R, "fit_reference_models", fit)
    monkeypatch.setattr(R, "reference_block", lambda *a: {"baselines": {}})
    cfg = SimpleNamespace(eval=EvalConfig(), data=SimpleNamespace(max_history=2), seed=0)
    ps = load_bench("proof/proof_sasrec")
    ref, facts = ps.reference(seqs, ["a", "b", "c", "d", "e", "f"], ["u1", "u2"], cfg, 2)
    assert seen["histories"] == [["a", "b", "c", "d", "e"], ["b", "c", "d"]] and seen["targets"] == ["f", "a"]
    assert seen["params"]["epochs"] == 2 and not seen["params"]["sweep"]["enabled"]
    assert facts["params"] is seen["params"] and ref == {"baselines": {}}


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_proof_sasrec_quick(tmp_path):
    """The quick mode (30 of the records' users, 2 SASRec epochs): the rebuilt data has the
    records' hashes and users, MostPop/Markov equal the records' figures, SASRec's record is
    aligned with its users, every record and pooled arm is paired with it; proof_summary reads
    it and rebuilds the report with SASRec as its last arm."""
    out = tmp_path / "sasrec.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "proof" / "proof_sasrec.py"), "--quick", "--work",
                           str(tmp_path / "w"), "--out", str(out)], capture_output=True, text=True, timeout=550,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    doc = json.loads(out.read_text())
    assert doc["mode"] == "quick" and doc["n_users"] == 30 and doc["data"]["identity"]["all_match"]
    assert all(c["match"] for c in doc["baseline_check"].values()) and len(doc["baseline_check"]) >= 1
    pu = doc["record"]["metrics"]["per_user"]["test"]
    assert pu["user_ids"] == doc["user_ids"] and len(pu["exact_rank"]) == len(pu["recall@10"]) == 30
    assert doc["sasrec"]["facts"]["epochs"] == 2 and 0 < doc["sasrec"]["metrics"]["mrr"]["value"] <= 1
    assert "SASRec" in doc["rows"] and any(k.startswith("gti seed") for k in doc["paired"])
    for p in doc["paired"].values():
        assert all(p[m]["ci"][0] <= p[m]["diff"] <= p[m]["ci"][1] for m in p)
    assert "| **SASRec** |" in proc.stdout
    rep = tmp_path / "report"
    summ = subprocess.run([sys.executable, str(ROOT / "bench" / "proof" / "proof_summary.py"), "--sasrec", str(out),
                           "--report", str(rep)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert summ.returncode == 0, summ.stderr[-3000:]
    assert "vs sasrec:" in summ.stdout and "paired differences vs SASRec" in summ.stdout
    report = json.loads((rep / "report.json").read_text())
    assert report["arms"][-1] == "sasrec" and any(r["group"] == "test vs sasrec" for r in report["pairwise"])
