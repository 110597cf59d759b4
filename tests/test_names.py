"""gti/names.py: each shared name is defined once and every user agrees with it."""

from __future__ import annotations

import pytest

from gti import config as C
from gti.names import DEFAULT_GROUNDING_TEMPLATES, INIT_METHODS, arm_name


def test_arm_names():
    assert arm_name("mean", grounded=True) == "gti"
    assert arm_name("codebook", grounded=True) == "gti+codebook"
    assert arm_name("description", grounded=False) == "description"
    assert arm_name("mean", grounded=True, multitask=True) == "gti+multitask"


def test_config_and_init_accept_exactly_the_named_methods_and_templates():
    from gti.lm import init as lm_init

    assert tuple(lm_init.METHODS) == INIT_METHODS
    for m in INIT_METHODS:
        assert C.validate({"init": {"method": m}}, "t").init.method == m
    with pytest.raises(C.ConfigError, match="init.method"):
        C.validate({"init": {"method": "bogus"}}, "t")
    assert C.RunConfig().pairs.templates == DEFAULT_GROUNDING_TEMPLATES
