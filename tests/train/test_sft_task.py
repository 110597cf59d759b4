"""gti/train/sft_task.py: the SFT task's LoRA/QLoRA checks, its model building and export."""

from __future__ import annotations

import pytest
import torch

from gti import config

HASH = "hash-sft-task"


def test_qlora_without_bitsandbytes_or_gpu_is_a_config_error():
    from gti.train import sft_task as sft

    with pytest.raises(config.ConfigError, match="sft.lora.quantize_4bit"):
        sft.check_lora_supported(config.SftConfig(lora={"enabled": True, "quantize_4bit": True}))
    with pytest.raises(config.ConfigError, match="sft.lora.enabled"):
        sft.check_lora_supported(config.SftConfig(lora={"enabled": False, "quantize_4bit": True}))
    sft.check_lora_supported(config.SftConfig(lora={"enabled": True}))
