"""Stage `sft`: full supervised fine-tuning on next-item prediction, on Ray Train + DeepSpeed.

What it is for: starting from the grounded model (`ground/model/`, a standard HF folder whose
vocabulary already holds the SID tokens), train ALL parameters, the new rows included, on
user-history -> next-item examples (`gti.train.sft_data`), optionally mixed with the grounding
pairs (LC-Rec multitask), and export the result.

Flow:
1. Data (Ray Data): training windows over each user's training items are rendered into token
   rows by a `map_batches` actor (tokenizer loaded once per actor); the driver mixes in the
   grounding pairs, shuffles with the seed, and writes `data/sft_train.parquet` inside the
   stage's work dir (a rerun after a killed driver reuses it). Validation prompts for
   `sft.val_users` sampled validation users go to `data/val.parquet`.
2. Training: `gti.train.loop.fit` (the shared loop) with the SFT task's hooks
   (`gti.train.sft_task.HOOKS`: model, trainable tensors, validation):
   DeepSpeed ZeRO (`sft.zero_stage`, default 2; 3 supported), `sft.precision` (auto, bf16 or fp32; bf16 = autocast),
   gradient accumulation, warmup + cosine schedule, checkpoints under `ray_train/` through
   `ray.train.report` (a restarted worker group or a rerun driver resumes from the latest one;
   `FailureConfig(max_failures=sft.max_failures)`), and every `sft.val_every` steps Recall@10
   of constrained beam search on the validation users (`val_recall@10`), their teacher-forced
   loss on the target SID (`val_loss`) and, with `sft.val_mrr`, the mean reciprocal exact rank
   of the target among all catalog SIDs (`val_mrr`): learning curves that move before Recall.
   Optional LoRA (`sft.lora.enabled`): peft adapters on every linear layer of the backbone,
   the embedding matrix and the output head fully trainable (the paper's appendix variant);
   `sft.lora.quantize_4bit` (QLoRA) needs bitsandbytes and a GPU, else a ConfigError.
3. Export (`gti.train.sft_task.rebuild_trained`): the driver rebuilds the same module, loads the trained tensors from the final
   checkpoint's `trainable.safetensors`, merges LoRA adapters if any, and writes `model/`
   (standard HF folder + tokenizer + `gti_meta.json` with `sid_map_hash`) and
   `e_new_sft.safetensors` (`e_new`: the new-token input-embedding rows [V_new, d]).

What it does not know: how windows are cut or rendered (`gti.train.sft_data`), the training
loop's internals (`gti.train.loop`), or how the model will be evaluated (`evaluate`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gti.train.driver import STORAGE_DIR
from gti.errors import DataError, GtiError
from gti.manifest import atomic_write_json
from gti.contract import StageContext, StageResult
from gti.lm import templates
from gti.train import sft_data, sft_task
from gti.train.sft_task import VAL_K, VAL_METRIC, check_lora_supported, load_causal_lm, rebuild_trained

TASK = "sft"
DATA_DIR = "data"
TRAIN_FILE = "sft_train.parquet"
VAL_FILE = "val.parquet"
SIDS_FILE = "sid_token_ids.safetensors"
MODEL_DIR = "model"
E_NEW_FILE = "e_new_sft.safetensors"


# --------------------------------------------------------------------------- data
class RenderWindows:
    """`map_batches` callable class: training windows -> token rows (one tokenizer per actor)."""

    def __init__(self, tokenizer_dir: str, item_ids: list[str], sid_ids: np.ndarray,
                 system_prompt: str, max_len: int, trust_remote_code: bool,
                 prompt_style: str = "chat") -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
        self.renderer = templates.make_renderer(
            tok, dict(zip(item_ids, np.asarray(sid_ids))), system_prompt, max_len,
            prompt_style=prompt_style,
        )

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = self.renderer.render_windows(
            {c: batch.column(c).to_pylist() for c in ("history", "target", "template")}
        )
        return sft_data.rows_frame(rows).with_columns(
            history_kept=pl.Series(rows["history_kept"], dtype=pl.Int32),
            history_len=pl.Series([len(h) for h in batch.column("history").to_pylist()], dtype=pl.Int32),
        ).to_arrow()


def collect_blocks(ds) -> list[pa.Table]:
    """All output blocks of a Ray Dataset, in order; a GtiError raised inside a task (e.g. a
    too-small sft.max_len) is re-raised as itself, so the CLI prints its one line."""
    try:
        return [
            b if isinstance(b, pa.Table) else pa.Table.from_batches([b])
            for b in ds.iter_batches(batch_size=None, batch_format="pyarrow")
        ]
    except Exception as err:
        cause = err
        while cause is not None and not isinstance(cause, GtiError):
            cause = getattr(cause, "cause", None) or cause.__cause__
        if isinstance(cause, GtiError):
            raise type(cause)(str(cause)) from None
        raise


def _prepare_data(ctx: StageContext, tokenizer, sid_ids: dict[str, np.ndarray],
                  val_info: dict[str, Any]) -> dict[str, Any]:
    """Write data/sft_train.parquet and data/val.parquet; return their statistics."""
    import ray

    cfg, sc = ctx.cfg, ctx.cfg.sft
    data_dir = ctx.work_dir / DATA_DIR
    data_dir.mkdir(parents=True, exist_ok=True)
    stats_path = data_dir / "stats.json"
    train_path = data_dir / TRAIN_FILE
    if stats_path.is_file() and train_path.is_file() and (data_dir / VAL_FILE).is_file():
        ctx.log(f"reusing {train_path} from an interrupted attempt (same fingerprint)")
        return json.loads(stats_path.read_text())

    seq_path = ctx.input("ingest", "sequences")
    seqs = pl.read_parquet(seq_path)
    sft_data.check_sequences(seqs, str(seq_path))
    windows = sft_data.training_windows(seqs, cfg.data.max_history, seed=cfg.seed)
    sft_data.check_items_known(windows, sid_ids, str(seq_path))
    if windows.height == 0:
        raise DataError(f"{seq_path}: no user has 2 or more training items, so there is nothing to train on")
    ctx.log(f"{windows.height:,} training windows from {seqs.height:,} users (history <= {cfg.data.max_history})")

    t0 = time.time()
    item_ids = list(sid_ids)
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    ds = ray.data.from_arrow(windows.select("history", "target", "template").to_arrow()).map_batches(
        RenderWindows,
        fn_constructor_kwargs=dict(
            tokenizer_dir=str(ctx.input("pairs", "tokenizer")), item_ids=item_ids,
            sid_ids=np.stack([sid_ids[i] for i in item_ids]), system_prompt=cfg.pairs.system_prompt,
            max_len=sc.max_len, trust_remote_code=cfg.model.trust_remote_code,
            prompt_style=sc.prompt_style,
        ),
        batch_size=512, batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=cfg.data.parallelism or 1),
    )
    parts = collect_blocks(ds)
    rendered = pl.from_arrow(pa.concat_tables(parts))
    if rendered.height != windows.height:
        raise DataError(f"sft: rendered {rendered.height} rows for {windows.height} windows")
    truncated = int((rendered["history_kept"] < rendered["history_len"]).sum())
    ctx.log(f"rendered {rendered.height:,} examples in {time.time() - t0:.1f}s ({truncated:,} cut to sft.max_len={sc.max_len})")

    pairs = None
    if sc.multitask and sc.multitask_weight > 0:
        pairs = pl.read_parquet(ctx.input("pairs", "pairs"))
    mixed, mix = sft_data.multitask_mix(
        rendered.select(sft_data.ROW_COLUMNS), pairs, sc.multitask_weight if sc.multitask else 0.0,
        cfg.seed, sc.max_len,
    )
    mixed.write_parquet(train_path)

    # Validation users: a deterministic sample of the valid split.
    val_w = sft_data.eval_windows(seqs, "valid", cfg.data.max_history)
    users = sft_data.sample_users(val_w["user_id"].to_list(), sc.val_users, cfg.seed)
    val_w = val_w.filter(pl.col("user_id").is_in(users))
    renderer = templates.make_renderer(
        tokenizer, sid_ids, cfg.pairs.system_prompt, sc.max_len, prompt_style=sc.prompt_style
    )
    prompts = renderer.render_prompts(val_w.to_dict(as_series=False))
    row_of = {it: i for i, it in enumerate(val_info["item_ids"])}
    pl.DataFrame(
        {"user_id": prompts["user_id"], "prompt": prompts["prompt_ids"],
         "target_row": [row_of[t] for t in prompts["target"]]},
        schema={"user_id": pl.Utf8, "prompt": pl.List(pl.Int32), "target_row": pl.Int64},
    ).write_parquet(data_dir / VAL_FILE)

    stats = {
        "n_windows": windows.height,
        "n_train_rows": mixed.height,
        "truncated_examples": truncated,
        "tasks": mix.tasks,
        "multitask": {
            "enabled": bool(sc.multitask), "weight": sc.multitask_weight,
            "pairs_available": mix.n_pairs_available, "pairs_used": mix.n_pairs_used,
            "pairs_too_long": mix.n_pairs_too_long,
        },
        "val_users": val_w.height,
        "mean_tokens": float(mixed["input_ids"].list.len().mean()),
    }
    atomic_write_json(stats_path, stats)
    return stats


# --------------------------------------------------------------------------- training
def _fit(ctx: StageContext, loop_config: dict, train_path: Path):
    """Ray Train run through the shared driver helper `gti.train.loop.fit` (resume by name and
    storage path, FailureConfig, order-preserving shards, progress lines through ctx.log)."""
    import ray

    from gti.train import loop

    sc = ctx.cfg.sft
    # The rows are already shuffled with the seed (sft_data.multitask_mix); keep that order.
    # Materialised before the worker group reserves its CPUs: the streaming split then needs no
    # read task while the workers hold their slots (on a full cluster, with Tune trials or
    # compare arms side by side, a pending read would otherwise wait for ever).
    ds = ray.data.read_parquet(str(train_path), columns=["input_ids", "labels"]).materialize()
    from gti.tracking import open_tracker

    with open_tracker(ctx) as tracker:
        return loop.fit(
            loop_config, ds, sc, storage_path=(ctx.work_dir / STORAGE_DIR).resolve(), name=TASK,
            log=ctx.log, progress_every=max(1, sc.log_every), on_metrics=tracker.report,
        )


# --------------------------------------------------------------------------- stage entry
def run(ctx: StageContext, fault_injection: dict | None = None) -> StageResult:
    """Run the stage. `fault_injection` (tests only): {"fail_at_step", "fail_rank",
    "fail_marker"}, passed to the worker loop, which kills that worker once."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from gti.run_artifacts import check_sid_map_hash
    from gti.lm import vocab
    from gti.sid.codec import SidCodec
    from gti.stages._ray import ensure_ray

    cfg, sc = ctx.cfg, ctx.cfg.sft
    check_lora_supported(sc)
    if sc.use_gpu and sc.precision == "fp32":  # "auto" picks bf16 on GPUs that have it
        ctx.log("note: sft.use_gpu with sft.precision=fp32; bf16 is the usual choice on GPU (about half the memory)")
    sid_facts = ctx.manifest("sid").facts
    sid_map_hash = sid_facts["sid_map_hash"]
    pairs_facts = ctx.manifest("pairs").facts
    ground_dir = ctx.input("ground", "model")
    check_sid_map_hash(ground_dir, sid_map_hash)
    tokenizer = AutoTokenizer.from_pretrained(
        str(ctx.input("pairs", "tokenizer")), trust_remote_code=cfg.model.trust_remote_code
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    sid_map = pl.read_parquet(ctx.input("sid", "sid_map"))
    codec = SidCodec.from_facts(sid_facts)
    sid_ids = templates.sid_id_table(sid_map, codec, tokenizer)
    item_ids = sid_map["item_id"].to_list()
    sid_matrix = torch.from_numpy(np.stack([sid_ids[i] for i in item_ids]))
    new_start, new_end = int(sid_matrix.min()), int(sid_matrix.max()) + 1

    if sc.enabled and sc.steps > 0:
        ensure_ray(cfg)
        stats = _prepare_data(ctx, tokenizer, sid_ids, {"item_ids": item_ids})
        data_dir = (ctx.work_dir / DATA_DIR).resolve()
        save_file({"sid_token_ids": sid_matrix.contiguous()}, str(data_dir / SIDS_FILE))
        k = min(VAL_K, len(item_ids))
        loop_config: dict[str, Any] = {
            "task": TASK,
            "run_config": cfg.model_dump(mode="json"),
            "pad_id": int(pad_id),
            "hooks": sft_task.HOOKS,
            "sft": {"model_dir": str(ground_dir)},
            "val": {
                "path": str(data_dir / VAL_FILE), "sids_path": str(data_dir / SIDS_FILE),
                "new_start": new_start, "new_end": new_end, "levels": int(sid_matrix.shape[1]),
                "pad_id": int(pad_id), "k": k, "beam_width": max(k, cfg.eval.beam_width),
                "batch_users": cfg.eval.batch_users, "mrr": sc.val_mrr,
            },
        }
        if fault_injection:
            loop_config.update(fault_injection)
        ctx.log(
            f"SFT: {stats['n_train_rows']:,} rows {stats['tasks']}, {sc.steps} steps x batch {sc.batch_size} "
            f"(accum {sc.grad_accum}) on {sc.num_workers} worker(s), ZeRO-{sc.zero_stage} {sc.precision}, "
            f"{'LoRA r=%d' % sc.lora.r if sc.lora.enabled else 'all parameters'}"
        )
        t0 = time.time()
        result = _fit(ctx, loop_config, data_dir / TRAIN_FILE)
        ctx.log(f"training done in {time.time() - t0:.1f}s")
        model = rebuild_trained(ground_dir, cfg, result.state_dict)
        n_trainable = int(sum(t.numel() for t in result.state_dict.values()))
        history, steps_done = result.history, int(result.steps_done)
        resolved_precision, timing = result.precision or sc.precision, result.timing
    else:
        # An ablation arm without SFT: the grounded model is exported unchanged.
        ctx.log("sft.enabled is false or sft.steps is 0: exporting the grounded model unchanged")
        model = load_causal_lm(ground_dir, cfg)
        stats, n_trainable, history, steps_done = {}, 0, {"loss": [], "val": {}}, 0
        resolved_precision, timing = None, None
    first_new, end_new = (int(x) for x in pairs_facts["new_token_ids"])
    e_new = model.get_input_embeddings().weight[first_new:end_new].detach().float().contiguous()
    meta = dict(vocab.read_meta(ground_dir))
    meta.update({"sid_map_hash": sid_map_hash, "stage": TASK, "new_token_ids": [first_new, end_new]})
    vocab.export_model(model, tokenizer, ctx.work_dir / MODEL_DIR, meta)
    save_file({"e_new": e_new}, str(ctx.work_dir / E_NEW_FILE))

    losses = history["loss"]
    val_hist = [{"step": int(s), "value": float(v)} for s, v in history["val"].get(VAL_METRIC, [])]
    if losses:
        ctx.log(
            f"loss {losses[0][1]:.4f} -> {losses[-1][1]:.4f}"
            + (f"; {VAL_METRIC} {val_hist[-1]['value']:.4f}" if val_hist else "")
        )
    return StageResult(
        outputs={"model": MODEL_DIR, "sft_embeddings": E_NEW_FILE},
        facts={
            "steps_done": steps_done,
            "final_loss": float(losses[-1][1]) if losses else None,
            "first_loss": float(losses[0][1]) if losses else None,
            "loss_history": [{"step": int(s), "value": float(v)} for s, v in losses],
            VAL_METRIC: val_hist,
            # Every validation metric's curve (val_recall@10, val_loss, val_mrr with sft.val_mrr).
            "val_history": {k: [{"step": int(st), "value": float(x)} for st, x in pts]
                            for k, pts in history["val"].items()},
            "sid_map_hash": sid_map_hash,
            "new_token_ids": [first_new, end_new],
            "trainable_params": n_trainable,
            "lora": sc.lora.model_dump() if sc.lora.enabled else None,
            "zero_stage": sc.zero_stage,
            "precision": resolved_precision,
            "precision_setting": sc.precision,
            "timing": timing,
            "prompt_style": sc.prompt_style,
            "num_workers": sc.num_workers,
            **stats,
        },
    )
