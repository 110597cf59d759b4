"""The training sections of the run config: grounding's and SFT's shared optimiser settings.

What it is for: `TrainConfig`, what grounding and SFT share (optimiser, schedule, parallelism,
precision, checkpoints, validation cadence), and each one's own defaults: `GroundConfig`
(`ground:`) and `SftConfig` (`sft:`, with LC-Rec multitask mixing, `LoraConfig`, validation
users and the prompt style). `gti.config.RunConfig` holds them; `gti.vocab_ground` reuses
`GroundConfig`.

What it does NOT know: the other sections or YAML loading (`gti.config`, `gti.config_io`), or
how training runs (`gti.train`). It never imports ray or torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gti.config_io import StrictModel


class TrainConfig(StrictModel):
    """Shared by grounding and SFT: optimiser, schedule, parallelism, checkpoints."""

    enabled: bool = True
    lr: float = Field(1e-3, gt=0)
    steps: int = Field(100, ge=0)
    batch_size: int = Field(8, gt=0, description="global batch (sequences per optimizer step)")
    grad_accum: int = Field(1, ge=1)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    max_grad_norm: float = Field(1.0, gt=0)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0)
    num_workers: int = Field(1, ge=1)
    use_gpu: bool = False
    # Ray resources per Train worker (ScalingConfig.resources_per_worker), e.g. {CPU: 8, GPU: 1},
    # or {CPU: 1, gti_worker: 1} with cluster/local_cluster.sh to force one worker per node.
    # None = Ray Train's default (1 CPU, plus 1 GPU when use_gpu).
    resources_per_worker: dict[str, float] | None = None
    zero_stage: Literal[0, 1, 2, 3] = 2
    # "auto": bf16 autocast where bf16 is native (CUDA, CPUs with AVX512-BF16/AMX), else fp32
    # (gti.devices.resolve_precision; the resolved value goes into the stage manifest). Master
    # weights and optimizer state stay fp32 unless model.dtype is bfloat16.
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # Micro-batches of similar-length rows (gti.train.batching), so padding costs little.
    group_by_length: bool = True
    # Attention kernel while training: "auto" = eager on CPU (its backward is ~1.35x faster than
    # SDPA's flash kernel for SmolLM2 rows of ~65 tokens on 2 cores; bench/RESULTS.md), the
    # model's own choice on GPU.
    attn_implementation: Literal["auto", "sdpa", "eager"] = "auto"
    # torch intra-op threads per CPU training worker; None keeps Ray's setting (= the CPUs the
    # worker reserved, 1 by default). Set it to the node's cores for a single worker on a laptop.
    cpu_threads: int | None = Field(None, ge=1)
    checkpoint_every: int = Field(50, ge=1)
    val_every: int = Field(50, ge=1)
    val_samples: int = Field(64, ge=1)
    max_failures: int = Field(0, ge=-1)
    log_every: int = Field(1, ge=1)


class GroundConfig(TrainConfig):
    lr: float = Field(1e-3, gt=0)
    steps: int = Field(200, ge=0)


class LoraConfig(StrictModel):
    enabled: bool = False
    r: int = Field(8, gt=0)
    alpha: int = Field(32, gt=0)
    dropout: float = Field(0.05, ge=0, lt=1)
    quantize_4bit: bool = False


class SftConfig(TrainConfig):
    lr: float = Field(3e-4, gt=0)
    steps: int = Field(200, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    weight_decay: float = Field(0.01, ge=0)
    max_len: int = Field(160, gt=8)
    # LC-Rec style multitask mix: weight of grounding-pair tasks relative to the sequence task.
    multitask: bool = False
    multitask_weight: float = Field(0.5, ge=0)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    val_users: int = Field(64, ge=1)
    # Also the exact-rank MRR of the validation users at every validation (gti.eval.rank: one
    # prefill plus one token per distinct SID prefix per user); val_loss is always computed.
    val_mrr: bool = False
    # "chat": the chat template, system prompt and a retrieval template around the history
    # (the paper's form). "compact": the history's SID tokens alone, then the answer; no chat
    # scaffolding (see gti.lm.templates.render_rec_prompt). Used by SFT, evaluate and recommend.
    prompt_style: Literal["chat", "compact"] = "chat"
