"""gti.common.tracking: event files with the expected tags, tag mapping, the MLflow key's message,
and the warn-once policy for failed writes."""

from __future__ import annotations

import importlib.util

import pytest

from gti import config
from gti.common.errors import ConfigError
from gti.common.tracking import (
    Tracker, TrackingError, check_available, eval_tags, metric_tags, mlflow_key, read_scalars,
)

HAS_MLFLOW = importlib.util.find_spec("mlflow") is not None


def test_metric_tags_maps_train_val_and_lists():
    m = {"step": 3, "epoch": 0, "wall_time": 1.7e9, "loss": 1.5, "lr": 1e-3, "grad_norm_new_rows": 0.2,
         "tokens_per_s": 900.0, "val_exact_match": 0.25, "utilisation": [0.5, 1.0], "note": "x",
         "flag": True}
    assert metric_tags(m) == {
        "train/loss": 1.5, "train/lr": 1e-3, "train/grad_norm_new_rows": 0.2,
        "train/tokens_per_s": 900.0, "val/exact_match": 0.25,
        "train/utilisation/l0": 0.5, "train/utilisation/l1": 1.0,
    }


def test_eval_tags_from_metrics_json():
    out = {
        "splits": {"test": {"recall@10": {"value": 0.1, "ci": [0, 0.2]}}},
        "baselines": {"mostpop": {"test": {"recall@10": {"value": 0.03}}}},
        "ranks": {"test": {"mrr": {"value": 0.05}}},
        "slices": {"cold": {"definition": {"n_cold_items": 3}, "test": {"model": {"recall@10": {"value": 0.0}}}}},
        "invalid_sid_rate": 0.0,
    }
    assert eval_tags(out) == {
        "eval/test/recall@10": 0.1, "eval/test/mostpop/recall@10": 0.03, "eval/test/mrr": 0.05,
        "eval/test/cold/recall@10": 0.0, "eval/invalid_sid_rate": 0.0,
    }
    assert mlflow_key("eval/test/recall@10") == "eval/test/recall_at_10"
    assert mlflow_key("a b:c") == "a_b_c"


def test_tracker_writes_event_files_and_a_rerun_starts_fresh(tmp_path):
    cfg = config.load(None, [f"run_dir={tmp_path}"])
    with Tracker(cfg, tmp_path, "ground") as t:
        t.report({"step": 1, "loss": 2.0, "lr": 0.1})
        t.report({"step": 2, "loss": 1.0, "lr": 0.1, "val_exact_match": 0.5})
        t.scalar("x/nan", float("nan"), 1)  # not finite: skipped
        t.scalar("eval/test/recall@5", 0.5, 2)
    got = read_scalars(tmp_path / "tensorboard" / "ground")
    assert got["train/loss"] == [(1, 2.0), (2, 1.0)]
    assert got["val/exact_match"] == [(2, 0.5)]
    assert "x/nan" not in got
    assert got["eval/test/recall_at_5"] == [(2, 0.5)]
    with Tracker(cfg, tmp_path, "ground") as t:
        t.report({"step": 1, "loss": 3.0})
    assert read_scalars(tmp_path / "tensorboard" / "ground") == {"train/loss": [(1, 3.0)]}


def test_tensorboard_off_writes_nothing(tmp_path):
    cfg = config.load(None, [f"run_dir={tmp_path}", "tracking.tensorboard=false"])
    with Tracker(cfg, tmp_path, "sft") as t:
        t.report({"step": 1, "loss": 2.0})
    assert not (tmp_path / "tensorboard").exists()


def test_a_failed_write_warns_once_and_never_raises(tmp_path, capsys):
    cfg = config.load(None, [f"run_dir={tmp_path}"])
    t = Tracker(cfg, tmp_path, "sft")

    class Broken:
        def add_scalar(self, *a):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    t._tb = Broken()
    t.scalar("train/loss", 1.0, 1)
    t.scalar("train/loss", 1.0, 2)
    t.close()
    err = capsys.readouterr().err
    assert err.count("gti: warning: tracking (tensorboard") == 1
    assert "No space left on device" in err


def test_unknown_tracking_key_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'tracking.tensorbord'"):
        config.load(None, ["tracking.tensorbord=false"])


@pytest.mark.skipif(HAS_MLFLOW, reason="mlflow is installed: the local file store test runs instead")
def test_mlflow_key_without_the_package_names_key_and_package(tmp_path):
    cfg = config.load(None, [f"run_dir={tmp_path}", "tracking.mlflow=true"])
    msg = ("tracking.mlflow: true needs the mlflow package, which is not installed "
           "(pip install mlflow), or set tracking.mlflow: false")
    with pytest.raises(TrackingError) as e:
        check_available(cfg)
    assert str(e.value) == msg
    with pytest.raises(TrackingError, match="pip install mlflow"):
        Tracker(cfg, tmp_path, "ground")


@pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow is not installed: the missing-package test runs instead")
def test_mlflow_local_file_store(tmp_path):
    import mlflow

    cfg = config.load(None, [f"run_dir={tmp_path}", "tracking.mlflow=true"])
    check_available(cfg)
    with Tracker(cfg, tmp_path, "ground") as t:
        t.scalar("eval/test/recall@10", 0.5, 3)
    client = mlflow.tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    exp = client.get_experiment_by_name("gti")
    run = client.search_runs([exp.experiment_id])[0]
    assert run.data.metrics == {"eval/test/recall_at_10": 0.5}
