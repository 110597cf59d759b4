"""gti/train/sft_task.py: the SFT task's LoRA/QLoRA checks, its model building and export."""

from __future__ import annotations

import pytest
import torch

from gti.config.train import SftConfig
from gti.common.errors import ConfigError

HASH = "hash-sft-task"


def test_qlora_without_bitsandbytes_or_gpu_is_a_config_error():
    from gti.train import sft_task as sft

    with pytest.raises(ConfigError, match="sft.lora.quantize_4bit"):
        sft.check_lora_supported(SftConfig(lora={"enabled": True, "quantize_4bit": True}))
    with pytest.raises(ConfigError, match="sft.lora.enabled"):
        sft.check_lora_supported(SftConfig(lora={"enabled": False, "quantize_4bit": True}))
    sft.check_lora_supported(SftConfig(lora={"enabled": True}))


def test_frozen_layers_build_and_export_agree(tmp_path):
    """sft.freeze_layers: the worker's model trains the upper layers only, and the export loads
    exactly the trained tensors (the frozen layer stays as grounded, nothing is reported
    missing)."""
    from pathlib import Path

    from gti import config
    from gti.lm import models, new_rows
    from gti.train import sft_task as sft
    from gti.train.worker_config import SftStart, WorkerConfig

    model, tok = models.build_tiny(config.ModelConfig(name="tiny"), seed=0)
    new_rows.export_model(model, tok, tmp_path / "m", {"sid_map_hash": HASH})
    root = Path(__file__).resolve().parents[2]
    cfg = config.load(root / "jobs" / "configs" / "tiny.yaml", ["sft.freeze_layers=1", "sft.dropout=0.1"])
    built = sft.build_sft_model(WorkerConfig.build("sft", cfg, 0, sft=SftStart(str(tmp_path / "m"))), cfg)
    state = sft.sft_trainable_state(built)
    assert state and not any(n.startswith("model.layers.0.") for n in state)
    assert any(n.startswith("model.layers.1.") for n in state)
    with torch.no_grad():
        state = {n: t + 0.01 for n, t in state.items()}
    out = sft.rebuild_trained(tmp_path / "m", cfg, state)
    got = dict(out.named_parameters())
    torch.testing.assert_close(got["model.layers.0.mlp.up_proj.weight"], model.model.layers[0].mlp.up_proj.weight)
    torch.testing.assert_close(got["model.layers.1.mlp.up_proj.weight"], state["model.layers.1.mlp.up_proj.weight"])


def test_regularisers_refuse_lora():
    from gti.train import sft_task as sft

    with pytest.raises(ConfigError, match="sft.freeze_layers and sft.dropout"):
        sft.check_lora_supported(SftConfig(lora={"enabled": True}, freeze_layers=2))
