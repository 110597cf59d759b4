"""gti.train.deepspeed_config.build_ds_config: batch arithmetic, ZeRO stages, precision,
optimizer settings, and one-line ConfigErrors naming the key."""

from __future__ import annotations

import pytest

from gti.config.train import GroundConfig, SftConfig
from gti.common.errors import ConfigError
from gti.train.deepspeed_config import build_ds_config, micro_batch


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("bf16_weights", [False, True])
def test_every_stage_and_precision(stage, precision, bf16_weights):
    cfg = GroundConfig(zero_stage=stage, precision=precision, batch_size=16, num_workers=2,
                       grad_accum=2, lr=3e-3, weight_decay=0.1, max_grad_norm=0.5)
    if bf16_weights and stage == 0:
        with pytest.raises(ConfigError, match=r"model\.dtype=bfloat16 needs ground\.zero_stage >= 1"):
            build_ds_config(cfg, 2, use_gpu=False, bf16_weights=True)
        return
    ds = build_ds_config(cfg, 2, use_gpu=False, bf16_weights=bf16_weights)
    assert ds["train_micro_batch_size_per_gpu"] == 4 == micro_batch(cfg, 2)
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 16
    assert ds["gradient_clipping"] == 0.5
    # precision is autocast in the loop; DeepSpeed's bf16 mode follows the weights' dtype only.
    assert ds["bf16"] == {"enabled": bf16_weights}
    assert ds["fp16"] == {"enabled": False}
    z = ds["zero_optimization"]
    assert z["stage"] == stage
    assert z["offload_optimizer"] == {"device": "none"}
    assert z["overlap_comm"] is False  # CPU: nothing to overlap with
    assert ("offload_param" in z) == (stage == 3)
    assert ("stage3_gather_16bit_weights_on_model_save" in z) == (stage == 3)
    opt = ds["optimizer"]
    assert opt["type"] == "AdamW"
    assert opt["params"]["lr"] == 3e-3 and opt["params"]["weight_decay"] == 0.1
    assert opt["params"]["betas"] == [0.9, 0.999]
    # torch's AdamW: FusedAdam is a CUDA op that does not exist on CPU.
    assert opt["params"]["torch_adam"] is True
    assert "scheduler" not in ds  # built in torch by the loop (gti.train.schedule)


def test_gpu_overlaps_communication():
    ds = build_ds_config(GroundConfig(batch_size=8), 1, use_gpu=True)
    assert ds["zero_optimization"]["overlap_comm"] is True


def test_betas_and_eps_from_config():
    cfg = SftConfig(batch_size=4, adam_betas=(0.8, 0.95), adam_eps=1e-6)
    p = build_ds_config(cfg, 1, use_gpu=False)["optimizer"]["params"]
    assert p["betas"] == [0.8, 0.95] and p["eps"] == 1e-6


def test_batch_not_divisible_names_the_key():
    cfg = GroundConfig(batch_size=10, grad_accum=2)
    with pytest.raises(ConfigError, match=r"^ground\.batch_size \(10\) .*3 x 2 = 6"):
        build_ds_config(cfg, 3, use_gpu=False)


def test_batch_smaller_than_workers_names_the_sft_key():
    with pytest.raises(ConfigError, match=r"^sft\.batch_size \(2\)"):
        build_ds_config(SftConfig(batch_size=2), 4, use_gpu=False)


def test_bad_beta_names_the_key():
    with pytest.raises(ConfigError, match=r"^ground\.adam_betas"):
        build_ds_config(GroundConfig(batch_size=4, adam_betas=(0.9, 1.0)), 1, use_gpu=False)


def test_deepspeed_accepts_the_dict():
    """DeepSpeed's own config parser (which, without torch.distributed, assumes one rank)
    accepts the dict and agrees on the batch arithmetic for every stage and precision."""
    from deepspeed.runtime.config import DeepSpeedConfig

    for stage in (0, 1, 2, 3):
        cfg = GroundConfig(batch_size=8, zero_stage=stage, grad_accum=2, precision="bf16")
        parsed = DeepSpeedConfig(build_ds_config(cfg, 1, use_gpu=False, bf16_weights=stage > 0))
        assert parsed.train_batch_size == 8
        assert parsed.train_micro_batch_size_per_gpu == 4
        assert parsed.bfloat16_config.enabled == (stage > 0)
        assert parsed.gradient_accumulation_steps == 2
        assert parsed.zero_optimization_stage == stage
