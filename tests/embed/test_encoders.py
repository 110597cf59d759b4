"""gti.embed.encoders: hash, minilm, lm and local-folder encoders."""

from __future__ import annotations

import numpy as np
import pytest

from gti.config import EmbedConfig, ModelConfig
from gti.embed import encoders as E
from gti.common.errors import GtiError

TEXTS = [
    "Stainless steel laboratory beaker 250 ml",
    "Glass laboratory beaker 500 ml with spout",
    "Romantic comedy movie set in Paris",
]


def _cos(a, b):
    return float(np.dot(a, b))


def test_item_text_uses_configured_fields_in_order():
    t = E.item_text("Beaker", "A glass beaker", "Lab > Glass", "brand: Pyrex", ["title", "category", "attributes"])
    assert t == "Beaker. category: Lab > Glass. attributes: brand: Pyrex"
    assert E.item_text("", "desc", "", "", ["title", "description"]) == "description: desc"


def test_hash_encoder_deterministic_normalised_and_similarity():
    enc = E.build_encoder(EmbedConfig(encoder="hash", dim=64))
    a = enc.encode(TEXTS)
    b = E.HashEncoder(64).encode(TEXTS)  # a fresh instance (fresh cache) gives the same bits
    assert a.shape == (3, 64) and a.dtype == np.float32
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-6)
    assert _cos(a[0], a[1]) > _cos(a[0], a[2])
    # Empty text: zero vector, never NaN.
    z = enc.encode(["", "!!!"])
    assert np.isfinite(z).all() and not z.any()


def test_hash_encoder_known_value_is_stable_across_versions():
    # crc32 of "beaker" picks a fixed bucket; a change to the hashing scheme breaks this.
    v = E.HashEncoder(16).encode(["beaker"])[0]
    import zlib

    h = zlib.crc32(b"beaker")
    expected = np.zeros(16, np.float32)
    expected[h % 16] = 1.0 if h >> 31 else -1.0
    np.testing.assert_array_equal(v, expected)


@pytest.mark.slow
def test_minilm_encoder_l2_and_semantics():
    enc = E.build_encoder(EmbedConfig(encoder="minilm", max_tokens=32))
    v = enc.encode(TEXTS)
    assert enc.dim == 384 and v.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert _cos(v[0], v[1]) > _cos(v[0], v[2]) + 0.2
    # Batch composition does not change a row (padding is masked out of the mean).
    solo = enc.encode([TEXTS[2]])
    np.testing.assert_allclose(solo[0], v[2], atol=1e-5)


def test_minilm_folder_found_without_import():
    p = E.minilm_path()
    assert (p / "config.json").is_file() and (p / "model.safetensors").is_file()


@pytest.mark.slow
def test_lm_encoder_from_folder(tmp_path):
    from gti.lm.models import build_tiny

    model, tok = build_tiny(ModelConfig(name="tiny", tiny_hidden=32, tiny_layers=1, tiny_heads=2))
    model.save_pretrained(tmp_path / "lm", safe_serialization=True)
    tok.save_pretrained(tmp_path / "lm")
    enc = E.build_encoder(EmbedConfig(encoder="lm", lm_path=str(tmp_path / "lm"), max_tokens=16))
    v = enc.encode(TEXTS)
    assert v.shape == (3, 32)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(enc.encode(TEXTS), v, atol=1e-6)  # deterministic (eval mode)
    # The in-memory tiny model (model.name: tiny) works the same way.
    enc2 = E.build_encoder(EmbedConfig(encoder="lm"), ModelConfig(name="tiny", tiny_hidden=32,
                                                                    tiny_layers=1, tiny_heads=2))
    assert enc2.encode(TEXTS[:1]).shape == (1, 32)
    # A local HF encoder folder given directly as the encoder also loads (safetensors only).
    enc3 = E.build_encoder(EmbedConfig(encoder=str(E.minilm_path()), max_tokens=16))
    assert enc3.encode(TEXTS[:2]).shape == (2, 384)


def test_bad_encoder_names_are_one_line_errors(tmp_path):
    with pytest.raises(GtiError, match="embed.encoder 'nope'"):
        E.build_encoder(EmbedConfig(encoder="nope"))
    with pytest.raises(GtiError, match="embed.lm_path"):
        E.build_encoder(EmbedConfig(encoder="lm", lm_path=str(tmp_path)))
