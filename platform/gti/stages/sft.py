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
2. Training: `gti.train.loop.train_loop_per_worker` in a `TorchTrainer` with `SFT_HOOKS`:
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
3. Export: the driver rebuilds the same module, loads the trained tensors from the final
   checkpoint's `trainable.safetensors`, merges LoRA adapters if any, and writes `model/`
   (standard HF folder + tokenizer + `gti_meta.json` with `sid_map_hash`) and
   `e_new_sft.safetensors` (`e_new`: the new-token input-embedding rows [V_new, d]).

What it does not know: how windows are cut or rendered (`gti.train.sft_data`), the training
loop's internals (`gti.train.loop`), or how the model will be evaluated (`evaluate`).
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gti import config as C
from gti.errors import DataError, GtiError
from gti.manifest import atomic_write_json
from gti.contract import StageContext, StageResult
from gti.train import sft_data

TASK = "sft"
VAL_K = 10
VAL_METRIC = f"val_recall@{VAL_K}"
DATA_DIR = "data"
TRAIN_FILE = "sft_train.parquet"
VAL_FILE = "val.parquet"
SIDS_FILE = "sid_token_ids.safetensors"
MODEL_DIR = "model"
E_NEW_FILE = "e_new_sft.safetensors"


# --------------------------------------------------------------------------- model building
def check_lora_supported(sc: C.SftConfig) -> None:
    """ConfigError unless the requested LoRA/QLoRA variant can run here (checked on the driver
    and again in every worker, where the GPU actually is)."""
    lo = sc.lora
    if not lo.enabled:
        if lo.quantize_4bit:
            raise C.ConfigError("sft.lora.quantize_4bit needs sft.lora.enabled=true")
        return
    if importlib.util.find_spec("peft") is None:
        raise C.ConfigError("sft.lora.enabled needs the 'peft' package, which is not installed")
    if lo.quantize_4bit:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise C.ConfigError("sft.lora.quantize_4bit (QLoRA) needs the 'bitsandbytes' package, which is not installed")
        if not sc.use_gpu:
            raise C.ConfigError("sft.lora.quantize_4bit (QLoRA) needs sft.use_gpu=true: 4-bit weights exist only on GPU")


def load_causal_lm(model_dir: str | Path, cfg: C.RunConfig, quantize_4bit: bool = False) -> torch.nn.Module:
    """An exported HF folder as a causal LM in `model.dtype` (or 4-bit, QLoRA), safetensors
    only. bf16 weights train in DeepSpeed's bf16 mode (fp32 master copies in the optimizer)."""
    from transformers import AutoModelForCausalLM

    from gti.lm.models import _torch_dtype

    kwargs: dict[str, Any] = dict(
        use_safetensors=True, trust_remote_code=cfg.model.trust_remote_code,
        dtype=_torch_dtype(cfg.model.dtype),
    )
    if quantize_4bit:
        from transformers import BitsAndBytesConfig

        kwargs.update(
            dtype=torch.bfloat16,
            quantization_config=BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
            ),
            device_map={"": torch.cuda.current_device()},
        )
    return AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)


def wrap_lora(model: torch.nn.Module, lora: C.LoraConfig, quantized: bool = False) -> torch.nn.Module:
    """peft LoRA on every linear layer of the backbone (not the head), then the embedding
    matrix and the output head made fully trainable (tied heads share one matrix)."""
    from peft import LoraConfig, get_peft_model

    if quantized:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    peft_cfg = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules="all-linear", task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, peft_cfg)
    model.get_input_embeddings().weight.requires_grad_(True)
    head = model.get_output_embeddings()
    if head is not None:
        head.weight.requires_grad_(True)
    return model


def build_sft_model(config: dict, cfg: C.RunConfig) -> torch.nn.Module:
    """Loop hook: the grounded model with every parameter trainable (or LoRA + embeddings)."""
    sc = cfg.sft
    check_lora_supported(sc)
    q4 = sc.lora.enabled and sc.lora.quantize_4bit
    if q4 and not torch.cuda.is_available():
        raise C.ConfigError("sft.lora.quantize_4bit (QLoRA) needs a GPU in every training worker")
    model = load_causal_lm(config["sft"]["model_dir"], cfg, quantize_4bit=q4)
    if sc.lora.enabled:
        return wrap_lora(model, sc.lora, quantized=q4)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def sft_trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Loop hook: {name: full fp32 CPU tensor} of every trainable parameter (tied weights once);
    called on every rank because gathering ZeRO-3 partitions is collective."""
    from gti.train.loop import full_fp32_cpu

    return {name: full_fp32_cpu(p) for name, p in module.named_parameters() if p.requires_grad}


def validate_sft(module: torch.nn.Module, config: dict, rank: int, world: int) -> dict[str, tuple[float, float]]:
    """Loop hook: Recall@10 of constrained beam search on the validation users.

    config["val"]: {"path": parquet (prompt list<int>, target_row int: trie row of the valid
    item), "sids_path", "new_start", "new_end", "levels", "pad_id", "beam_width", "k"}.
    Each rank takes an equal share (the last ones wrap around and are not counted), so all ranks
    run the same number of forward passes (ZeRO-3 needs that)."""
    from gti.train.loop import load_trie, rank_share

    v = config.get("val")
    if not v:
        return {}
    from gti.eval.decode import constrained_beam_search

    table = pq.read_table(v["path"])
    n = table.num_rows
    if n == 0:
        return {}
    rows, counted = rank_share(n, rank, world)
    prompts = table.column("prompt").to_pylist()
    targets = torch.tensor(table.column("target_row").to_pylist(), dtype=torch.long)[rows]
    res = constrained_beam_search(
        module, [prompts[i] for i in rows], load_trie(v["sids_path"], int(v["new_start"]), int(v["new_end"])),
        beam_width=int(v["beam_width"]), k=int(v["k"]), levels=int(v["levels"]),
        pad_id=int(v["pad_id"]), batch_users=int(v.get("batch_users", 8)),
    )
    hit = (res.items.cpu() == targets.unsqueeze(1)).any(dim=1) & counted
    out = {VAL_METRIC: (float(hit.sum()), float(counted.sum()))}
    out.update(_val_loss_and_mrr(module, [prompts[i] for i in rows], targets, counted, v))
    return out


def _val_loss_and_mrr(module, prompts: list[list[int]], targets: torch.Tensor, counted: torch.Tensor,
                      v: dict) -> dict[str, tuple[float, float]]:
    """Learning-curve metrics on the validation users (they move long before Recall@10 leaves
    the floor): `val_loss`, the teacher-forced loss of the target's SID tokens per token, and,
    with v["mrr"], `val_mrr`, the mean reciprocal exact rank of the target among all catalog
    SIDs (`gti.eval.rank`). Rows not `counted` (rank padding) contribute nothing."""
    from gti.eval.rank import exact_ranks, score_catalog
    from gti.lm.templates import IGNORE
    from safetensors.torch import load_file

    from gti.train.loop import PadCollate
    from gti.train.loss import labelled_loss

    sids = load_file(v["sids_path"])["sid_token_ids"]  # [N_items, L]
    device = next(module.parameters()).device
    out: dict[str, tuple[float, float]] = {}
    loss_sum, n_tok = 0.0, 0
    bs = int(v.get("batch_users", 8))
    for lo in range(0, len(prompts), bs):
        ids, labels = [], []
        for p, t, c in zip(prompts[lo: lo + bs], targets[lo: lo + bs].tolist(), counted[lo: lo + bs].tolist()):
            ans = sids[t].tolist()
            ids.append(list(p) + ans)
            labels.append([IGNORE] * len(p) + (ans if c else [IGNORE] * len(ans)))
        b = {k: x.to(device) for k, x in PadCollate(int(v["pad_id"]))({"input_ids": ids, "labels": labels}).items()}
        n = int((b["labels"][:, 1:] != IGNORE).sum())
        if n:
            loss_sum += float(labelled_loss(module, b["input_ids"], b["attention_mask"], b["labels"])) * n
            n_tok += n
    out["val_loss"] = (loss_sum, float(n_tok))
    if v.get("mrr"):
        scores = score_catalog(module, prompts, sids.cpu(), pad_id=int(v["pad_id"]), batch_users=bs)
        ranks = exact_ranks(scores, targets)
        out["val_mrr"] = (float((1.0 / ranks)[counted].sum()), float(counted.sum()))
    return out


def _sft_hooks():
    from gti.train.loop import TaskHooks

    return TaskHooks(
        build_model=build_sft_model,
        trainable_state=sft_trainable_state,
        validate=validate_sft,
        grad_norm_key="grad_norm",
    )


# --------------------------------------------------------------------------- data
class RenderWindows:
    """`map_batches` callable class: training windows -> token rows (one tokenizer per actor)."""

    def __init__(self, tokenizer_dir: str, item_ids: list[str], sid_ids: np.ndarray,
                 system_prompt: str, max_len: int, trust_remote_code: bool,
                 prompt_style: str = "chat") -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
        self.renderer = sft_data.make_renderer(
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
    renderer = sft_data.make_renderer(
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
            loop_config, ds, sc, storage_path=(ctx.work_dir / "ray_train").resolve(), name=TASK,
            log=ctx.log, progress_every=max(1, sc.log_every), on_metrics=tracker.report,
        )


# --------------------------------------------------------------------------- export
def rebuild_trained(ground_dir: Path, cfg: C.RunConfig, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The grounded model with the trained tensors loaded (LoRA adapters merged): a plain HF
    model in fp32, on CPU."""
    model = load_causal_lm(ground_dir, cfg)
    if cfg.sft.lora.enabled:
        model = wrap_lora(model, cfg.sft.lora)
    own = dict(model.named_parameters())
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise DataError(f"sft checkpoint holds tensors the model does not have: {unknown[:3]}")
    trainable = {n for n, p in own.items() if p.requires_grad}
    missing = sorted(trainable - set(state))
    if missing:
        raise DataError(f"sft checkpoint lacks trained tensors: {missing[:3]}")
    with torch.no_grad():
        for n, t in state.items():
            own[n].copy_(t.to(own[n].dtype))
    if cfg.sft.lora.enabled:
        model = model.merge_and_unload()
    return model


# --------------------------------------------------------------------------- stage entry
def run(ctx: StageContext, fault_injection: dict | None = None) -> StageResult:
    """Run the stage. `fault_injection` (tests only): {"fail_at_step", "fail_rank",
    "fail_marker"}, passed to the worker loop, which kills that worker once."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from gti.eval.recommend import check_sid_map_hash
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
    sid_ids = sft_data.sid_id_table(sid_map, codec, tokenizer)
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
            "hooks": _sft_hooks(),
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
