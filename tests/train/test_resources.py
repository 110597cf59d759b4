"""gti.train.resources: what one pipeline run holds at once and how many fit side by side."""

from __future__ import annotations

from pathlib import Path

import pytest

from gti import config as C
from gti.train import resources as R

TINY = Path(__file__).resolve().parents[2] / "jobs" / "configs" / "tiny.yaml"


def _cfg(*overrides):
    return C.load(TINY, list(overrides))


def test_workers_need_counts_every_worker_and_gpus():
    cfg = _cfg("ground.num_workers=3", "ground.resources_per_worker={CPU: 2, gti_worker: 1}")
    assert R.workers_need(cfg.ground) == {"CPU": 6.0, "gti_worker": 3.0}
    gpu = _cfg("sft.num_workers=2", "sft.use_gpu=true")
    assert R.workers_need(gpu.sft) == {"CPU": 2.0, "GPU": 2.0}


def test_run_need_is_the_largest_stage_plus_data_headroom():
    cfg = _cfg("ground.num_workers=1", "sft.num_workers=3", "eval.concurrency=2")
    assert R.run_need(cfg, ("ground",)) == {"CPU": 1.0 + R.DATA_HEADROOM_CPU}
    assert R.run_need(cfg, ("ground", "sft", "evaluate")) == {"CPU": 3.0 + R.DATA_HEADROOM_CPU}
    assert R.run_need(cfg, ("ground", "sft"), headroom=False) == {"CPU": 3.0}
    # A disabled stage reserves nothing.
    off = _cfg("ground.num_workers=1", "sft.num_workers=3", "sft.enabled=false")
    assert R.run_need(off, ("ground", "sft"), headroom=False) == {"CPU": 1.0}
    ev = _cfg("eval.concurrency=2", "eval.num_gpus=0.5")
    assert R.run_need(ev, ("evaluate",))["GPU"] == pytest.approx(1.0)


@pytest.mark.parametrize("cpus", [2, 3, 4, 5, 8, 16])
def test_runs_that_fit_always_leave_each_run_its_headroom(cpus):
    """The regression behind the module: N runs of 1-worker stages on a cluster must leave
    every run a CPU outside its workers' placement group for Ray Data."""
    cfg = _cfg("ground.num_workers=1", "sft.num_workers=1")
    need = R.run_need(cfg, ("ground", "sft", "evaluate"))
    n = R.runs_that_fit(need, {"CPU": float(cpus)})
    workers = R.run_need(cfg, ("ground", "sft", "evaluate"), headroom=False)["CPU"]
    assert n * workers + n * R.DATA_HEADROOM_CPU <= cpus
    assert (n + 1) * need["CPU"] > cpus  # and no more runs than that fit


def test_runs_that_fit_caps_and_floors_and_shortfall():
    need = {"CPU": 3.0, "GPU": 1.0}
    assert R.runs_that_fit(need, {"CPU": 30.0, "GPU": 4.0}) == 4
    assert R.runs_that_fit(need, {"CPU": 30.0, "GPU": 4.0}, cap=2) == 2
    assert R.runs_that_fit(need, {"CPU": 1.0}) == 1  # queue one at a time rather than none
    assert R.shortfall(need, {"CPU": 30.0}) == {"GPU": (1.0, 0.0)}
    assert R.shortfall(need, {"CPU": 3.0, "GPU": 1.0}) == {}
