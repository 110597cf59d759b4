"""The training sections of the run config (gti/config/train.py): shared fields, each stage's
own defaults, bounds, and their place in RunConfig (reached through gti.config as before)."""

import pytest
from pydantic import ValidationError

from gti import config as C
from gti.config import train as T
from gti.config.train import GroundConfig, LoraConfig, SftConfig, TrainConfig
from gti.common.errors import ConfigError


def test_grounding_and_sft_share_the_training_fields_with_their_own_defaults():
    g, s = T.GroundConfig(), T.SftConfig()
    assert isinstance(g, T.TrainConfig) and isinstance(s, T.TrainConfig)
    assert (g.lr, g.steps, g.schedule, g.weight_decay) == (1e-3, 200, "constant", 0.0)
    assert (s.lr, s.steps, s.schedule, s.weight_decay) == (3e-4, 200, "cosine", 0.01)
    assert s.lora == T.LoraConfig() and s.lora.enabled is False
    assert s.prompt_style == "chat" and s.multitask is False


@pytest.mark.parametrize("cls, key, value", [
    (T.TrainConfig, "grad_accum", 0), (T.TrainConfig, "zero_stage", 4), (T.TrainConfig, "precision", "fp16"),
    (T.GroundConfig, "lr", 0), (T.SftConfig, "max_len", 8), (T.LoraConfig, "dropout", 1.0),
    (T.SftConfig, "lorra", {}),
])
def test_bad_values_and_unknown_keys_are_refused(cls, key, value):
    with pytest.raises(ValidationError):
        cls(**{key: value})


def test_run_config_holds_them_and_gti_config_re_exports_them():
    assert (TrainConfig, GroundConfig, SftConfig, LoraConfig) == (
        T.TrainConfig, T.GroundConfig, T.SftConfig, T.LoraConfig)
    cfg = C.load(None, ["sft.lora.r=4", "ground.steps=7"])
    assert isinstance(cfg.ground, T.GroundConfig) and cfg.ground.steps == 7
    assert isinstance(cfg.sft.lora, T.LoraConfig) and cfg.sft.lora.r == 4
    with pytest.raises(ConfigError, match="unknown key 'sft.lora.rank'"):
        C.load(None, ["sft.lora.rank=4"])


@pytest.mark.parametrize("section", ["ground", "sft"])
@pytest.mark.parametrize("value", [-1, T.MAX_TRAIN_FAILURES + 1])
def test_max_failures_is_bounded(section, value):
    """Ray's -1 (restart the worker group for ever) or a huge count would loop for ever on a
    failure that recurs: refused at validation, naming the key."""
    with pytest.raises(ConfigError) as e:
        C.load(None, [f"{section}.max_failures={value}"])
    assert f"'{section}.max_failures'" in str(e.value) and "\n" not in str(e.value)
    assert C.load(None, [f"{section}.max_failures={T.MAX_TRAIN_FAILURES}"])  # the bound itself is fine
