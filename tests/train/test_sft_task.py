"""gti/train/sft_task.py: the SFT task's LoRA/QLoRA checks, its model building and export."""

from __future__ import annotations

import pytest
import torch

from gti.config_train import SftConfig
from gti.errors import ConfigError

HASH = "hash-sft-task"


def test_qlora_without_bitsandbytes_or_gpu_is_a_config_error():
    from gti.train import sft_task as sft

    with pytest.raises(ConfigError, match="sft.lora.quantize_4bit"):
        sft.check_lora_supported(SftConfig(lora={"enabled": True, "quantize_4bit": True}))
    with pytest.raises(ConfigError, match="sft.lora.enabled"):
        sft.check_lora_supported(SftConfig(lora={"enabled": False, "quantize_4bit": True}))
    sft.check_lora_supported(SftConfig(lora={"enabled": True}))
