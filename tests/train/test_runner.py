"""gti/train/runner.py: what every task runner shares. `train` starts Ray, then makes the
dataset, then runs the loop's `fit` inside the caller's tracker (opened last, so a refused run
leaves no tracker run), handing `fit` the storage path and run name as given; `loss_ends` and
`curve` spell the history the way the callers' facts do. No Ray: `fit` is a recording fake."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

from gti import config as C
from gti.config.train import GroundConfig
from gti.train import loop, runner
from gti.train.worker_config import GroundRows, WorkerConfig


def _config() -> WorkerConfig:
    return WorkerConfig.build("ground", C.RunConfig(), 0, ground=GroundRows("i", 1, 2))


def test_train_starts_ray_reads_the_data_then_fits_inside_the_tracker(monkeypatch, tmp_path):
    events, fits = [], []
    tracker_value = SimpleNamespace(report=lambda m: None)

    def fake_fit(config, ds, tc, **kw):
        events.append("fit")
        fits.append((config, ds, tc, kw))
        return "result"

    @contextmanager
    def tracker():
        events.append("tracker open")
        yield tracker_value
        events.append("tracker closed")

    monkeypatch.setattr(loop, "fit", fake_fit)
    cfg, tc = _config(), GroundConfig(steps=3)
    got = runner.train(cfg, lambda: events.append("data") or "DS", tc, storage_path=tmp_path / "rt", name="ground",
                       start_ray=lambda: events.append("ray"), log=print, progress_every=5, tracker=tracker)
    assert got == "result"
    assert events == ["ray", "data", "tracker open", "fit", "tracker closed"]
    (config, ds, train_cfg, kw), = fits
    assert (config, ds, train_cfg) == (cfg, "DS", tc)
    assert kw["storage_path"] == tmp_path / "rt" and kw["name"] == "ground" and kw["progress_every"] == 5
    assert kw["on_metrics"] == tracker_value.report and kw["callbacks"] is None


def test_without_a_tracker_fit_gets_no_metrics_callback(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(loop, "fit", lambda config, ds, tc, **kw: seen.append(kw))
    runner.train(_config(), lambda: "DS", GroundConfig(), storage_path=tmp_path, name="n",
                 start_ray=lambda: None, log=print, progress_every=1, callbacks=["cb"])
    assert seen[0]["on_metrics"] is None and seen[0]["callbacks"] == ["cb"]


def test_loss_ends_and_curves_as_the_facts_spell_them():
    h = {"loss": [[1, 2.5], [2, 2.0], [3, 1.25]], "val": {"val_exact_match": [[2, 0.25], [3, 0.5]]}}
    assert runner.loss_ends(h) == {"first_loss": 2.5, "final_loss": 1.25}
    assert runner.curve(h, "val_exact_match") == [{"step": 2, "value": 0.25}, {"step": 3, "value": 0.5}]
    assert runner.loss_ends({"loss": []}) == {"first_loss": None, "final_loss": None}
    assert runner.curve(h, "val_loss") == [] and runner.curve({}, "val_exact_match") == []
