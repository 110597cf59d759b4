"""The sections of the commands beside the pipeline (gti/config/commands.py): held by
RunConfig, validated like every section, and the refresh lr's default."""

from __future__ import annotations

import pytest

from gti import config as C
from gti.config import commands as CC
from gti.config.commands import TuneConfig
from gti.common.errors import ConfigError


def test_run_config_holds_the_command_sections():
    cfg = C.load(None)
    assert isinstance(cfg.compare, CC.CompareConfig) and isinstance(cfg.tune, CC.TuneConfig)
    assert isinstance(cfg.tracking, CC.TrackingConfig) and isinstance(cfg.refresh, CC.RefreshConfig)
    assert TuneConfig is CC.TuneConfig  # still reachable as gti.config.<Section>


def test_refresh_lr_defaults_to_a_share_of_the_grounding_lr():
    assert C.load(None).refresh.ground_lr_from(1e-3) == pytest.approx(CC.REFRESH_LR_SCALE * 1e-3)
    assert C.load(None, ["refresh.ground_lr=0.02"]).refresh.ground_lr_from(1e-3) == pytest.approx(0.02)


@pytest.mark.parametrize("override,key", [
    ("compare.arm_timeout_s=0", "compare.arm_timeout_s"),
    ("tune.reduction_factor=1", "tune.reduction_factor"),
    ("tune.mode=sideways", "tune.mode"),
    ("tracking.mlflow_experiment=", "tracking.mlflow_experiment"),
    ("refresh.on_full_group=grow", "refresh.on_full_group"),
    ("refresh.sft_lr=0", "refresh.sft_lr"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        C.load(None, [override])
