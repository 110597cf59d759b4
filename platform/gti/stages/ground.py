"""Stage `ground`: extend the LM's vocabulary with the SID tokens, initialise the new rows
(`init.method`), and ground them on the pair data set with Ray Train + DeepSpeed.

What it is for: the base model is loaded with the `pairs` stage's extended tokenizer; the new
rows are initialised from the REAL old rows (`gti.lm.init`); with `ground.enabled` they are
grounded by `gti.train.ground_run.run_grounding` (the runner `gti refresh` and `gti vocab
ground` use too), else exported as initialised (the plain init arms). The model is exported as a
standard HF folder with the rows before and after grounding beside it. Outputs and facts:
docs/ARCHITECTURE.md.

What it does NOT know: how pairs are rendered, how the runner and the loop train
(gti.train.ground_run, gti.train.loop), SFT.
"""

from __future__ import annotations

import shutil
from typing import Any

import pyarrow.parquet as pq
import torch

from gti.train.ray_train import STORAGE_DIR
from gti.data.descriptions import description_text
from gti.common.errors import DataError, GateError
from gti.common.arms import arm_name
from gti.run.contract import StageContext, StageResult

MODEL_DIR = "model"
INIT_FILE = "e_new_init.safetensors"
GROUND_FILE = "e_new_ground.safetensors"
RAY_DIR = STORAGE_DIR  # gti.train.ray_train.STORAGE_DIR
VAL_FILE = "val_prompts.parquet"
SIDS_FILE = "catalog_sids.safetensors"


# --------------------------------------------------------------------------- helpers
def _item_codes(ctx: StageContext, levels: int) -> tuple[list[str], torch.Tensor]:
    """(item ids, codes LongTensor[N, L]) of the sid map, in file order."""
    t = pq.read_table(ctx.input("sid", "sid_map"), columns=["item_id", "codes"])
    codes = t.column("codes").to_pylist()
    if any(len(c) != levels for c in codes):
        raise DataError(f"{ctx.input('sid', 'sid_map')}: a row's codes do not have {levels} levels")
    return t.column("item_id").to_pylist(), torch.tensor(codes, dtype=torch.long).reshape(len(codes), levels)


def _description_token_ids(ctx: StageContext, tokenizer, item_ids: list[str]) -> list[list[int]]:
    """Token ids of each item's description (pseudo-description where it has none, exactly as
    the pairs stage words it), aligned with `item_ids`."""
    path = ctx.input("ingest", "items")
    t = pq.read_table(path, columns=["item_id", "title", "description", "category", "attributes_text"]).to_pydict()
    pos = {iid: i for i, iid in enumerate(t["item_id"])}
    texts = []
    for iid in item_ids:
        i = pos.get(iid)
        if i is None:
            raise DataError(f"{path}: item '{iid}' of the SID map is missing")
        d, _ = description_text(t["title"][i] or "", t["description"][i] or "", t["category"][i] or "",
                                t["attributes_text"][i] or "", ctx.cfg.pairs.max_desc_chars)
        texts.append(d)
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def initial_rows(ctx: StageContext, model, tokenizer, n_real: int, n_new: int) -> dict[str, torch.Tensor]:
    """{"e_new": [n_new, d]} (+ "head_new" for an untied head) for `ctx.cfg.init.method`."""
    from safetensors.torch import load_file

    from gti.lm import init as lm_init
    from gti.lm import new_rows

    cfg = ctx.cfg
    method = cfg.init.method
    sf = ctx.manifest("sid").facts
    kw: dict[str, Any] = {"noise_std": cfg.init.noise_std, "codebook_sizes": list(sf["codebook_sizes"])}
    if method == "description":
        item_ids, codes = _item_codes(ctx, int(sf["levels"]))
        kw["item_codes"] = codes
        kw["item_token_ids"] = _description_token_ids(ctx, tokenizer, item_ids)
    if method == "codebook":
        cb = load_file(str(ctx.input("sid", "codebooks")))
        kw["codebooks"] = [cb[f"level_{i}"] for i in range(len(cb)) if f"level_{i}" in cb]
    out = {
        "e_new": lm_init.init_rows(method, new_rows.old_rows(model, n_real), n_new,
                                   generator=torch.Generator().manual_seed(cfg.seed), **kw)
    }
    if model.get_output_embeddings() is not None and not new_rows.heads_tied(model):
        out["head_new"] = lm_init.init_rows(
            method, new_rows.old_rows(model, n_real, which="output"), n_new,
            generator=torch.Generator().manual_seed(cfg.seed + 1), **kw,
        )
    return out


# --------------------------------------------------------------------------- the stage
def run(ctx: StageContext, run_name: str | None = None, callbacks: list | None = None) -> StageResult:
    """Stage entry point. `run_name` / `callbacks` let `gti tune` run a trial through this
    exact code (deterministic trial run names; `TuneReportCallback`). The new-token id range
    comes from the pairs manifest, never from the matrix size, and pairs made from another SID
    map are refused."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from gti.sid.codec import SidCodec
    from gti.train.ground_task import export_grounded, load_base_model

    cfg, g = ctx.cfg, ctx.cfg.ground
    work = ctx.work_dir
    pf, sf = ctx.manifest("pairs").facts, ctx.manifest("sid").facts
    if pf.get("sid_map_hash") != sf.get("sid_map_hash"):
        raise GateError(
            f"pairs were built from SID map {pf.get('sid_map_hash')} but the sid stage has "
            f"{sf.get('sid_map_hash')}; rerun from the pairs stage"
        )
    first, end = (int(x) for x in pf["new_token_ids"])
    n_new, n_real = end - first, int(pf["vocab_size_before"])
    codec = SidCodec.from_facts(sf)
    first_sid, end_sid = first, first + codec.num_tokens  # markers, if any, follow the SIDs
    tokenizer = AutoTokenizer.from_pretrained(str(ctx.input("pairs", "tokenizer")))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if len(tokenizer) != end:
        raise DataError(f"{ctx.input('pairs', 'tokenizer')}: has {len(tokenizer)} tokens, pairs facts say {end}")

    ctx.log(f"loading {cfg.model.name}; init '{cfg.init.method}' for {n_new} new rows [{first}, {end})")
    model = load_base_model(cfg)
    init = initial_rows(ctx, model, tokenizer, n_real, n_new)
    save_file({k: v.contiguous() for k, v in init.items()}, str(work / INIT_FILE))

    grounded = g.enabled and g.steps > 0
    facts: dict[str, Any] = {
        "init_method": cfg.init.method,
        "grounded": grounded,
        "arm": arm_name(cfg.init.method, grounded),
        "new_token_ids": [first, end],
        "sid_token_ids": [first_sid, end_sid],
        "sid_map_hash": sf["sid_map_hash"],
        "trainable_params": int(sum(v.numel() for v in init.values())),
        "steps_done": 0,
        "final_loss": None,
        "val_exact_match": [],
    }
    final = init
    if grounded:
        final, train_facts = _ground(ctx, init, first, end, first_sid, end_sid, codec, tokenizer,
                                     run_name or "ground", callbacks)
        facts.update(train_facts)
    else:
        ctx.log("ground.enabled is false or ground.steps is 0: exporting the initialised rows")
    facts["rows"] = _row_shift(model, init, final, n_real)
    from gti.diagnostics.summary import format_grounding

    ctx.log(format_grounding(facts))  # the line the end-of-run summary prints

    meta = {
        "stage": "ground",
        "sid_map_hash": sf["sid_map_hash"],
        "new_token_ids": [first, end],
        "sid_token_ids": [first_sid, end_sid],
        "init_method": cfg.init.method,
        "grounded": grounded,
        "steps_done": facts["steps_done"],
    }
    export_grounded(model, tokenizer, first, init, final, work / MODEL_DIR, meta)
    save_file({k: v.contiguous() for k, v in final.items()}, str(work / GROUND_FILE))
    # Training checkpoints are only needed to resume; the exported model replaces them.
    shutil.rmtree(work / RAY_DIR, ignore_errors=True)
    ctx.log(f"exported {work / MODEL_DIR}")
    return StageResult(
        outputs={"model": MODEL_DIR, "init_embeddings": INIT_FILE, "ground_embeddings": GROUND_FILE},
        facts=facts,
    )


def _row_shift(model, init: dict[str, torch.Tensor], final: dict[str, torch.Tensor], n_real: int) -> dict[str, Any]:
    """`geometry.row_shift` of the new input rows (the work grounding did: the summary prints
    it), scaled by the model's old input rows [:n_real]."""
    from gti.diagnostics.geometry import row_shift

    old = model.get_input_embeddings().weight[:n_real]
    return row_shift(init["e_new"], final["e_new"], old)


def _ground(ctx: StageContext, init, first, end, first_sid, end_sid, codec, tokenizer,
            run_name: str, callbacks) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The grounding run (`gti.train.ground_run.run_grounding`) on the pairs stage's pairs,
    validated on held-out text->SID pairs against the catalog's SIDs by constrained exact match
    (backbone and old rows frozen; resumable after a killed driver)."""
    from safetensors.torch import save_file

    from gti.ray_start import ensure_ray
    from gti.common.tracking import open_tracker
    from gti.train.ground_run import GroundingInputs, run_grounding, write_val_set
    from gti.train.worker_config import GroundRows, ValSet

    cfg, work = ctx.cfg, ctx.work_dir
    _, codes = _item_codes(ctx, codec.levels)
    save_file({"sid_token_ids": codec.token_ids(codes, tokenizer).contiguous()}, str(work / SIDS_FILE))
    n_val = write_val_set(ctx.input("pairs", "pairs"), work / VAL_FILE, seed=cfg.seed, n_samples=cfg.ground.val_samples,
                          first_sid=first_sid, end_sid=end_sid, levels=codec.levels)
    inputs = GroundingInputs(
        run_cfg=cfg, pairs_path=ctx.input("pairs", "pairs"), pad_id=int(tokenizer.pad_token_id),
        rows=GroundRows(str(work / INIT_FILE), first, end - first),
        val=ValSet(str(work / VAL_FILE), str(work / SIDS_FILE), first, end, codec.levels) if n_val else None,
    )
    # A Tune trial (run_name from the trial) writes beside the others: tensorboard/tune/<name>/.
    res = run_grounding(inputs, storage_path=work / RAY_DIR, name=run_name, start_ray=lambda: ensure_ray(cfg),
                        log=ctx.log, callbacks=callbacks,
                        tracker=lambda: open_tracker(ctx, "ground" if run_name == "ground" else f"tune/{run_name}"))
    return res.state_dict, res.facts
