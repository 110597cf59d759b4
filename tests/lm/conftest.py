"""Fixtures for tests/lm: tiny models built from config (no downloads)."""

from __future__ import annotations

import pytest

from gti.config import ModelConfig


@pytest.fixture
def tiny_model_cfg():
    def make(**kw) -> ModelConfig:
        base = dict(name="tiny", tiny_hidden=32, tiny_layers=1, tiny_heads=2)
        base.update(kw)
        return ModelConfig(**base)

    return make
