"""After the tiny pipeline, `tensorboard --logdir <run_dir>` has every training stage's curves
and the evaluation's metrics, and the driver printed step progress with rate and ETA.

The tiny config with the RQ-VAE (2 epochs) instead of residual k-means, so the sid stage's
Ray Train loop is covered too.
"""

from __future__ import annotations

import pytest

from gti import config, pipeline
from gti.tracking import read_scalars

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.ray
def test_event_files_with_expected_tags_after_the_tiny_pipeline(tmp_path, ray_start_4_cpus, capfd):
    cfg = config.load(ROOT / "jobs" / "configs" / "tiny.yaml", [
        f"run_dir={tmp_path / 'run'}", "sid.method=rqvae", "sid.epochs=2", "sid.encoder_dims=[32]",
        "sid.code_dim=8", "sid.batch_size=64",
    ])
    pipeline.run(cfg, to_stage="evaluate", echo=lambda m: None)
    tb = tmp_path / "run" / "tensorboard"
    assert sorted(p.name for p in tb.iterdir()) == ["evaluate", "ground", "sft", "sid"]

    sid = read_scalars(tb / "sid")
    assert [s for s, _ in sid["train/loss"]] == [1, 2]  # one point per epoch
    assert {"train/recon_loss", "train/quant_loss", "train/utilisation/l0", "sid/recon_mse",
            "sid/collision_rate_after", "sid/utilisation/l0"} <= set(sid)

    ground = read_scalars(tb / "ground")
    steps = cfg.ground.steps
    assert [s for s, _ in ground["train/loss"]] == list(range(1, steps + 1))
    assert {"train/lr", "train/grad_norm_new_rows", "train/tokens_per_s", "val/exact_match"} <= set(ground)
    assert [s for s, _ in ground["val/exact_match"]][-1] == steps

    sft = read_scalars(tb / "sft")
    assert [s for s, _ in sft["train/loss"]] == list(range(1, cfg.sft.steps + 1))
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "val/loss"} <= set(sft)

    ev = read_scalars(tb / "evaluate")
    import json

    metrics = json.loads((tmp_path / "run" / "evaluate" / "metrics.json").read_text())
    assert ev["eval/test/recall_at_5"] == [(cfg.sft.steps, pytest.approx(metrics["splits"]["test"]["recall@5"]["value"]))]
    assert "eval/valid/mostpop/recall_at_5" in ev and "eval/test/markov/ndcg_at_5" in ev

    err = capfd.readouterr().err
    assert f"[ground] {steps}/{steps} steps (100.0%)" in err
    assert "[sid] 2/2 epochs (100.0%)" in err
    assert "[evaluate] " in err and "prompts (100.0%)" in err
