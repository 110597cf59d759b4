"""gti.refresh.train without Ray: the validation split on the new items (held out when there
is one, else in-sample), the steps' off switches, the micro-batch check that fails before any
model is loaded, the replayed SFT windows, and both steps on a tiny model with the runners'
`fit` faked (testkit): a rerun hands the loop the same run. Grounding and SFT themselves run in
the slow refresh tests (tests/refresh/test_command.py)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gti.common.errors import DataError
from gti.refresh.train import ground_step, select_windows, sft_step, val_source


def _pairs(tasks, splits):
    from gti.data.schemas import PAIRS_SCHEMA

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


# --------------------------------------------------------------------------- both steps, no Ray
def _trainable_job(fake_run, make_job):
    """A job whose parent model is a real tiny model (the fake run's is a stub): its tokenizer
    extended with the run's 10 SID tokens, which the pairs manifest names, plus what the earlier
    steps leave in the work folder: the new map with its version record, the pairs and the new
    items' pairs, the merged sequences and the touched users."""
    import polars as pl
    import torch

    from gti import config as C
    from gti.lm import models, new_rows
    from gti.run.manifest import Manifest
    from gti.sid.codec import SidCodec
    from gti.sid.versions import make_version, write_map
    from gti.data.schemas import PAIRS_SCHEMA

    sizes = [int(k) for k in Manifest.read(fake_run.dir / "sid").facts["codebook_sizes"]]  # 4, 4, 2
    model, tok = models.build_tiny(C.ModelConfig(name="tiny", tiny_hidden=32, tiny_layers=1, tiny_heads=2))
    codec = SidCodec(3, sizes)
    first, end = new_rows.extend_tokenizer(tok, codec.tokens())
    model.resize_token_embeddings(end, mean_resizing=False)
    new_rows.export_model(model, tok, fake_run.model_dir,
                          {"sid_map_hash": fake_run.map_hash, "new_token_ids": [first, end]})
    pm = Manifest.read(fake_run.dir / "pairs")
    Manifest(stage="pairs", fingerprint="test", config={}, outputs=pm.outputs,
             facts={**pm.facts, "new_token_ids": [first, end]}).write(fake_run.dir / "pairs")
    job = make_job("unused.csv", None, "refresh.ground_steps=2", "ground.batch_size=2", "ground.num_workers=1",
                   "ground.val_samples=2", "refresh.sft_steps=2", "sft.batch_size=2", "sft.num_workers=1")
    (job.work / "sid").mkdir()
    t = pq.read_table(str(job.parent.map_path))
    write_map(job.work / "sid" / "sid_map.parquet", t, make_version(t, "cbhash", sizes, parent=job.parent.hash))
    sids = codec.token_ids(torch.tensor(t.column("codes").to_pylist()), tok).tolist()
    rows = []
    for i, item in enumerate(t.column("item_id").to_pylist()):
        prompt = tok.encode(f"thing {i}")
        rows.append({"item_id": item, "task": "title2sid", "split": "val" if i == 4 else "train",
                     "input_ids": prompt + sids[i], "labels": [-100] * len(prompt) + sids[i], "prompt_ids": prompt,
                     "answer_ids": sids[i]})
    pq.write_table(pa.Table.from_pylist(rows, schema=PAIRS_SCHEMA), str(job.work / "pairs.parquet"))
    pq.write_table(pa.Table.from_pylist(rows[3:], schema=PAIRS_SCHEMA), str(job.work / "pairs_new.parquet"))
    (job.work / "ingest").mkdir()
    pl.DataFrame({"user_id": ["t1", "t2", "o1"], "train_items": [["a0", "a1", "a2"], ["a1", "a3"], ["a2", "a4"]],
                  "valid_item": ["a3"] * 3, "test_item": ["a4"] * 3}).write_parquet(
        job.work / "ingest" / "sequences.parquet")
    pl.DataFrame({"user_id": ["t1", "t2"]}).write_parquet(job.work / "ingest" / "touched_users.parquet")
    return job, first, end


def test_both_steps_hand_the_runners_the_same_run_when_rerun(fake_run, make_job, monkeypatch):
    """No Ray (`fit` faked, testkit): a grounding (then an SFT) that dies in training, run
    again, hands the runner's `fit` the same storage path, run name, typed worker config and
    rows (what makes the loop resume it), and the steps report the same keys as ever."""
    from testkit import FailOnceFit, WorkerDied, fake_data, finished_fit, no_ray

    from gti.refresh.attempt import GROUND_RUN, SFT_RUN
    from gti.train import loop
    from gti.train.worker_config import GroundRows, SftStart

    job, first, end = _trainable_job(fake_run, make_job)
    data, rays = fake_data(monkeypatch), no_ray(monkeypatch)
    done = {}
    for step, run in (("ground", lambda: ground_step(job, None)), ("sft", lambda: sft_step(job))):
        fit = FailOnceFit(finished_fit)
        monkeypatch.setattr(loop, "fit", fit)
        with pytest.raises(WorkerDied):
            run()
        done[step] = run()
        fit.assert_same_run()
        done[step + "_call"] = fit.calls[0]
    g, s = done["ground_call"], done["sft_call"]
    assert (g["storage_path"], g["name"]) == (str(job.work / "ray_train"), GROUND_RUN)
    assert g["config"].ground == GroundRows(str(job.work / "e_new_start.safetensors"), first, end - first)
    assert (g["config"].val.path, g["config"].val.levels) == (str(job.work / "val_prompts.parquet"), 3)
    assert (s["storage_path"], s["name"]) == (str((job.work / "ray_train").resolve()), SFT_RUN)
    assert s["config"].sft == SftStart(str(job.work / "ground_model")) and s["config"].val is None
    assert [c[0] for c in data] == ["pairs", "pairs", "parquet", "parquet"] and len(rays) == 4
    assert set(done["ground"]) == {"grounded", "steps_done", "lr", "first_loss", "final_loss", "val_exact_match",
                                   "val_in_sample", "val_prompts", "train_pairs"}
    assert done["ground"]["steps_done"] == 2 and done["ground"]["train_pairs"] == 4
    assert (done["ground"]["val_prompts"], done["ground"]["val_in_sample"]) == (1, False)
    assert set(done["sft"]) == {"steps_done", "lr", "windows", "users", "touched_users", "touched_windows",
                                "replay_windows", "first_loss", "final_loss"}
    assert done["sft"]["steps_done"] == 2 and done["sft"]["first_loss"] == pytest.approx(2.9)
    assert (job.work / "ground_model" / "config.json").is_file() and (job.work / "sft_model" / "config.json").is_file()
