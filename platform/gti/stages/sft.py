"""Stage `sft`: full supervised fine-tuning on next-item prediction, on Ray Train + DeepSpeed.

What it is for: starting from the grounded model (`ground/model/`, whose vocabulary already holds
the SID tokens), train ALL parameters on user-history -> next-item examples, optionally mixed
with the grounding pairs (LC-Rec multitask), and export the result. The rows are rendered once
into the work dir, so a rerun after a killed driver reuses them; training is
`gti.train.sft_run.run_sft`, the SFT runner `gti refresh` uses too; the export rebuilds the module
from the final checkpoint and writes a standard HF folder plus the new rows. Outputs and facts:
docs/ARCHITECTURE.md.

What it does not know: how windows are cut or rendered (`gti.train.sft_data`), the training
loop's internals (`gti.train.loop`), or how the model will be evaluated (`evaluate`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import torch

from gti.train.ray_train import STORAGE_DIR
from gti.common.errors import DataError, GtiError
from gti.common.files import atomic_write_json
from gti.run.contract import StageContext, StageResult
from gti.data.sequences import check_sequences
from gti.lm import templates
from gti.train import sft_data
from gti.lm.templates import ROW_COLUMNS
from gti.train.sft_run import SftInputs, history_facts, run_sft
from gti.train.sft_task import VAL_K, VAL_METRIC, check_lora_supported, load_causal_lm, rebuild_trained
from gti.train.worker_config import FaultInjection, ValSet

TASK = "sft"
DATA_DIR = "data"
TRAIN_FILE = "sft_train.parquet"
VAL_FILE = "val.parquet"
SIDS_FILE = "sid_token_ids.safetensors"
MODEL_DIR = "model"
E_NEW_FILE = "e_new_sft.safetensors"
RENDER_BATCH = 512  # training windows per RenderWindows call (Ray Data batch or local slice)


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
        if "items" in batch.column_names:  # sft.objective: sequence (chunks, not windows)
            rows = self.renderer.render_windows({"items": batch.column("items").to_pylist()})
            lengths = [len(h) - 1 for h in batch.column("items").to_pylist()]
        else:
            rows = self.renderer.render_windows(
                {c: batch.column(c).to_pylist() for c in ("history", "target", "template")}
            )
            lengths = [len(h) for h in batch.column("history").to_pylist()]
        return sft_data.rows_frame(rows).with_columns(
            history_kept=pl.Series(rows["history_kept"], dtype=pl.Int32),
            history_len=pl.Series(lengths, dtype=pl.Int32),
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
    sc = ctx.cfg.sft
    data_dir = ctx.work_dir / DATA_DIR
    data_dir.mkdir(parents=True, exist_ok=True)
    stats_path = data_dir / "stats.json"
    train_path = data_dir / TRAIN_FILE
    if stats_path.is_file() and train_path.is_file() and (data_dir / VAL_FILE).is_file():
        ctx.log(f"reusing {train_path} from an interrupted attempt (same fingerprint)")
        return json.loads(stats_path.read_text())

    seqs, windows = _training_windows(ctx, sid_ids, tokenizer)
    rendered, truncated = _render_windows(ctx, windows, sid_ids)
    mixed, mix = _mix_in_pairs(ctx, rendered)
    mixed.write_parquet(train_path)
    n_val_users = _write_val_prompts(ctx, seqs, tokenizer, sid_ids, val_info["item_ids"], data_dir / VAL_FILE)
    stats = {
        # windows: one target per row; sequence: the chunks, and the targets they hold
        "n_windows": windows.height,
        "n_targets": int(windows["items"].list.len().sum() - windows.height) if "items" in windows.columns
        else windows.height,
        "n_train_rows": mixed.height,
        "truncated_examples": truncated,
        "tasks": mix.tasks,
        "multitask": {
            "enabled": bool(sc.multitask), "weight": sc.multitask_weight,
            "pairs_available": mix.n_pairs_available, "pairs_used": mix.n_pairs_used,
            "pairs_too_long": mix.n_pairs_too_long,
        },
        "val_users": n_val_users,
        "mean_tokens": float(mixed["input_ids"].list.len().mean()),
    }
    atomic_write_json(stats_path, stats)
    return stats


def _training_windows(ctx: StageContext, sid_ids: dict[str, np.ndarray],
                      tokenizer) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(ingest's sequences, the training examples over each user's training items: windows
    (history, target, template) or, with sft.objective: sequence, chunks (items))."""
    cfg = ctx.cfg
    seq_path = ctx.input("ingest", "sequences")
    seqs = pl.read_parquet(seq_path)
    check_sequences(seqs, str(seq_path))
    if cfg.sft.objective == "sequence":
        renderer = templates.make_renderer(tokenizer, sid_ids, cfg.pairs.system_prompt, cfg.sft.max_len,
                                           prompt_style="sequence")
        per_chunk = sft_data.sequence_chunk_history(
            cfg.data.max_history, cfg.sft.max_len, len(renderer.item_ids(next(iter(sid_ids)))))
        if per_chunk < cfg.data.max_history:
            ctx.log(f"note: sft.max_len={cfg.sft.max_len} holds {per_chunk + 1} items per sequence row: "
                    f"chunks of {per_chunk + 1}, not data.max_history + 1 = {cfg.data.max_history + 1}")
        windows = sft_data.training_sequences(seqs, per_chunk)
        sft_data.check_items_known(
            windows.select(history=pl.col("items"), target=pl.col("items").list.last()), sid_ids, str(seq_path))
    else:
        windows = sft_data.training_windows(seqs, cfg.data.max_history, seed=cfg.seed)
        sft_data.check_items_known(windows, sid_ids, str(seq_path))
    if windows.height == 0:
        raise DataError(f"{seq_path}: no user has 2 or more training items, so there is nothing to train on")
    what = "sequence chunks" if cfg.sft.objective == "sequence" else "windows"
    ctx.log(f"{windows.height:,} training {what} from {seqs.height:,} users (history <= {cfg.data.max_history})")
    return seqs, windows


def _render_windows(ctx: StageContext, windows: pl.DataFrame,
                    sid_ids: dict[str, np.ndarray]) -> tuple[pl.DataFrame, int]:
    """The windows rendered into token rows by `RenderWindows`, in order: on a Ray Data actor
    pool, or in this process for a catalog of at most `local_max_items` items and one actor
    (the same class and batches: the same rows, without the pool's start-up);
    -> (rows, how many histories were cut to sft.max_len)."""
    cfg, sc = ctx.cfg, ctx.cfg.sft
    t0 = time.time()
    item_ids = list(sid_ids)
    kwargs = dict(
        tokenizer_dir=str(ctx.input("pairs", "tokenizer")), item_ids=item_ids,
        sid_ids=np.stack([sid_ids[i] for i in item_ids]), system_prompt=cfg.pairs.system_prompt,
        max_len=sc.max_len, trust_remote_code=cfg.model.trust_remote_code,
        prompt_style=sc.render_style,
    )
    cols = ("items",) if "items" in windows.columns else ("history", "target", "template")
    table = windows.select(*cols).to_arrow()
    if len(item_ids) <= cfg.local_max_items and (cfg.data.parallelism or 1) == 1:
        ctx.log(f"{len(item_ids):,} items <= local_max_items: rendered in this process")
        render = RenderWindows(**kwargs)
        parts = [render(table.slice(i, RENDER_BATCH)) for i in range(0, table.num_rows, RENDER_BATCH)]
    else:
        parts = _pool_render(table, kwargs, cfg.data.parallelism or 1)
    rendered = pl.from_arrow(pa.concat_tables(parts))
    if rendered.height != windows.height:
        raise DataError(f"sft: rendered {rendered.height} rows for {windows.height} windows")
    truncated = int((rendered["history_kept"] < rendered["history_len"]).sum())
    ctx.log(f"rendered {rendered.height:,} examples in {time.time() - t0:.1f}s ({truncated:,} cut to sft.max_len={sc.max_len})")
    return rendered, truncated


def _pool_render(table: pa.Table, kwargs: dict[str, Any], actors: int) -> list[pa.Table]:
    """`RenderWindows` over `table` on a Ray Data actor pool of `actors`; the blocks in order."""
    import ray

    ray.data.DataContext.get_current().execution_options.preserve_order = True
    ds = ray.data.from_arrow(table).map_batches(
        RenderWindows, fn_constructor_kwargs=kwargs, batch_size=RENDER_BATCH, batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=actors),
    )
    return collect_blocks(ds)


def _mix_in_pairs(ctx: StageContext, rendered: pl.DataFrame):
    """The training rows, with grounding pairs mixed in when sft.multitask (LC-Rec), shuffled
    with the seed; -> (rows, the mix's counts)."""
    cfg, sc = ctx.cfg, ctx.cfg.sft
    pairs = None
    if sc.multitask and sc.multitask_weight > 0:
        pairs = pl.read_parquet(ctx.input("pairs", "pairs"))
    return sft_data.multitask_mix(
        rendered.select(ROW_COLUMNS), pairs, sc.multitask_weight if sc.multitask else 0.0,
        cfg.seed, sc.max_len,
    )


def _write_val_prompts(ctx: StageContext, seqs: pl.DataFrame, tokenizer, sid_ids: dict[str, np.ndarray],
                       item_ids: list[str], path: Path) -> int:
    """Prompts of a deterministic sample of validation users, with the trie row of each one's
    valid item as target, to `path`; -> the number of users."""
    cfg, sc = ctx.cfg, ctx.cfg.sft
    renderer = templates.make_renderer(
        tokenizer, sid_ids, cfg.pairs.system_prompt, sc.max_len, prompt_style=sc.render_style
    )
    table = sft_data.val_prompt_table(seqs, renderer, item_ids, sc.val_users, cfg.seed, cfg.data.max_history)
    table.write_parquet(path)
    return table.height


# --------------------------------------------------------------------------- stage entry
def run(ctx: StageContext, fault_injection: FaultInjection | None = None) -> StageResult:
    """Run the stage. `fault_injection` (tests only) goes to the worker loop, which kills that
    worker once."""
    from gti.run.versions import check_exact_map

    cfg, sc = ctx.cfg, ctx.cfg.sft
    check_lora_supported(sc)
    if sc.use_gpu and sc.precision == "fp32":  # "auto" picks bf16 on GPUs that have it
        ctx.log("note: sft.use_gpu with sft.precision=fp32; bf16 is the usual choice on GPU (about half the memory)")
    sid_facts = ctx.manifest("sid").facts
    sid_map_hash = sid_facts["sid_map_hash"]
    pairs_facts = ctx.manifest("pairs").facts
    ground_dir = ctx.input("ground", "model")
    check_exact_map(ground_dir, sid_map_hash)
    tokenizer, pad_id = _tokenizer(ctx)
    sids = _sid_tables(ctx, sid_facts, tokenizer)
    if sc.enabled and sc.steps > 0:
        trained = _train(ctx, tokenizer, pad_id, ground_dir, sids, fault_injection)
    else:
        # An ablation arm without SFT: the grounded model is exported unchanged.
        ctx.log("sft.enabled is false or sft.steps is 0: exporting the grounded model unchanged")
        trained = _Trained(model=load_causal_lm(ground_dir, cfg))
    new_ids = [int(x) for x in pairs_facts["new_token_ids"]]
    _export(ctx, trained.model, tokenizer, ground_dir, sid_map_hash, new_ids)
    facts = _facts(sc, trained, sid_map_hash, new_ids)
    if facts["loss_history"]:
        ctx.log(
            f"loss {facts['first_loss']:.4f} -> {facts['final_loss']:.4f}"
            + (f"; {VAL_METRIC} {facts[VAL_METRIC][-1]['value']:.4f}" if facts[VAL_METRIC] else "")
        )
    return StageResult(outputs={"model": MODEL_DIR, "sft_embeddings": E_NEW_FILE}, facts=facts)


@dataclass
class _SidTables:
    """The catalog's SIDs as token ids of the extended tokenizer."""

    sid_ids: dict[str, np.ndarray]  # item -> its L SID token ids
    item_ids: list[str]  # SID-map row order
    matrix: torch.Tensor  # [N, L] SID token ids, row i = item_ids[i]


@dataclass
class _Trained:
    """The model to export, the data statistics and the training facts (`run_sft`'s; the
    defaults: no SFT ran)."""

    model: Any
    stats: dict[str, Any] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=lambda: {
        **history_facts({"loss": [], "val": {}}, 0), "trainable_params": 0, "precision": None, "timing": None})


def _tokenizer(ctx: StageContext):
    """The pairs stage's extended tokenizer and its padding id (eos when it has none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(ctx.input("pairs", "tokenizer")), trust_remote_code=ctx.cfg.model.trust_remote_code
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return tokenizer, pad_id


def _sid_tables(ctx: StageContext, sid_facts: dict[str, Any], tokenizer) -> _SidTables:
    from gti.sid.codec import SidCodec

    sid_map = pl.read_parquet(ctx.input("sid", "sid_map"))
    codec = SidCodec.from_facts(sid_facts)
    sid_ids = templates.sid_id_table(sid_map, codec, tokenizer)
    item_ids = sid_map["item_id"].to_list()
    return _SidTables(sid_ids, item_ids, torch.from_numpy(np.stack([sid_ids[i] for i in item_ids])))


def _train(ctx: StageContext, tokenizer, pad_id: int, ground_dir: Path, sids: _SidTables,
           fault_injection: FaultInjection | None) -> _Trained:
    """Prepare the data, train with the SFT runner (`gti.train.sft_run.run_sft`: ZeRO, precision,
    resumable checkpoints, validation curves of Recall@10, the target's loss and optionally
    exact-rank MRR; optional LoRA) and rebuild the trained model on the driver
    (`gti.train.sft_task.rebuild_trained`)."""
    from safetensors.torch import save_file

    from gti.ray_start import ensure_ray
    from gti.common.tracking import open_tracker

    cfg, sc = ctx.cfg, ctx.cfg.sft
    ensure_ray(cfg)
    stats = _prepare_data(ctx, tokenizer, sids.sid_ids, {"item_ids": sids.item_ids})
    cfg = resolve_budget(cfg, stats["n_train_rows"])
    sc = cfg.sft
    stats = {**stats, "steps_resolved": sc.steps, "epochs": ctx.cfg.sft.epochs}
    data_dir = (ctx.work_dir / DATA_DIR).resolve()
    save_file({"sid_token_ids": sids.matrix.contiguous()}, str(data_dir / SIDS_FILE))
    inputs = SftInputs(run_cfg=cfg, train_path=data_dir / TRAIN_FILE, model_dir=ground_dir, pad_id=int(pad_id),
                       val=_val_set(cfg, data_dir, sids), fault=fault_injection)
    ctx.log(
        f"SFT: {stats['n_train_rows']:,} rows {stats['tasks']}, {sc.steps} steps x batch {sc.batch_size} "
        f"(accum {sc.grad_accum}) on {sc.num_workers} worker(s), ZeRO-{sc.zero_stage} {sc.precision}, "
        f"{'LoRA r=%d' % sc.lora.r if sc.lora.enabled else 'all parameters'}"
    )
    t0 = time.time()
    res = run_sft(inputs, storage_path=(ctx.work_dir / STORAGE_DIR).resolve(), name=TASK,
                  start_ray=lambda: ensure_ray(cfg), log=ctx.log, tracker=lambda: open_tracker(ctx))
    ctx.log(f"training done in {time.time() - t0:.1f}s")
    return _Trained(model=rebuild_trained(ground_dir, cfg, res.state_dict), stats=stats, facts=res.facts)


def resolve_budget(cfg, n_rows: int):
    """`cfg` with sft.steps = ceil(sft.epochs * n_rows / sft.batch_size) when sft.epochs is set
    (a budget in passes over the rows, which is what convergence depends on), else `cfg`."""
    import math

    sc = cfg.sft
    if sc.epochs is None:
        return cfg
    steps = max(1, math.ceil(sc.epochs * n_rows / sc.batch_size))
    return cfg.model_copy(update={"sft": sc.model_copy(update={"steps": steps})})


def _val_set(cfg, data_dir: Path, sids: _SidTables) -> ValSet:
    """The validation users' prompts (data/val.parquet) decoded against the catalog's trie."""
    k = min(VAL_K, len(sids.item_ids))
    return ValSet(
        path=str(data_dir / VAL_FILE), sids_path=str(data_dir / SIDS_FILE),
        new_start=int(sids.matrix.min()), new_end=int(sids.matrix.max()) + 1, levels=int(sids.matrix.shape[1]),
        k=k, beam_width=max(k, cfg.eval.beam_width), batch_users=cfg.eval.batch_users, mrr=cfg.sft.val_mrr,
    )


def _export(ctx: StageContext, model, tokenizer, ground_dir: Path, sid_map_hash: str, new_ids: list[int]) -> None:
    """model/ (HF folder + tokenizer + gti_meta.json) and the new rows, e_new_sft.safetensors."""
    from safetensors.torch import save_file

    from gti.lm import new_rows

    first_new, end_new = new_ids
    e_new = model.get_input_embeddings().weight[first_new:end_new].detach().float().contiguous()
    meta = dict(new_rows.read_meta(ground_dir))
    # How this model's prompts look: every reader of the model renders them the same way
    # (gti.run.loaded refuses a config that would render them otherwise).
    meta.update({"sid_map_hash": sid_map_hash, "stage": TASK, "new_token_ids": [first_new, end_new],
                 "render_style": ctx.cfg.sft.render_style})
    new_rows.export_model(model, tokenizer, ctx.work_dir / MODEL_DIR, meta)
    save_file({"e_new": e_new}, str(ctx.work_dir / E_NEW_FILE))


def _facts(sc, trained: _Trained, sid_map_hash: str, new_ids: list[int]) -> dict[str, Any]:
    t = trained.facts
    return {
        "steps_done": t["steps_done"],
        "final_loss": t["final_loss"],
        "first_loss": t["first_loss"],
        "loss_history": t["loss_history"],
        VAL_METRIC: t[VAL_METRIC],
        # Every validation metric's curve (val_recall@10, val_loss, val_mrr with sft.val_mrr).
        "val_history": t["val_history"],
        "sid_map_hash": sid_map_hash,
        "new_token_ids": list(new_ids),
        "trainable_params": t["trainable_params"],
        "lora": sc.lora.model_dump() if sc.lora.enabled else None,
        "zero_stage": sc.zero_stage,
        "precision": t["precision"],
        "precision_setting": sc.precision,
        "timing": t["timing"],
        "prompt_style": sc.prompt_style,
        "objective": sc.objective,
        "render_style": sc.render_style,
        "num_workers": sc.num_workers,
        **trained.stats,
    }
