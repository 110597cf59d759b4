"""gti.refresh.ingest: new items and interactions validated as ingest does, unknown items
quarantined against the parent's map + the new items, histories merged with the parent's
(on the fake run of conftest.py: a0..a4 known; u1 saw a0 a2 a3, u2 a1 a4 a0)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from gti.common.errors import DataError
from gti.refresh.ingest import ingest_step

ITEMS = "item_id,title\nn1,New beaker\nn2,New flask\nn1,Duplicate\n,No id\n"


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def _reasons(path) -> list[str]:
    return sorted(pq.read_table(str(path)).column("reason").to_pylist())


def test_items_only(make_job, tmp_path):
    job = make_job(_write(tmp_path, "items.csv", ITEMS))
    f = ingest_step(job)
    out = job.work / "ingest"
    assert pq.read_table(str(out / "items.parquet")).column("item_id").to_pylist() == ["n1", "n2"]
    assert _reasons(out / "items_quarantine.parquet") == ["duplicate_id", "missing_id"]
    assert f == {"items_rows_in": 4, "items_rows_ok": 2, "items_rows_quarantined": 2,
                 "items_quarantine_reasons": {"duplicate_id": 1, "missing_id": 1}}
    assert not (out / "interactions.parquet").exists()
    assert any("2 new items ok, 2 quarantined" in m for m in job.logs)
    (out / "stale.txt").write_text("x")
    ingest_step(job)  # a rerun starts the folder afresh
    assert not (out / "stale.txt").exists()


def test_new_interactions_are_checked_and_merged_with_the_parents(make_job, tmp_path):
    inter = _write(tmp_path, "inter.csv", "user_id,item_id,ts\n"
                   "u1,n1,10\nu3,n2,11\nu3,a1,12\nu3,n1,13\nu1,zz,14\n,n1,15\nu4,n2,16\n")
    job = make_job(_write(tmp_path, "items.csv", ITEMS), inter)
    f = ingest_step(job)
    out = job.work / "ingest"
    # zz is in neither map; the row without a user fails the row check; u4 has 1 interaction.
    assert _reasons(out / "interactions_quarantine.parquet") == ["missing_user", "short_sequence", "unknown_item"]
    assert f["interactions_rows_in"] == 7 and f["interactions_rows_ok"] == 4
    assert f["interactions_rows_in"] == f["interactions_rows_ok"] + f["interactions_rows_quarantined"]
    assert f["interactions_quarantine_reasons"] == {"unknown_item": 1, "missing_user": 1, "short_sequence": 1}
    seqs = {r["user_id"]: r for r in pq.read_table(str(out / "sequences.parquet")).to_pylist()}
    assert seqs["u1"]["train_items"] == ["a0", "a2"] and seqs["u1"]["valid_item"] == "a3"
    assert seqs["u1"]["test_item"] == "n1"  # the new interaction ends u1's history
    assert seqs["u2"]["test_item"] == "a0"  # an old user without new interactions is unchanged
    assert (seqs["u3"]["train_items"], seqs["u3"]["valid_item"], seqs["u3"]["test_item"]) == (["n2"], "a1", "n1")
    assert f["n_users"] == 3
    touched = pq.read_table(str(out / "touched_users.parquet")).column("user_id").to_pylist()
    assert touched == ["u1", "u3"] and f["touched_users"] == 2
    assert pq.read_table(str(out / "interactions.parquet")).num_rows == 6 + 4


def test_without_ts_the_file_order_comes_after_the_parents_clock(make_job, tmp_path):
    inter = _write(tmp_path, "inter.csv", "user_id,item_id\nu2,n1\nu2,n2\n")
    job = make_job(_write(tmp_path, "items.csv", ITEMS), inter, "data.interactions.columns.ts=null")
    ingest_step(job)
    t = pq.read_table(str(job.work / "ingest" / "interactions.parquet")).to_pylist()
    new_ts = {r["item_id"]: r["ts"] for r in t if r["item_id"].startswith("n")}
    assert new_ts == {"n1": 7, "n2": 8}  # the parent's last ts is 6
    seqs = {r["user_id"]: r for r in pq.read_table(str(job.work / "ingest" / "sequences.parquet")).to_pylist()}
    assert seqs["u2"]["valid_item"] == "n1" and seqs["u2"]["test_item"] == "n2"


def test_no_valid_new_interaction_is_one_data_error(make_job, tmp_path):
    inter = _write(tmp_path, "inter.csv", "user_id,item_id,ts\nu1,zz,10\n")
    job = make_job(_write(tmp_path, "items.csv", ITEMS), inter)
    with pytest.raises(DataError, match=r"no valid new interactions \(1 rows read; unknown_item: 1\)"):
        ingest_step(job)


# A run made with data.split: global_time (conftest.write_time_split_run, ratios 1:1:1): cut ts
# 3 and 5; u1 a0 | a2 | a3, u2 a1 | a4 | a0 (a1 ties the valid cut at ts 3 in train).
TIME_NEW = ("user_id,item_id,ts\n"
            "u1,n1,10\n"  # after the test cut: u1's test period
            "u2,n2,2\n"  # before the valid cut: u2's train period, before a1
            "u3,n1,0\nu3,n2,3\nu3,a1,7\n")  # a new user: one item in each period (ts 3: at the valid cut)


def _seqs(job):
    return {r["user_id"]: r for r in pq.read_table(str(job.work / "ingest" / "sequences.parquet")).to_pylist()}


def _periods(r):
    return r["train_items"], r["valid_items"], r["test_items"]


def test_a_time_split_run_splits_new_interactions_by_its_ingest_cuts(time_split_run, job_on, tmp_path):
    run = time_split_run()
    before = _seqs(SimpleNamespace(work=run.dir))
    assert _periods(before["u1"]) == (["a0"], ["a2"], ["a3"]) and _periods(before["u2"]) == (["a1"], ["a4"], ["a0"])
    job = job_on(run, _write(tmp_path, "items.csv", ITEMS), _write(tmp_path, "inter.csv", TIME_NEW))
    f = ingest_step(job)
    s = _seqs(job)
    assert _periods(s["u1"]) == (["a0"], ["a2"], ["a3", "n1"])  # leave-one-out would make a3 valid, n1 the test
    assert _periods(s["u2"]) == (["n2", "a1"], ["a4"], ["a0"])  # valid/test unchanged; a1 kept in train
    assert _periods(s["u3"]) == (["n1"], ["n2"], ["a1"])
    assert all(r["valid_item"] is None and r["test_item"] is None for r in s.values())
    assert f["split"] == {"name": "global_time", "by": "timestamp", "cut_ts": [3, 5],
                          "interactions": {"train": 4, "valid": 3, "test": 4}}
    assert f["interactions_rows_ok"] == 5 and f["touched_users"] == 3


def test_a_time_split_run_without_recorded_cuts_is_refused_with_one_line(time_split_run, job_on, tmp_path):
    from gti.refresh.attempt import RefreshError
    from gti.refresh.command import refresh

    run = time_split_run(record_cuts=False)
    items, inter = _write(tmp_path, "items.csv", ITEMS), _write(tmp_path, "inter.csv", TIME_NEW)
    missing = r"ingest/_manifest.json has no facts.split.cut_ts \(the cut timestamps of data.split=global_time"
    with pytest.raises(RefreshError, match=missing) as err:
        refresh(run.dir, items, inter)
    assert "\n" not in str(err.value) and "gti stage ingest --config" in str(err.value)
    assert not (run.dir / "refresh" / ".v1.partial").exists()  # refused before any work
    with pytest.raises(RefreshError, match=missing):
        ingest_step(job_on(run, items, inter))
    refresh_items_only = job_on(run, items)  # new items alone are not split: no refusal
    assert ingest_step(refresh_items_only)["items_rows_ok"] == 2


def test_a_split_other_than_the_runs_or_a_parent_split_otherwise_is_refused(time_split_run, job_on, tmp_path):
    from gti.refresh.attempt import RefreshError

    run = time_split_run()
    items, inter = _write(tmp_path, "items.csv", ITEMS), _write(tmp_path, "inter.csv", TIME_NEW)
    with pytest.raises(RefreshError, match=r"data.split=leave_one_out, but the run's ingest split global_time"):
        ingest_step(job_on(run, items, inter, "data.split=leave_one_out"))
    # A parent refresh made before refresh kept the periods (no ingest.split in its facts).
    job = job_on(run, items, inter)
    job.parent = replace(job.parent, sequences_split=None)
    with pytest.raises(RefreshError, match=r"its sequences were split \(not recorded\), not by the run's"):
        ingest_step(job)
