"""Tests of gti/stages/rl.py on fixture upstream stages (ingest sequences, a SID map and an
'SFT' stage: a tiny exported model): off by default it writes only its manifest and the SFT
model stays the run's model; on, it samples training windows only, trains on Ray Train (a
killed first attempt finished in the same partial dir with the same run), keeps the best
validation and exports it as the run's model."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
import torch
from testkit import FailOnceFit, WorkerDied, stage_manifest, walk_sequences

from gti import config
from gti.run import pipeline
from gti.run.versions import find_model_dir

HASH, SIZES, N_ITEMS = "sidhash-rl", [4, 4, 4], 24
ROOT = Path(__file__).resolve().parents[2]


def make_upstream(run_dir, n_users: int = 40, seed: int = 0):
    """ingest (users walking the catalog in steps of +1), sid (a 3-level map) and sft (a tiny
    model exported with the SID tokens)."""
    from gti.lm import models, new_rows
    from gti.sid.codec import SidCodec

    items = [f"it{i}" for i in range(N_ITEMS)]
    rows = walk_sequences(items, n_users, seed, max_train=7)
    d = stage_manifest(run_dir, "ingest", {"sequences": "sequences.parquet"}, {"n_users": n_users, "n_items": N_ITEMS})
    pl.DataFrame(rows).write_parquet(d / "sequences.parquet")
    codec = SidCodec(3, SIZES)
    codes = [[i // 16, (i // 4) % 4, i % 4] for i in range(N_ITEMS)]
    facts = {"levels": 3, "codebook_sizes": SIZES, "token_format": "<{level}_{code}>",
             "new_tokens": codec.tokens(), "sid_map_hash": HASH, "n_items": N_ITEMS}
    d = stage_manifest(run_dir, "sid", {"sid_map": "sid_map.parquet"}, facts)
    pl.DataFrame({"item_id": items, "codes": codes, "sid": [codec.to_string(c) for c in codes]},
                 schema={"item_id": pl.Utf8, "codes": pl.List(pl.Int32), "sid": pl.Utf8}).write_parquet(d / "sid_map.parquet")
    model, tok = models.build_tiny(config.ModelConfig(name="tiny"), seed=seed)
    first, end = new_rows.extend_tokenizer(tok, codec.tokens())
    model.resize_token_embeddings(end, mean_resizing=False)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        model.get_input_embeddings().weight[first:end] = 0.02 * torch.randn(end - first, model.config.hidden_size, generator=g)
    d = stage_manifest(run_dir, "sft", {"model": "model"}, {"sid_map_hash": HASH})
    new_rows.export_model(model, tok, d / "model", {"sid_map_hash": HASH, "new_token_ids": [first, end]})
    return d


def rl_cfg(run_dir, *overrides):
    return config.load(ROOT / "jobs" / "configs" / "tiny.yaml", [
        f"run_dir={run_dir}", "rl.enabled=true", "rl.steps=4", "rl.batch_size=4", "rl.group_size=4",
        "sft.val_users=8", "sft.max_len=160",
        "rl.val_every=2", "rl.checkpoint_every=2", "rl.lr=1e-2", "rl.kl_coef=0.04", "rl.stop_margin=null",
        "eval.beam_width=5", "eval.batch_users=8", *overrides])


def test_off_by_default_it_writes_only_its_manifest(tmp_path):
    run_dir = tmp_path / "run"
    make_upstream(run_dir)
    cfg = config.load(ROOT / "jobs" / "configs" / "tiny.yaml", [f"run_dir={run_dir}"])
    assert cfg.rl.enabled is False and cfg.rl.trains is False
    m = pipeline.run_stage(pipeline.spec("rl"), cfg, run_dir)
    assert m.outputs == {} and m.facts == {"enabled": False, "steps_done": 0}
    assert sorted(p.name for p in (run_dir / "rl").iterdir()) == ["_manifest.json", "config.yaml"]
    assert find_model_dir(run_dir) == ("sft", run_dir / "sft" / "model")


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory, ray_start_4_cpus):
    """The stage, run the way a killed run is finished: the first training call dies before
    any step (`FailOnceFit`), `run_stage` again completes it in the same partial dir."""
    from gti.train import loop

    run_dir = tmp_path_factory.mktemp("rl") / "run"
    make_upstream(run_dir)
    cfg = rl_cfg(run_dir)
    fit = FailOnceFit(loop.fit)
    mp = pytest.MonkeyPatch()
    mp.setattr(loop, "fit", fit)
    try:
        with pytest.raises(WorkerDied):
            pipeline.run_stage(pipeline.spec("rl"), cfg, run_dir)
        m = pipeline.run_stage(pipeline.spec("rl"), cfg, run_dir)
    finally:
        mp.undo()
    return run_dir, cfg, m, fit


@pytest.mark.slow
@pytest.mark.ray
def test_rl_trains_keeps_its_best_validation_and_becomes_the_runs_model(rl_run):
    from safetensors.torch import load_file

    run_dir, cfg, m, fit = rl_run
    fit.assert_same_run()
    # 16 prompts (steps x batch) sampled from the training windows (which never hold a valid or
    # test item: tests/train/test_rl_run.py); SFT's 8 validation users (sft.val_users).
    rows = pl.read_parquet(run_dir / "rl" / "rl_train.parquet")
    assert rows.height == 16 == len(fit.calls[1]["rows"]) == m.facts["n_prompts"]
    assert pl.read_parquet(run_dir / "rl" / "val.parquet").height == 8
    f = m.facts
    assert f["enabled"] is True and f["steps_done"] == 4
    mrr = f["val_history"]["val_mrr"]
    assert [v["step"] for v in mrr] == [0, 2, 4]  # the SFT model first
    best = f["best"]
    assert best["metric"] == "val_mrr" and best["start"] == mrr[0]["value"]
    assert best["value"] == max(v["value"] for v in mrr) and best["step"] in (0, 2, 4)
    assert {"reward_mean", "kl", "clip_fraction", "zero_std_share", "rollout_s"} <= set(f["step_stats"])
    shares = f["time_shares"]
    assert shares["rollout"] > 0 and sum(shares.values()) == pytest.approx(1.0) and shares["update"] > 0
    assert f["step_stats"]["kl"] >= 0 and f["stopped_at"] is None and f["timing"]["compute_s"] > 0
    assert m.outputs == {"model": "model"}
    assert find_model_dir(run_dir) == ("rl", run_dir / "rl" / "model")
    meta = json.loads((run_dir / "rl" / "model" / "gti_meta.json").read_text())
    assert meta["sid_map_hash"] == HASH and meta["stage"] == "rl"
    sft = load_file(str(run_dir / "sft" / "model" / "model.safetensors"))
    out = load_file(str(run_dir / "rl" / "model" / "model.safetensors"))
    assert sorted(out) == sorted(sft)
    same = all(torch.equal(out[k], sft[k]) for k in sft)
    assert same == (best["step"] == 0)  # the SFT model exactly when no step beat it
