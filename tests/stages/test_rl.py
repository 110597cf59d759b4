"""Tests of gti/stages/rl.py on fixture upstream stages (a SID map and an 'SFT' stage: a tiny
exported model with its training rows, validation prompts and trie): off by default it writes
only its manifest and the SFT model stays the run's model; on, it needs SFT's rows, trains on
Ray Train (a killed first attempt finished in the same partial dir with the same run), keeps
the best validation and exports it as the run's model."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
import torch
from testkit import FailOnceFit, WorkerDied

from gti import config, pipeline
from gti.errors import DataError
from gti.manifest import Manifest
from gti.run_versions import find_model_dir

HASH, LEVELS, CODES, N_ITEMS = "sidhash-rl", 3, 4, 16
ROOT = Path(__file__).resolve().parents[2]


def _manifest(run_dir, stage, outputs, facts):
    d = run_dir / stage
    d.mkdir(parents=True, exist_ok=True)
    Manifest(stage=stage, fingerprint=f"fp-{stage}", config={}, outputs=outputs, facts=facts).write(d)
    return d


def make_upstream(run_dir, trained_sft: bool = True, seed: int = 0):
    """sid (the map hash) and sft: a tiny model exported with the SID tokens, and (trained_sft)
    SFT's data: 32 'seqrec' rows whose target is the item after the prompt's last one plus two
    grounding rows, 8 validation prompts and the [N, L] trie."""
    from safetensors.torch import save_file

    from gti.lm import models, new_rows

    _manifest(run_dir, "sid", {"sid_map": "sid_map.parquet"}, {"sid_map_hash": HASH})
    model, tok = models.build_tiny(config.ModelConfig(name="tiny"), seed=seed)
    first, end = new_rows.extend_tokenizer(tok, [f"<{lv}_{c}>" for lv in range(LEVELS) for c in range(CODES)])
    model.resize_token_embeddings(end, mean_resizing=False)
    sids = torch.tensor([[first + lv * CODES + (i // CODES ** (LEVELS - 1 - lv)) % CODES for lv in range(LEVELS)]
                         for i in range(N_ITEMS)])
    outputs = {"model": "model"}
    if trained_sft:
        outputs.update(train_rows="data/sft_train.parquet", val_prompts="data/val.parquet",
                       sid_tokens="data/sid_token_ids.safetensors")
    d = _manifest(run_dir, "sft", outputs, {"sid_map_hash": HASH})
    new_rows.export_model(model, tok, d / "model", {"sid_map_hash": HASH, "new_token_ids": [first, end]})
    if trained_sft:
        (d / "data").mkdir()
        g = torch.Generator().manual_seed(seed)
        hist = [torch.randint(0, N_ITEMS, (3,), generator=g).tolist() for _ in range(40)]
        prompt = lambda h: [5, 6] + sum((sids[i].tolist() for i in h), [])  # noqa: E731
        rows = [{"task": "seqrec", "prompt_ids": prompt(h), "answer_ids": sids[(h[-1] + 1) % N_ITEMS].tolist() + [2]}
                for h in hist[:32]]
        rows += [{"task": "title2sid", "prompt_ids": [7, 8, 9, 10], "answer_ids": sids[0].tolist()}] * 2
        pl.DataFrame(rows, schema={"task": pl.Utf8, "prompt_ids": pl.List(pl.Int32),
                                   "answer_ids": pl.List(pl.Int32)}).write_parquet(d / "data" / "sft_train.parquet")
        pl.DataFrame({"prompt": [prompt(h) for h in hist[32:]], "target_row": [(h[-1] + 1) % N_ITEMS for h in hist[32:]]},
                     schema={"prompt": pl.List(pl.Int32), "target_row": pl.Int64}).write_parquet(d / "data" / "val.parquet")
        save_file({"sid_token_ids": sids.contiguous()}, str(d / "data" / "sid_token_ids.safetensors"))
    return d


def rl_cfg(run_dir, *overrides):
    return config.load(ROOT / "jobs" / "configs" / "tiny.yaml", [
        f"run_dir={run_dir}", "rl.enabled=true", "rl.steps=4", "rl.batch_size=4", "rl.group_size=4",
        "rl.val_every=2", "rl.checkpoint_every=2", "rl.lr=1e-2", "rl.kl_coef=0.04", "rl.stop_margin=null",
        "eval.beam_width=5", "eval.batch_users=8", *overrides])


def test_off_by_default_it_writes_only_its_manifest(tmp_path):
    run_dir = tmp_path / "run"
    make_upstream(run_dir, trained_sft=False)
    cfg = config.load(ROOT / "jobs" / "configs" / "tiny.yaml", [f"run_dir={run_dir}"])
    assert cfg.rl.enabled is False and cfg.rl.trains is False
    m = pipeline.run_stage(pipeline.spec("rl"), cfg, run_dir)
    assert m.outputs == {} and m.facts == {"enabled": False, "steps_done": 0}
    assert sorted(p.name for p in (run_dir / "rl").iterdir()) == ["_manifest.json", "config.yaml"]
    assert find_model_dir(run_dir) == ("sft", run_dir / "sft" / "model")


def test_rl_needs_sfts_training_rows(tmp_path):
    run_dir = tmp_path / "run"
    make_upstream(run_dir, trained_sft=False)
    with pytest.raises(DataError, match="train SFT first"):
        pipeline.run_stage(pipeline.spec("rl"), rl_cfg(run_dir), run_dir)


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
    assert len(fit.calls[1]["rows"]) == 32  # the seqrec rows only, not the grounding pairs
    f = m.facts
    assert f["enabled"] is True and f["steps_done"] == 4 and f["n_prompts"] == 32
    mrr = f["val_history"]["val_mrr"]
    assert [v["step"] for v in mrr] == [0, 2, 4]  # the SFT model first
    best = f["best"]
    assert best["metric"] == "val_mrr" and best["start"] == mrr[0]["value"]
    assert best["value"] == max(v["value"] for v in mrr) and best["step"] in (0, 2, 4)
    assert {"reward_mean", "kl", "clip_fraction", "zero_std_share", "time_share/rollout"} <= set(f["step_stats"])
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
