"""The SFT task: its model, trainable tensors, validation and export, as loop hooks.

What it is for: `HOOKS` for `gti.train.loop` (task "sft"): `build_sft_model` (the grounded
model with every parameter trainable, or LoRA adapters plus the embedding matrix and head;
QLoRA with 4-bit weights on GPU), `sft_trainable_state` (every trainable tensor, full fp32)
and `validate_sft` (Recall@10 of constrained beam search on the validation users, plus the
validation loss and, optionally, the exact MRR); `rebuild_trained` is the export side (the
grounded model with the trained tensors loaded and LoRA merged). Parallel to
`gti.train.ground_task`.

What it does not know: how SFT examples were rendered, Ray, or where the stage writes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq
import torch

from gti import config as C
from gti.config.train import LoraConfig, SftConfig
from gti.common.errors import ConfigError, DataError
from gti.lm.regularise import add_dropout, freeze_lower_layers
from gti.train.task import TaskHooks, full_fp32_cpu, load_trie, rank_share, register

if TYPE_CHECKING:
    from gti.train.worker_config import ValSet, WorkerConfig

VAL_K = 10
VAL_METRIC = f"val_recall@{VAL_K}"


def check_lora_supported(sc: SftConfig) -> None:
    """ConfigError unless the requested LoRA/QLoRA variant can run here (checked on the driver
    and again in every worker, where the GPU actually is)."""
    lo = sc.lora
    if lo.enabled and (sc.freeze_layers or sc.dropout):
        raise ConfigError("sft.freeze_layers and sft.dropout apply to full fine-tuning; with sft.lora.enabled "
                          "use sft.lora.dropout and leave them 0")
    if not lo.enabled:
        if lo.quantize_4bit:
            raise ConfigError("sft.lora.quantize_4bit needs sft.lora.enabled=true")
        return
    if importlib.util.find_spec("peft") is None:
        raise ConfigError("sft.lora.enabled needs the 'peft' package, which is not installed")
    if lo.quantize_4bit:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError("sft.lora.quantize_4bit (QLoRA) needs the 'bitsandbytes' package, which is not installed")
        if not sc.use_gpu:
            raise ConfigError("sft.lora.quantize_4bit (QLoRA) needs sft.use_gpu=true: 4-bit weights exist only on GPU")


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


def wrap_lora(model: torch.nn.Module, lora: LoraConfig, quantized: bool = False) -> torch.nn.Module:
    """peft LoRA on every linear layer of the backbone (not the head), then the embedding
    matrix and the output head made fully trainable (tied heads share one matrix)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    if quantized:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    peft_cfg = PeftLoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules="all-linear", task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, peft_cfg)
    model.get_input_embeddings().weight.requires_grad_(True)
    head = model.get_output_embeddings()
    if head is not None:
        head.weight.requires_grad_(True)
    return model


def build_sft_model(config: "WorkerConfig", cfg: C.RunConfig) -> torch.nn.Module:
    """Loop hook: the grounded model of `config.sft.model_dir` with every parameter trainable
    (or LoRA + embeddings)."""
    sc = cfg.sft
    check_lora_supported(sc)
    q4 = sc.lora.enabled and sc.lora.quantize_4bit
    if q4 and not torch.cuda.is_available():
        raise ConfigError("sft.lora.quantize_4bit (QLoRA) needs a GPU in every training worker")
    model = load_causal_lm(config.sft.model_dir, cfg, quantize_4bit=q4)
    if sc.lora.enabled:
        return wrap_lora(model, sc.lora, quantized=q4)
    for p in model.parameters():
        p.requires_grad_(True)
    return regularise(model, sc)


def regularise(model: torch.nn.Module, sc: SftConfig) -> torch.nn.Module:
    """`sft.freeze_layers` and `sft.dropout` applied to the full model (gti.lm.regularise);
    the export applies the same, so its trainable set matches the checkpoint's."""
    return add_dropout(freeze_lower_layers(model, sc.freeze_layers), sc.dropout)


def sft_trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Loop hook: {name: full fp32 CPU tensor} of every trainable parameter (tied weights once);
    called on every rank because gathering ZeRO-3 partitions is collective."""
    return {name: full_fp32_cpu(p) for name, p in module.named_parameters() if p.requires_grad}


def validate_sft(module: torch.nn.Module, config: "WorkerConfig", rank: int,
                 world: int) -> dict[str, tuple[float, float]]:
    """Loop hook: Recall@10 of constrained beam search on the validation users.

    config.val (a `ValSet`): `path` a parquet (prompt list<int>, target_row int: trie row of the
    valid item), `sids_path`, `new_start`/`new_end`, `levels`, `beam_width`, `k`, `batch_users`,
    `mrr`; prompts padded with config.pad_id.
    Each rank takes an equal share (the last ones wrap around and are not counted), so all ranks
    run the same number of forward passes (ZeRO-3 needs that)."""
    v = config.val
    if v is None:
        return {}
    from gti.eval.decode import constrained_beam_search

    table = pq.read_table(v.path)
    n = table.num_rows
    if n == 0:
        return {}
    rows, counted = rank_share(n, rank, world)
    prompts = table.column("prompt").to_pylist()
    targets = torch.tensor(table.column("target_row").to_pylist(), dtype=torch.long)[rows]
    res = constrained_beam_search(
        module, [prompts[i] for i in rows], load_trie(v.sids_path, int(v.new_start), int(v.new_end)),
        beam_width=int(v.beam_width), k=int(v.k), levels=int(v.levels),
        pad_id=int(config.pad_id), batch_users=int(v.batch_users),
    )
    hit = (res.items.cpu() == targets.unsqueeze(1)).any(dim=1) & counted
    out = {VAL_METRIC: (float(hit.sum()), float(counted.sum()))}
    out.update(_val_loss_and_mrr(module, [prompts[i] for i in rows], targets, counted, v, int(config.pad_id)))
    return out


def _val_loss_and_mrr(module, prompts: list[list[int]], targets: torch.Tensor, counted: torch.Tensor,
                      v: "ValSet", pad_id: int) -> dict[str, tuple[float, float]]:
    """Learning-curve metrics on the validation users (they move long before Recall@10 leaves
    the floor): `val_loss`, the teacher-forced loss of the target's SID tokens per token, and,
    with v.mrr, `val_mrr`, the mean reciprocal exact rank of the target among all catalog
    SIDs (`gti.eval.rank`). Rows not `counted` (rank padding) contribute nothing."""
    from gti.eval.rank import exact_ranks, score_catalog
    from gti.lm.chat import IGNORE
    from safetensors.torch import load_file

    from gti.train.shards import PadCollate
    from gti.train.loss import labelled_loss

    sids = load_file(v.sids_path)["sid_token_ids"]  # [N_items, L]
    device = next(module.parameters()).device
    out: dict[str, tuple[float, float]] = {}
    loss_sum, n_tok = 0.0, 0
    bs = int(v.batch_users)
    for lo in range(0, len(prompts), bs):
        ids, labels = [], []
        for p, t, c in zip(prompts[lo: lo + bs], targets[lo: lo + bs].tolist(), counted[lo: lo + bs].tolist()):
            ans = sids[t].tolist()
            ids.append(list(p) + ans)
            labels.append([IGNORE] * len(p) + (ans if c else [IGNORE] * len(ans)))
        b = {k: x.to(device) for k, x in PadCollate(pad_id)({"input_ids": ids, "labels": labels}).items()}
        n = int((b["labels"][:, 1:] != IGNORE).sum())
        if n:
            loss_sum += float(labelled_loss(module, b["input_ids"], b["attention_mask"], b["labels"])) * n
            n_tok += n
    out["val_loss"] = (loss_sum, float(n_tok))
    if v.mrr:
        scores = score_catalog(module, prompts, sids.cpu(), pad_id=pad_id, batch_users=bs)
        ranks = exact_ranks(scores, targets)
        out["val_mrr"] = (float((1.0 / ranks)[counted].sum()), float(counted.sum()))
    return out


def rebuild_trained(ground_dir: Path, cfg: C.RunConfig, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The grounded model with the trained tensors loaded (LoRA adapters merged): a plain HF
    model in fp32, on CPU."""
    model = load_causal_lm(ground_dir, cfg)
    if cfg.sft.lora.enabled:
        model = wrap_lora(model, cfg.sft.lora)
    else:
        model = regularise(model, cfg.sft)
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


HOOKS = register("sft", TaskHooks(
    build_model=build_sft_model,
    trainable_state=sft_trainable_state,
    validate=validate_sft,
    grad_norm_key="grad_norm",
))
