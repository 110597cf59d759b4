"""gti/train/ground_run.py: the one grounding runner (the `ground` stage, `gti refresh` and
`gti vocab ground` train through it). No Ray: the loop's `fit` is a recording fake that dies
on its first call (`testkit.FailOnceFit(finished_fit)`) and the driver's readers are pyarrow
ones (`testkit.fake_data`). What a caller relies on for resume: a second call hands `fit` the
same storage path, run name, typed worker config and rows."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from testkit import FailOnceFit, RowsDataset, WorkerDied, dataset_rows, fake_data, finished_fit

from gti import config as C
from gti.config.train import GroundConfig
from gti.common.errors import ConfigError, DataError
from gti.train import loop
from gti.train.ground_run import GroundingInputs, check_pairs, count_train_pairs, run_grounding, write_val_set
from gti.train.worker_config import GroundRows, ValSet, WorkerConfig

FIRST, LEVELS, SIZES, MARK = 100, 2, (3, 3), 50  # SID tokens [100, 106); 50 = a marker before the SID


def _answer(i: int) -> list[int]:
    return [MARK, FIRST + i % SIZES[0], FIRST + SIZES[0] + (i // SIZES[0]) % SIZES[1], 2]


def write_pairs(path, n_train: int = 6, n_val: int = 3) -> None:
    """n_train title2sid train pairs, n_val held-out ones and one held-out sid2title pair."""
    rows = {k: [] for k in ("item_id", "task", "split", "input_ids", "labels", "prompt_ids", "answer_ids")}
    specs = [("title2sid", "train")] * n_train + [("title2sid", "val")] * n_val + [("sid2title", "val")]
    for i, (task, split) in enumerate(specs):
        prompt, ans = [10 + i, 11 + i], _answer(i)
        for k, v in (("item_id", f"it{i}"), ("task", task), ("split", split), ("input_ids", prompt + ans),
                     ("labels", [-100, -100] + ans), ("prompt_ids", prompt), ("answer_ids", ans)):
            rows[k].append(v)
    pq.write_table(pa.table(rows), path)


def _inputs(tmp_path, **ground) -> GroundingInputs:
    from safetensors.torch import save_file

    write_pairs(tmp_path / "pairs.parquet")
    save_file({"e_new": torch.randn(6, 4, generator=torch.Generator().manual_seed(0))},
              str(tmp_path / "init.safetensors"))
    n_val = write_val_set(tmp_path / "pairs.parquet", tmp_path / "val.parquet", seed=1, n_samples=2, first_sid=FIRST,
                          end_sid=FIRST + 6, levels=LEVELS)
    assert n_val == 2
    run_cfg = C.RunConfig(seed=7, ground=GroundConfig(**{"steps": 4, "batch_size": 2, **ground}))
    return GroundingInputs(run_cfg=run_cfg, pairs_path=tmp_path / "pairs.parquet", pad_id=0,
                           rows=GroundRows(str(tmp_path / "init.safetensors"), FIRST, 6),
                           val=ValSet(str(tmp_path / "val.parquet"), str(tmp_path / "sids.safetensors"), FIRST,
                                      FIRST + 6, LEVELS),
                           note="from the test")


def test_a_run_that_dies_is_retried_to_the_same_run_and_facts_come_from_its_history(tmp_path, monkeypatch):
    inputs = _inputs(tmp_path)
    fit = FailOnceFit(finished_fit)
    monkeypatch.setattr(loop, "fit", fit)
    data, rays, logs = fake_data(monkeypatch), [], []
    kw = dict(storage_path=tmp_path / "ray_train", name="ground", start_ray=lambda: rays.append(1), log=logs.append)
    with pytest.raises(WorkerDied):
        run_grounding(inputs, **kw)
    res = run_grounding(inputs, **kw)

    fit.assert_same_run()
    call = fit.calls[0]
    assert (call["storage_path"], call["name"]) == (str(tmp_path / "ray_train"), "ground")
    assert call["config"] == WorkerConfig.build("ground", inputs.run_cfg, 0, ground=inputs.rows, val=inputs.val)
    assert call["train_cfg"] == inputs.run_cfg.ground
    t = pq.read_table(tmp_path / "pairs.parquet").to_pylist()
    train = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in t if r["split"] == "train"]
    assert sorted(call["rows"]) == sorted(dataset_rows(RowsDataset(train)))  # the train rows, each once
    assert data == [("pairs", str(tmp_path / "pairs.parquet"), 7)] * 2 and len(rays) == 2
    assert "grounding 4 steps x 2 pairs on 1 worker(s)" in logs[0]
    assert "6 train pairs, 2 val prompts (from the test)" in logs[0]

    init = {"e_new": torch.randn(6, 4, generator=torch.Generator().manual_seed(0))}
    assert torch.equal(res.state_dict["e_new"], init["e_new"] + 1.0)
    g = inputs.run_cfg.ground
    assert res.facts == {
        "steps_done": 4, "first_loss": pytest.approx(2.9), "final_loss": pytest.approx(2.6),
        "val_exact_match": [{"step": 4, "value": 0.5}], "tokens_per_s_median": 250.0, "train_pairs": 6,
        "val_prompts": 2, "num_workers": 1, "zero_stage": g.zero_stage, "precision": "fp32",
        "precision_setting": g.precision, "timing": {"loop_s": 1.0},
    }
    assert res.history["loss"][0] == [1, pytest.approx(2.9)]


def test_too_few_pairs_fail_before_ray_starts(tmp_path, monkeypatch):
    inputs = _inputs(tmp_path, batch_size=8)
    fit, rays = FailOnceFit(finished_fit), []
    monkeypatch.setattr(loop, "fit", fit)
    with pytest.raises(DataError, match=r"pairs.parquet: 6 train pairs cannot fill one micro-batch of 8 on each of 1 "):
        run_grounding(inputs, storage_path=tmp_path, name="g", start_ray=lambda: rays.append(1), log=print)
    assert rays == [] and fit.calls == []


@pytest.fixture
def pairs(tmp_path):
    write_pairs(tmp_path / "pairs.parquet")
    return tmp_path / "pairs.parquet"


def test_check_pairs_counts_the_train_pairs_and_names_the_source_and_the_key(pairs):
    assert count_train_pairs(pairs) == 6
    assert check_pairs(pairs, GroundConfig(batch_size=6, num_workers=1)) == 6
    with pytest.raises(DataError, match=r"^tokens: 6 training pairs cannot fill one micro-batch of 4 on each of 2 "
                                        r"workers \(ground.batch_size / ground.num_workers\)$"):
        check_pairs(pairs, GroundConfig(batch_size=8, num_workers=2), "tokens", "training pairs")
    with pytest.raises(ConfigError, match="ground.batch_size"):
        check_pairs(pairs, GroundConfig(batch_size=3, num_workers=2))


def test_val_set_samples_held_out_text_to_sid_pairs_with_the_answer_prefix(pairs, tmp_path):
    out = tmp_path / "val.parquet"
    n = write_val_set(pairs, out, seed=3, n_samples=10, first_sid=FIRST, end_sid=FIRST + 6, levels=LEVELS)
    t = pq.read_table(out).to_pydict()
    assert n == 3 and len(t["prompt"]) == 3  # the sid2title pair is not a validation task
    for p, target in zip(t["prompt"], t["target"]):
        i = p[0] - 10
        assert p == [10 + i, 11 + i, MARK] and target == _answer(i)[1:3]
    again = tmp_path / "again.parquet"
    write_val_set(pairs, again, seed=3, n_samples=2, first_sid=FIRST, end_sid=FIRST + 6, levels=LEVELS)
    small = pq.read_table(again).to_pydict()
    assert len(small["prompt"]) == 2 and all(p in t["prompt"] for p in small["prompt"])  # seeded sample
    # By id set (refresh after added codes): the same rows when the set holds the SID ids.
    ids = frozenset(range(FIRST, FIRST + 6))
    assert write_val_set(pairs, again, seed=3, n_samples=10, first_sid=0, end_sid=0, levels=LEVELS, sid_ids=ids) == 3
    assert pq.read_table(again).to_pydict() == t
    with pytest.raises(DataError, match=r"val pair \d+ has no run of 2 SID tokens in its answer"):
        write_val_set(pairs, again, seed=3, n_samples=10, first_sid=FIRST, end_sid=FIRST + 3, levels=LEVELS)
    write_pairs(tmp_path / "none.parquet", n_val=0)
    assert write_val_set(tmp_path / "none.parquet", tmp_path / "x.parquet", seed=3, n_samples=10, first_sid=FIRST,
                         end_sid=FIRST + 6, levels=LEVELS) == 0
    assert not (tmp_path / "x.parquet").exists()
