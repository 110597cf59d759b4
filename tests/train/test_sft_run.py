"""gti/train/sft_run.py: the one SFT runner (the `sft` stage and `gti refresh` train through
it). No Ray: the loop's `fit` is a recording fake that dies on its first call
(`testkit.FailOnceFit(finished_fit)`) and the driver's parquet reader a pyarrow one. What a
caller relies on for resume: a second call hands `fit` the same storage path, run name, typed
worker config and rows (here: the file's rows in file order, materialised)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from testkit import FailOnceFit, RowsDataset, WorkerDied, dataset_rows, fake_data, finished_fit

from gti import config as C
from gti.config.train import SftConfig
from gti.train import loop
from gti.train.sft_run import SftInputs, history_facts, run_sft
from gti.train.worker_config import FaultInjection, SftStart, ValSet, WorkerConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gti.lm import models

    d = tmp_path_factory.mktemp("sft_run") / "model"
    model, tok = models.build_tiny(C.ModelConfig(name="tiny", tiny_hidden=32, tiny_layers=1, tiny_heads=2))
    model.save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    return d


def test_a_run_that_dies_is_retried_to_the_same_run_and_facts_come_from_its_history(model_dir, tmp_path,
                                                                                     monkeypatch):
    rows = [{"input_ids": [5 + i, 6, 7], "labels": [-100, 6, 7]} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    run_cfg = C.RunConfig(model={"name": "tiny"}, sft=SftConfig(steps=3, batch_size=2))
    val = ValSet(str(tmp_path / "val.parquet"), str(tmp_path / "sids.parquet"), 10, 20, 2, k=10, beam_width=10)
    fault = FaultInjection(fail_at_step=2, fail_marker=str(tmp_path / "m"))
    inputs = SftInputs(run_cfg=run_cfg, train_path=tmp_path / "train.parquet", model_dir=model_dir, pad_id=0,
                       val=val, fault=fault)
    fit = FailOnceFit(finished_fit)
    monkeypatch.setattr(loop, "fit", fit)
    data, rays = fake_data(monkeypatch), []
    kw = dict(storage_path=tmp_path / "ray_train", name="sft", start_ray=lambda: rays.append(1), log=print)
    with pytest.raises(WorkerDied):
        run_sft(inputs, **kw)
    res = run_sft(inputs, **kw)

    fit.assert_same_run()
    call = fit.calls[0]
    assert (call["storage_path"], call["name"]) == (str(tmp_path / "ray_train"), "sft")
    assert call["config"] == WorkerConfig.build("sft", run_cfg, 0, sft=SftStart(str(model_dir)), val=val, fault=fault)
    assert call["train_cfg"] == run_cfg.sft
    assert call["rows"] == dataset_rows(RowsDataset(rows))  # file order: the rows are shuffled already
    assert data == [("parquet", str(tmp_path / "train.parquet"), ["input_ids", "labels"], True)] * 2
    assert len(rays) == 2

    n_params = sum(t.numel() for t in res.state_dict.values())
    assert res.facts == {
        "steps_done": 3, "final_loss": pytest.approx(2.7), "first_loss": pytest.approx(2.9),
        "loss_history": [{"step": s, "value": pytest.approx(3.0 - 0.1 * s)} for s in (1, 2, 3)],
        "val_recall@10": [{"step": 3, "value": 0.5}], "val_history": {"val_recall@10": [{"step": 3, "value": 0.5}]},
        "trainable_params": n_params, "precision": "fp32", "timing": {"loop_s": 1.0},
    }


def test_history_facts_of_a_run_that_did_not_train():
    assert history_facts({"loss": [], "val": {}}, 0) == {
        "steps_done": 0, "final_loss": None, "first_loss": None, "loss_history": [], "val_recall@10": [],
        "val_history": {},
    }
