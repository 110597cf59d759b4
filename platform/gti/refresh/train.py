"""Steps 6-7 of `gti refresh`: teach the parent model the new SIDs, optionally a short SFT.

What it is for: `ground_step` runs the grounding task (only the SID rows train) through the
`ground` stage's runner (`gti.train.ground_run.run_grounding`, Ray Train + DeepSpeed) on
`<work>/pairs.parquet` -> `<work>/ground_model/`; `sft_step` the SFT task through the `sft`
stage's runner (`gti.train.sft_run.run_sft`) on the windows of the users the new interactions
touch -> `<work>/sft_model/`. Both resume from their last Ray Train checkpoint under
`<work>/ray_train/` when rerun. Settings and what they measured: docs/refresh.md.

What it does not know: how the new items were read or given SIDs (it reads the step files),
the version folder's layout beyond the work folder.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gti.common.errors import DataError
from gti.refresh.attempt import GROUND_RUN, RAY_DIR, SFT_RUN, Job
from gti.train.worker_config import FaultInjection

START_FILE = "e_new_start.safetensors"  # the base model's SID rows, where grounding starts
VAL_FILE = "val_prompts.parquet"
SIDS_FILE = "catalog_sids.safetensors"


def _start_rows(model, first: int, end: int) -> dict:
    from gti.lm import new_rows

    out = {"e_new": model.get_input_embeddings().weight[first:end].detach().float().clone()}
    head = model.get_output_embeddings()
    if head is not None and not new_rows.heads_tied(model):
        out["head_new"] = head.weight[first:end].detach().float().clone()
    return out


def val_source(new: pa.Table) -> tuple[pa.Table, bool]:
    """(the new pairs with the validation split to use, in_sample): their held-out text->SID
    pairs, else (few new items, none held out) their training text->SID pairs, in-sample."""
    from gti.train.ground_run import VAL_TASKS

    is_t2s = pc.is_in(new.column("task"), pa.array(list(VAL_TASKS)))
    held = pc.and_(is_t2s, pc.equal(new.column("split"), "val"))
    in_sample = not pc.any(held).as_py()
    if in_sample:
        new = new.set_column(new.schema.get_field_index("split"), "split",
                             pc.if_else(is_t2s, pa.scalar("val"), new.column("split")))
    return new, in_sample


def _write_validation(job: Job, gcfg, codec, first: int, end: int, tok) -> tuple[int, bool]:
    """The validation prompts of the new items and the catalog's SID token ids, in the work
    folder; (number of prompts, in_sample). The SID tokens of an answer are found by id (the
    codec's ids in `tok`): after added codes they are not one contiguous range (markers, if
    any, sit between the run's SID tokens and the added ones)."""
    import torch
    from safetensors.torch import save_file

    from gti.train.ground_run import write_val_set

    new, in_sample = val_source(pq.read_table(str(job.work / "pairs_new.parquet")))
    pq.write_table(new, str(job.work / "val_source.parquet"))
    table = codec.code_to_token_id_table(tok)
    sid_ids = frozenset(int(i) for i in table[table >= 0].tolist())
    n_val = write_val_set(job.work / "val_source.parquet", job.work / VAL_FILE, seed=gcfg.seed,
                          n_samples=gcfg.ground.val_samples, first_sid=first, end_sid=end, levels=codec.levels,
                          sid_ids=sid_ids)
    smap = pq.read_table(str(job.work / "sid" / "sid_map.parquet"), columns=["codes"])
    codes = torch.tensor(smap.column("codes").to_pylist(), dtype=torch.long)
    save_file({"sid_token_ids": codec.token_ids(codes, tok).contiguous()}, str(job.work / SIDS_FILE))
    return n_val, in_sample


def ground_step(job: Job, fault_injection: FaultInjection | None) -> dict:
    """Step 6: `refresh.ground_steps` steps of the grounding task (backbone and every non-SID row
    frozen, only the SID rows train) on `<work>/pairs.parquet`, continuing from
    `job.base_model_dir` (the parent's model, or `<work>/grown_model/` when the tokens step
    appended code tokens); its starting rows are that model's SID rows `job.token_range()`, which
    cover the added tokens too, so they train with the others. Validation: constrained text->SID
    exact match on the new items (`val_source`, `_write_validation`). -> `<work>/ground_model/`;
    nothing trains with `refresh.ground_steps: 0`. fault_injection (tests) goes to the training
    loop."""
    from safetensors.torch import save_file

    from gti.lm import models, new_rows
    from gti.sid.codec import SidCodec
    from gti.ray_start import ensure_ray
    from gti.train.ground_run import GroundingInputs, check_pairs, run_grounding
    from gti.train.worker_config import GroundRows, ValSet

    cfg, rc, w = job.cfg, job.cfg.refresh, job.work
    base = job.base_model_dir
    if rc.ground_steps == 0:
        grown = base != job.parent.model_dir
        job.log("ground: refresh.ground_steps=0: SIDs only, the parent's model is kept as it is"
                + (" (with the added code tokens, their rows untrained at their level's mean)" if grown else ""))
        return {"steps_done": 0, "grounded": False}
    first, end = job.token_range()
    g = cfg.ground.model_copy(update={"steps": rc.ground_steps, "lr": rc.ground_lr_from(cfg.ground.lr)})
    gcfg = cfg.model_copy(update={"ground": g, "model": cfg.model.model_copy(update={"name": str(base)})})
    check_pairs(w / "pairs.parquet", g)  # too few pairs fail here, before the model is loaded
    codec = SidCodec.from_facts(job.map_facts())
    tok = job.tokenizer()
    model, _ = models.load_model_and_tokenizer(cfg.model, path=base)
    start = _start_rows(model, first, end)
    save_file({k: v.contiguous() for k, v in start.items()}, str(w / START_FILE))
    n_val, in_sample = _write_validation(job, gcfg, codec, first, end, tok)
    inputs = GroundingInputs(
        run_cfg=gcfg, pairs_path=w / "pairs.parquet", rows=GroundRows(str(w / START_FILE), first, end - first),
        pad_id=int(tok.pad_token_id), fault=fault_injection,
        val=ValSet(str(w / VAL_FILE), str(w / SIDS_FILE), first, end, codec.levels) if n_val else None,
        note=f"from {base}; SID rows [{first}, {end}); {'in-sample' if in_sample else 'held-out'} validation",
    )
    res = run_grounding(inputs, storage_path=w / RAY_DIR, name=GROUND_RUN, start_ray=lambda: ensure_ray(cfg),
                        log=lambda m: job.log(f"ground: {m}"))
    new_rows.attach_new_rows(model, first, end - first, start["e_new"], start.get("head_new"))
    new_rows.load_new_rows_state_dict(model, res.state_dict)
    new_rows.export_model(model, tok, w / "ground_model", dict(new_rows.read_meta(base)))
    f = res.facts
    return {
        "grounded": True, "steps_done": f["steps_done"], "lr": g.lr, "first_loss": f["first_loss"],
        "final_loss": f["final_loss"], "val_exact_match": f["val_exact_match"],
        "val_in_sample": in_sample, "val_prompts": n_val, "train_pairs": f["train_pairs"],
    }


def select_windows(seqs, touched, max_history: int, replay_ratio: float, seed: int):
    """The refresh SFT's training windows: every window of the users in `touched` (a user_id
    Series) and, with `replay_ratio` > 0, a seeded sample of round(replay_ratio x that many)
    windows of the other users (all of them when there are fewer), so a short SFT on the new
    interactions also sees the targets of users it did not touch (as grounding replays old
    pairs). -> (windows frame, {"touched_users", "touched_windows", "replay_windows"})."""
    import polars as pl

    from gti.train import sft_data

    is_touched = pl.col("user_id").is_in(touched.implode())
    mine = seqs.filter(is_touched)
    windows = sft_data.training_windows(mine, max_history, seed=seed)
    if windows.height == 0:
        raise DataError("refresh.sft_steps > 0 but no touched user has 2 or more training items "
                        "in the merged sequences: nothing to train on")
    replay = windows.head(0)
    if replay_ratio > 0:
        others = sft_data.training_windows(seqs.filter(~is_touched), max_history, seed=seed)
        replay = others.sample(n=min(others.height, round(replay_ratio * windows.height)), seed=seed)
    facts = {"touched_users": mine.height, "touched_windows": windows.height, "replay_windows": replay.height}
    return pl.concat([windows, replay]), facts


def _sft_windows(job: Job, tok):
    """(the touched users' training windows, and the replayed ones, rendered as SFT rows;
    select_windows' facts)."""
    import polars as pl

    from gti.lm import templates
    from gti.sid.codec import SidCodec
    from gti.train import sft_data
    from gti.lm.templates import ROW_COLUMNS

    cfg = job.cfg
    smap = pl.read_parquet(job.work / "sid" / "sid_map.parquet")
    sid_ids = templates.sid_id_table(smap, SidCodec.from_facts(job.map_facts()), tok)
    seqs = pl.read_parquet(job.work / "ingest" / "sequences.parquet")
    touched = pl.read_parquet(job.work / "ingest" / "touched_users.parquet")["user_id"]
    windows, facts = select_windows(seqs, touched, cfg.data.max_history, cfg.refresh.sft_replay_ratio, cfg.seed)
    renderer = templates.make_renderer(tok, sid_ids, cfg.pairs.system_prompt, cfg.sft.max_len,
                                       prompt_style=cfg.sft.render_style)
    rows = renderer.render_windows(windows.select("history", "target", "template").to_dict(as_series=False))
    return sft_data.rows_frame(rows).select(ROW_COLUMNS), facts


def sft_step(job: Job) -> dict:
    """Step 7: `refresh.sft_steps` steps of the SFT task on the training windows of the users the
    new interactions touch (+ `refresh.sft_replay_ratio` x as many windows of other users,
    `select_windows`), from the grounded model (else `job.base_model_dir`) -> `<work>/sft_model/`;
    nothing when `refresh.sft_steps` is 0."""
    import numpy as np

    from gti.lm import new_rows
    from gti.ray_start import ensure_ray
    from gti.train.sft_run import SftInputs, run_sft
    from gti.train.sft_task import rebuild_trained

    cfg, rc = job.cfg, job.cfg.refresh
    if rc.sft_steps == 0:
        return {"steps_done": 0}
    start = job.work / "ground_model"
    if not (start / "config.json").is_file():
        start = job.base_model_dir
    tok = job.tokenizer()
    frame, facts = _sft_windows(job, tok)
    order = np.random.default_rng([cfg.seed, job.k, 0x5F7]).permutation(frame.height)
    train_path = job.work / "sft_train.parquet"
    frame[order].write_parquet(train_path)
    s = cfg.sft.model_copy(update={"steps": rc.sft_steps, **({"lr": rc.sft_lr} if rc.sft_lr else {})})
    scfg = cfg.model_copy(update={"sft": s})
    job.log(f"sft: {s.steps} steps x batch {s.batch_size} on {facts['touched_windows']} windows of "
            f"{facts['touched_users']} touched users + {facts['replay_windows']} replayed windows of other "
            f"users, from {start}")
    res = run_sft(SftInputs(run_cfg=scfg, train_path=train_path, model_dir=start, pad_id=int(tok.pad_token_id)),
                  storage_path=(job.work / RAY_DIR).resolve(), name=SFT_RUN, start_ray=lambda: ensure_ray(cfg),
                  log=lambda m: job.log(f"sft: {m}"))
    model = rebuild_trained(start, scfg, res.state_dict)
    new_rows.export_model(model, tok, job.work / "sft_model", dict(new_rows.read_meta(start)))
    f = res.facts
    return {"steps_done": f["steps_done"], "lr": s.lr, "windows": frame.height, "users": facts["touched_users"],
            **facts, "first_loss": f["first_loss"], "final_loss": f["final_loss"]}
