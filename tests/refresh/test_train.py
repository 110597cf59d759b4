"""gti.refresh.train, the parts that need no model or Ray: the validation split on the new items
(held out when there is one, else in-sample), the steps' off switches, and the micro-batch
check that fails before any model is loaded. Grounding and SFT themselves run in the slow
refresh tests (tests/refresh/test_driver.py)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gti.errors import DataError
from gti.refresh.train import ground_step, select_windows, sft_step, val_source


def _pairs(tasks, splits):
    from gti.stages.pairs import PAIRS_SCHEMA

    n = len(tasks)
    return pa.table({"item_id": [f"n{i}" for i in range(n)], "task": tasks, "split": splits,
                     **{c: [[1]] * n for c in PAIRS_SCHEMA.names[3:]}}, schema=PAIRS_SCHEMA)


def test_validation_uses_held_out_pairs_when_there_are_some():
    t = _pairs(["title2sid", "desc2sid", "sid2title"], ["val", "train", "train"])
    out, in_sample = val_source(t)
    assert not in_sample and out.equals(t)


def test_validation_falls_back_to_the_training_text_to_sid_pairs():
    t = _pairs(["title2sid", "desc2sid", "sid2title", "title2sid"], ["train", "train", "train", "val"])
    t = t.filter(pa.array([True, True, True, False]))  # no held-out pair at all
    out, in_sample = val_source(t)
    assert in_sample and out.column("split").to_pylist() == ["val", "val", "train"]  # sid2title is no val task
    t2 = _pairs(["sid2title", "title2sid"], ["val", "train"])  # a val pair of another task is not held out
    assert val_source(t2)[1] and val_source(t2)[0].column("split").to_pylist() == ["val", "val"]


def test_zero_steps_train_nothing(make_job):
    job = make_job("unused.csv", None, "refresh.ground_steps=0", "refresh.sft_steps=0")
    assert ground_step(job, None) == {"steps_done": 0, "grounded": False}
    assert any("refresh.ground_steps=0: SIDs only" in m for m in job.logs)
    assert sft_step(job) == {"steps_done": 0}
    assert not (job.work / "ground_model").exists() and not (job.work / "sft_model").exists()


def test_too_few_train_pairs_for_one_micro_batch_fail_before_loading_the_model(make_job):
    job = make_job("unused.csv", None, "refresh.ground_steps=2", "ground.batch_size=4", "ground.num_workers=2")
    pq.write_table(_pairs(["title2sid"] * 4, ["train"] * 3 + ["val"]), str(job.work / "pairs.parquet"))
    with pytest.raises(DataError, match=r"3 train pairs cannot fill one micro-batch of 2 on each of 2 workers"):
        ground_step(job, None)
    assert not (job.work / "e_new_start.safetensors").exists()


def _seqs():
    import polars as pl

    return pl.DataFrame({"user_id": ["t1", "t2", "o1", "o2", "o3"],
                         "train_items": [["a", "b", "c"], ["b", "n"], ["a", "b", "c", "d"], ["c", "d"], ["x"]],
                         "valid_item": ["d"] * 5, "test_item": ["e"] * 5})


def test_refresh_sft_replays_a_share_of_untouched_users_windows():
    import polars as pl

    touched = pl.Series("user_id", ["t1", "t2"])
    w, facts = select_windows(_seqs(), touched, 20, 0.0, seed=0)
    assert facts == {"touched_users": 2, "touched_windows": 3, "replay_windows": 0}
    assert set(w["user_id"]) == {"t1", "t2"} and sorted(w["target"]) == ["b", "c", "n"]
    w, facts = select_windows(_seqs(), touched, 20, 1.0, seed=0)  # 3 of the others' 4 windows
    assert facts["replay_windows"] == 3 and w.height == 6
    assert set(w.filter(pl.col("user_id").is_in(["o1", "o2", "o3"]))["user_id"]) <= {"o1", "o2"}
    again, _ = select_windows(_seqs(), touched, 20, 1.0, seed=0)
    assert again.equals(w)  # seeded
    w, facts = select_windows(_seqs(), touched, 20, 10.0, seed=0)  # fewer than asked: all of them
    assert facts["replay_windows"] == 4 and w.height == 7
    with pytest.raises(DataError, match="no touched user has 2 or more training items"):
        select_windows(_seqs(), pl.Series("user_id", ["o3"]), 20, 1.0, seed=0)
