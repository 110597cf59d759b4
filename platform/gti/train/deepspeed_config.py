"""The DeepSpeed config dict, built from the typed training config (pure function).

What it is for: `build_ds_config(train_cfg, world_size, use_gpu=...)` turns a
`gti.config.train.TrainConfig` (grounding, SFT or RL) into the dict handed to
`deepspeed.initialize`, and checks the batch arithmetic first, so a bad combination fails with a
one-line `ConfigError` naming the key instead of a DeepSpeed assertion deep inside a Ray worker.
The choices it makes, and why, are beside `build_ds_config`.

What it does not know: models, Ray, torch. It never imports deepspeed either.
"""

from __future__ import annotations

from typing import Any

from gti.config.train import GroundConfig, RlConfig, SftConfig, TrainConfig
from gti.common.errors import ConfigError

# Bucket sizes (elements) for ZeRO gradient reduction / parameter all-gather. DeepSpeed's defaults
# (5e8) allocate 2 GB fp32 buffers; these keep CPU workers small without measurable slowdown at
# the model sizes we train.
_BUCKET = 50_000_000


def _section(train_cfg: TrainConfig) -> str:
    """Config section name used in error messages ("ground" / "sft" / "rl")."""
    if isinstance(train_cfg, GroundConfig):
        return "ground"
    if isinstance(train_cfg, SftConfig):
        return "sft"
    if isinstance(train_cfg, RlConfig):
        return "rl"
    return "train"


def micro_batch(train_cfg: TrainConfig, world_size: int) -> int:
    """Sequences per worker per micro step; raises ConfigError unless the global batch splits
    exactly into world_size x grad_accum x micro."""
    sec = _section(train_cfg)
    if world_size < 1:
        raise ConfigError(f"{sec}.num_workers: world size must be >= 1, got {world_size}")
    per_step = world_size * train_cfg.grad_accum
    if train_cfg.batch_size % per_step or train_cfg.batch_size < per_step:
        raise ConfigError(
            f"{sec}.batch_size ({train_cfg.batch_size}) must be a positive multiple of "
            f"num_workers x grad_accum ({world_size} x {train_cfg.grad_accum} = {per_step})"
        )
    return train_cfg.batch_size // per_step


# Choices, and why:
# - Optimizer: AdamW from the config with `torch_adam: true`, i.e. `torch.optim.AdamW`. DeepSpeed's
#   default `FusedAdam` is a CUDA op that does not exist on CPU and would need nvcc on GPU nodes;
#   torch's AdamW runs everywhere, is supported by ZeRO 1-3, and keeps exactly two fp32 moment
#   tensors per trainable element (the optimizer-state size the grounding benchmark checks).
# - Scheduler: not in this dict. The loop builds a `LambdaLR` from `gti.train.schedule` and passes
#   it to `deepspeed.initialize(lr_scheduler=...)` (see that module for why).
# - Offload is off (`device: none`): the trainable set in grounding is tiny, and CPU-only machines
#   gain nothing from moving optimizer state between host and host.
# - `overlap_comm` only with a GPU (it needs CUDA streams to overlap anything).
# - DeepSpeed's bf16 mode (bf16 module weights, fp32 master weights and optimizer state in the
#   ZeRO optimizer) iff the model is held in bf16 (`model.dtype: bfloat16`, `bf16_weights`).
#   `precision: bf16` is NOT DeepSpeed's business: it is autocast around the forward in the loop
#   (`gti.train.loss.make_forward`), with fp32 weights. fp16 is never used (no loss scaling).
def build_ds_config(train_cfg: TrainConfig, world_size: int, *, use_gpu: bool,
                    bf16_weights: bool = False) -> dict[str, Any]:
    """DeepSpeed config for `world_size` data-parallel workers; `bf16_weights` when the model's
    weights are bf16 (model.dtype), so DeepSpeed keeps fp32 master copies for the optimizer.

    train_batch_size == micro x grad_accum x world_size == train_cfg.batch_size (checked).
    """
    sec = _section(train_cfg)
    micro = micro_batch(train_cfg, world_size)
    stage = int(train_cfg.zero_stage)
    bf16 = bool(bf16_weights)
    if bf16 and stage == 0:
        # DeepSpeed keeps fp32 master weights for bf16 modules only inside ZeRO's optimizers;
        # stage 0 would step the bf16 weights directly and lose every small update.
        raise ConfigError(
            f"model.dtype=bfloat16 needs {sec}.zero_stage >= 1 (fp32 master weights live in "
            f"ZeRO's optimizer), or model.dtype=float32 with {sec}.precision=bf16 (autocast)"
        )
    beta1, beta2 = train_cfg.adam_betas
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ConfigError(f"{sec}.adam_betas: each beta must be in [0, 1), got {train_cfg.adam_betas}")

    zero: dict[str, Any] = {
        "stage": stage,
        "contiguous_gradients": True,
        "overlap_comm": bool(use_gpu),
        "reduce_scatter": True,
        "reduce_bucket_size": _BUCKET,
        "allgather_bucket_size": _BUCKET,
        "offload_optimizer": {"device": "none"},
    }
    if stage == 3:
        zero.update(
            {
                "offload_param": {"device": "none"},
                # Export gathers the full weights itself; this lets save_16bit_model work too.
                "stage3_gather_16bit_weights_on_model_save": True,
                "stage3_param_persistence_threshold": 10_000,
                "stage3_prefetch_bucket_size": _BUCKET,
            }
        )

    return {
        "train_batch_size": micro * train_cfg.grad_accum * world_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": train_cfg.grad_accum,
        "gradient_clipping": float(train_cfg.max_grad_norm),
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": float(train_cfg.lr),
                "betas": [float(beta1), float(beta2)],
                "eps": float(train_cfg.adam_eps),
                "weight_decay": float(train_cfg.weight_decay),
                "torch_adam": True,
                # One fused kernel over all parameters (CPU and CUDA in torch >= 2.4): a much
                # shorter optimizer step (bench/train_throughput/RESULTS.md, "Training step throughput").
                "fused": True,
            },
        },
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # Progress is reported by the loop through ray.train.report; keep DeepSpeed quiet.
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
