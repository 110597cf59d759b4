"""gti/common/arms.py: the init methods, default templates and arm names are defined once and every user
agrees with them."""

from __future__ import annotations

import pytest

from gti import config as C
from gti.common.errors import ConfigError
from gti.common.arms import DEFAULT_GROUNDING_TEMPLATES, INIT_METHODS, arm_name


def test_arm_names():
    assert arm_name("mean", grounded=True) == "gti"
    assert arm_name("codebook", grounded=True) == "gti+codebook"
    assert arm_name("description", grounded=False) == "description"
    assert arm_name("mean", grounded=True, multitask=True) == "gti+multitask"
    assert arm_name("mean", grounded=True, rl=True) == "gti+rl"
    assert arm_name("mean", grounded=True, multitask=True, rl=True) == "gti+multitask+rl"
    assert arm_name("random", grounded=False, rl=True) == "random+rl"


def test_report_label_names_the_rl_arm_only_when_rl_trains():
    from gti.stages.report import arm_label

    def label(*ov):
        return arm_label(C.load(None, list(ov)))

    assert label() == "gti"
    assert label("rl.enabled=true") == "gti+rl"
    assert label("rl.enabled=true", "rl.steps=0") == "gti"  # the rl stage trains nothing
    assert label("rl.enabled=true", "sft.multitask=true") == "gti+multitask+rl"
    assert label("rl.enabled=true", "report.label=mine") == "mine"


def test_config_and_init_accept_exactly_the_named_methods_and_templates():
    import torch

    from gti.lm.init import init_rows

    inputs = dict(generator=torch.Generator().manual_seed(0), codebook_sizes=[3], codebooks=[torch.randn(3, 4)],
                  item_codes=torch.tensor([[0], [1], [2]]), item_token_ids=[[1, 2], [3], [4, 5]])
    for m in INIT_METHODS:
        assert C.validate({"init": {"method": m}}, "t").init.method == m
        assert init_rows(m, torch.randn(8, 4), 3, **inputs).shape == (3, 4)
    with pytest.raises(ConfigError, match="init.method"):
        C.validate({"init": {"method": "bogus"}}, "t")
    with pytest.raises(ConfigError, match="init.method 'bogus' is not one of"):
        init_rows("bogus", torch.randn(8, 4), 3, **inputs)
    assert C.RunConfig().pairs.templates == DEFAULT_GROUNDING_TEMPLATES
