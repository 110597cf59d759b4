"""gti/train/nonfinite.py (issue 30, item 6): a NaN/inf loss or gradient norm stops training
with one line naming the section and the step, before that step is checkpointed (so no NaN
row is ever exported and evaluated as zeros), and reaches the CLI as that one line through
Ray Train's failure wrapper. The loop test runs `train_loop_per_worker` in this process (the
real model hooks and DeepSpeed engine; Ray's calls replaced), no Ray."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager

import pytest

from gti.common.errors import GtiError, NonFiniteError, user_error
from gti.train import nonfinite
from gti.train.nonfinite import check_finite


@pytest.mark.parametrize("loss,gn,bad,what", [
    (math.nan, 1.0, 0, "loss is nan"),
    (math.inf, 1.0, 0, "loss is inf"),
    (0.5, math.nan, 1, "gradient norm is nan"),
    (0.5, -math.inf, 1, "gradient norm is -inf"),
    (0.5, 1.0, 1, "gradient norm is not finite on 1 worker(s)"),  # another rank's local norm
    (0.5, None, 2, "not finite on 2 worker(s)"),
])
def test_a_non_finite_step_is_one_line_naming_section_and_step(loss, gn, bad, what):
    with pytest.raises(NonFiniteError) as e:
        check_finite("ground", 17, loss, gn, bad)
    msg = str(e.value)
    assert msg.startswith("ground: training stopped at step 17: ") and what in msg
    assert "ground.lr" in msg and len(msg.splitlines()) == 1
    assert isinstance(e.value, GtiError)


def test_finite_steps_pass():
    check_finite("sft", 1, 2.5, 0.3, 0)
    check_finite("sft", 1, 0.0, None, 0)


def test_user_error_finds_it_inside_a_ray_train_failure():
    """How gti.train.ray_train turns a worker's failure into the CLI's one line: the object itself
    (worker_failures), or its traceback text when only that survived."""
    err = NonFiniteError("sft: training stopped at step 3: loss is nan (lower sft.lr, ...)")

    class TrainingFailedError(Exception):
        def __init__(self):
            super().__init__("Training failed")
            self.worker_failures = {0: err}

    assert user_error(TrainingFailedError()) is err
    text = RuntimeError("Traceback ...\ngti.common.errors.NonFiniteError: sft: training stopped at step 3: loss is nan\n")
    found = user_error(text)
    assert found is not None and str(found) == "sft: training stopped at step 3: loss is nan"


def test_a_restarted_worker_group_of_the_same_fit_fails_at_once(tmp_path):
    from dataclasses import replace

    from gti.config import RunConfig
    from gti.train.worker_config import SftStart, WorkerConfig

    config = replace(WorkerConfig.build("sft", RunConfig(), 0, sft=SftStart(str(tmp_path))),
                     progress_file=str(tmp_path / "sft.progress.jsonl"), fit_id="fit-1")
    nonfinite.raise_if_marked(config)  # nothing recorded yet
    with pytest.raises(NonFiniteError):
        nonfinite.check_step(config, 0, 4, math.nan, 1.0)
    assert nonfinite.marker_path(config) == tmp_path / "sft.nonfinite.json"
    with pytest.raises(NonFiniteError, match="step 4: loss is nan"):
        nonfinite.raise_if_marked(config)
    nonfinite.raise_if_marked(replace(config, fit_id="fit-2"))  # a later fit (a rerun) trains afresh
    other_rank = replace(config, progress_file=str(tmp_path / "x.progress.jsonl"))
    with pytest.raises(NonFiniteError):
        nonfinite.check_step(other_rank, 1, 4, math.nan, 1.0)
    assert not nonfinite.marker_path(other_rank).exists()  # only rank 0 writes it


# --------------------------------------------------------------------------- the real loop, one process
NAN_AT = 3


def test_nan_loss_stops_the_loop_at_its_step_before_any_checkpoint_of_it(single_process_dist_env,
                                                                         grounding_problem, tmp_path,
                                                                         monkeypatch):
    from dataclasses import replace

    import pyarrow.parquet as pq

    from gti.config import RunConfig
    from gti.config.train import GroundConfig
    from gti.train import loop, ray_train
    from gti.train.loss import make_forward
    from gti.train.worker_config import WorkerConfig

    p = grounding_problem
    run_cfg = RunConfig(model=p["model_cfg"], ground=GroundConfig(
        steps=6, batch_size=4, num_workers=1, zero_stage=2, lr=1e-2, checkpoint_every=2, val_every=100,
        log_every=1))
    config = replace(WorkerConfig.build("ground", run_cfg, p["pad_id"], ground=p["ground"], val=p["val"]),
                     progress_file=str(tmp_path / "g.progress.jsonl"), fit_id="one-fit")
    rows = [r for r in pq.read_table(p["pairs"]).to_pylist() if r["split"] == "train"]

    class Stream:  # the worker's shard, without Ray Data
        def __init__(self, shard, micro, collate, seed, epoch=0, offset=0, group_by_length=False):
            self.epoch, self.offset = epoch, offset
            self.batches = [collate({"input_ids": [r["input_ids"] for r in rows[i:i + micro]],
                                     "labels": [r["labels"] for r in rows[i:i + micro]]})
                            for i in range(0, len(rows) - micro + 1, micro)]

        def __iter__(self):
            while True:
                yield from self.batches

    reports = []

    @contextmanager
    def no_checkpoint():
        yield None

    monkeypatch.setattr(loop, "ShardStream", Stream)
    monkeypatch.setattr(ray_train, "worker_rank_world", lambda: (0, 1))
    monkeypatch.setattr(ray_train, "latest_checkpoint", no_checkpoint)
    monkeypatch.setattr(ray_train, "dataset_shard", lambda name="train": None)
    monkeypatch.setattr(ray_train, "report", lambda m, checkpoint_dir=None: reports.append(
        (m["step"], checkpoint_dir is not None)))
    real = make_forward

    def poisoned(model, precision, device_type):
        forward, calls = real(model, precision, device_type), [0]

        def f(engine, b):
            calls[0] += 1
            loss = forward(engine, b)
            return loss * math.nan if calls[0] == NAN_AT else loss

        return f

    monkeypatch.setattr(loop, "make_forward", poisoned)
    with pytest.raises(NonFiniteError) as e:
        loop.train_loop_per_worker(config)
    assert str(e.value).startswith(f"ground: training stopped at step {NAN_AT}: loss is nan")
    # Steps 1-2 reported (2 with its checkpoint), nothing of step 3: no NaN checkpoint exists.
    assert reports == [(1, False), (2, True)]
    steps = [json.loads(line)["step"] for line in (tmp_path / "g.progress.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    with pytest.raises(NonFiniteError, match=f"step {NAN_AT}"):  # a restarted group of this fit
        loop.train_loop_per_worker(config)
