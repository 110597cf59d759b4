"""Stage `rl`: GRPO after SFT (`rl.enabled`, off by default), on Ray Train + DeepSpeed.

What it is for: starting from the SFT model (`sft/model/`), train every parameter with GRPO
(`gti.train.rl_run.run_rl`: per rollout batch, `rl.group_size` candidate SIDs per training prompt
by trie-constrained decoding, rewarded against the prompt's target; then `rl.updates_per_rollout`
clipped updates with `rl.kl_coef` x KL to the SFT model) and export the best validation's model
to `model/`. The prompts are sampled training windows (validation and test items never reach a
rollout); the validation users are SFT's. Disabled (or `rl.steps` 0), the stage writes only its
manifest and the SFT model stays the run's model (`gti.run.versions.find_model_dir`).

What it does not know: how SFT trained, the loop's internals, or how the model is evaluated.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch

from gti.run.contract import StageContext, StageResult
from gti.common.errors import DataError
from gti.train.ray_train import STORAGE_DIR
from gti.train.rl_run import RlInputs, rl_prompt_rows, run_rl
from gti.train.sft_task import VAL_K
from gti.train.worker_config import FaultInjection, RlStart, ValSet

TASK = "rl"
MODEL_DIR = "model"
ROWS_FILE = "rl_train.parquet"
VAL_FILE = "val.parquet"
SIDS_FILE = "sid_token_ids.safetensors"


def run(ctx: StageContext, fault_injection: FaultInjection | None = None) -> StageResult:
    """Run the stage. `fault_injection` (tests only) goes to the worker loop. Checkpoints live
    under `ray_train/` in the stage's work dir, so a rerun after a killed driver resumes."""
    cfg = ctx.cfg
    if not cfg.rl.trains:
        ctx.log("rl.enabled is false (or rl.steps is 0): the SFT model stays the run's model")
        return StageResult(outputs={}, facts={"enabled": False, "steps_done": 0})
    from gti.run.versions import check_exact_map

    sid_map_hash = ctx.manifest("sid").facts["sid_map_hash"]
    sft_dir = ctx.input("sft", "model")
    check_exact_map(sft_dir, sid_map_hash)
    res, facts = _train(ctx, sft_dir, fault_injection)
    _export(ctx, sft_dir, res.state_dict, sid_map_hash)
    best = facts["best"] or {}
    ctx.log(f"best {best.get('metric')} {best.get('value')} at step {best.get('step')} (SFT model: "
            f"{best.get('start')}); reward_mean {facts['step_stats'].get('reward_mean', float('nan')):.3f}"
            + (f"; stopped early at step {facts['stopped_at']}" if facts["stopped_at"] else ""))
    return StageResult(outputs={"model": MODEL_DIR}, facts={**facts, "enabled": True, "sid_map_hash": sid_map_hash})


def _data(ctx: StageContext, tokenizer) -> tuple[Path, Path, Path, torch.Tensor]:
    """rl_train.parquet (the prompts), val.parquet (SFT's validation users) and the catalog's
    SID tokens [N, L] (sid_token_ids.safetensors), written once into the work dir (a rerun after
    a killed driver reuses them: same fingerprint). The prompts are `rl.steps` x `rl.batch_size`
    sampled training windows (training items only), rendered as evaluate renders its prompts;
    the validation users are SFT's (`sft.val_users`, the same seeded sample)."""
    from safetensors.torch import load_file, save_file

    from gti.data.sequences import check_sequences
    from gti.lm import templates
    from gti.sid.codec import SidCodec
    from gti.train import sft_data

    cfg, rc = ctx.cfg, ctx.cfg.rl
    rows_path, val_path, sids_path = (ctx.work_dir / n for n in (ROWS_FILE, VAL_FILE, SIDS_FILE))
    if not (rows_path.is_file() and val_path.is_file() and sids_path.is_file()):
        sid_map = pl.read_parquet(ctx.input("sid", "sid_map"))
        sid_ids = templates.sid_id_table(sid_map, SidCodec.from_facts(ctx.manifest("sid").facts), tokenizer)
        item_ids = sid_map["item_id"].to_list()
        seq_path = ctx.input("ingest", "sequences")
        seqs = pl.read_parquet(seq_path)
        check_sequences(seqs, str(seq_path))
        windows = sft_data.training_windows(seqs, cfg.data.max_history, seed=cfg.seed)
        sft_data.check_items_known(windows, sid_ids, str(seq_path))
        renderer = templates.make_renderer(tokenizer, sid_ids, cfg.pairs.system_prompt, cfg.sft.max_len,
                                           prompt_style=cfg.sft.render_style)
        rl_prompt_rows(windows, renderer, sid_ids, rc.steps * rc.batch_size, cfg.seed).write_parquet(rows_path)
        sft_data.val_prompt_table(seqs, renderer, item_ids, cfg.sft.val_users, cfg.seed,
                                  cfg.data.max_history).write_parquet(val_path)
        save_file({"sid_token_ids": torch.from_numpy(np.stack([sid_ids[i] for i in item_ids])).contiguous()},
                  str(sids_path))
    return rows_path.resolve(), val_path.resolve(), sids_path.resolve(), load_file(str(sids_path))["sid_token_ids"]


def _train(ctx: StageContext, sft_dir, fault_injection: FaultInjection | None) -> tuple[Any, dict[str, Any]]:
    """The prompts and validation set, then `run_rl` on them."""
    from transformers import AutoTokenizer

    from gti.ray_start import ensure_ray
    from gti.common.tracking import open_tracker

    cfg, rc = ctx.cfg, ctx.cfg.rl
    ensure_ray(cfg)
    tok = AutoTokenizer.from_pretrained(str(sft_dir), trust_remote_code=cfg.model.trust_remote_code)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rows_path, val_path, sids_path, sids = _data(ctx, tok)
    n_rows = pl.scan_parquet(rows_path).select(pl.len()).collect().item()
    if n_rows < rc.batch_size:
        raise DataError(f"{ctx.input('ingest', 'sequences')}: {n_rows} training windows, fewer than "
                        f"rl.batch_size={rc.batch_size}")
    levels, new_start, new_end = int(sids.shape[1]), int(sids.min()), int(sids.max()) + 1
    k = min(VAL_K, int(sids.shape[0]))
    val = ValSet(path=str(val_path), sids_path=str(sids_path), new_start=new_start, new_end=new_end, levels=levels,
                 k=k, beam_width=max(k, cfg.eval.beam_width), batch_users=cfg.eval.batch_users, mrr=True)
    inputs = RlInputs(run_cfg=cfg, train_path=rows_path, pad_id=int(pad_id), val=val, fault=fault_injection,
                      start=RlStart(str(sft_dir), str(sids_path), new_start, new_end, levels))
    ctx.log(f"RL: {n_rows:,} prompts, {rc.steps} steps x {rc.batch_size} prompts x {rc.group_size} {rc.rollout} "
            f"rollouts, {rc.updates_per_rollout} update(s) per rollout, reward {rc.reward}, kl_coef {rc.kl_coef}, "
            f"on {rc.num_workers} worker(s)")
    t0 = time.time()
    res = run_rl(inputs, storage_path=(ctx.work_dir / STORAGE_DIR).resolve(), name=TASK,
                 start_ray=lambda: ensure_ray(cfg), log=ctx.log, tracker=lambda: open_tracker(ctx))
    ctx.log(f"training done in {time.time() - t0:.1f}s")
    return res, {**res.facts, "n_prompts": n_rows, "reward": rc.reward, "rollout": rc.rollout,
                 "group_size": rc.group_size, "kl_coef": rc.kl_coef}


def _export(ctx: StageContext, sft_dir, state, sid_map_hash: str) -> None:
    """model/: the SFT model with the kept tensors (the best validation's by exact MRR; the SFT
    model itself when no RL step beat it), its tokenizer and gti_meta.json: a standard HF
    folder."""
    from transformers import AutoTokenizer

    from gti.lm import new_rows
    from gti.train.rl_task import rebuild_trained

    model = rebuild_trained(sft_dir, ctx.cfg, state)
    tok = AutoTokenizer.from_pretrained(str(sft_dir), trust_remote_code=ctx.cfg.model.trust_remote_code)
    meta = dict(new_rows.read_meta(sft_dir))
    meta.update({"sid_map_hash": sid_map_hash, "stage": TASK})
    new_rows.export_model(model, tok, ctx.work_dir / MODEL_DIR, meta)
