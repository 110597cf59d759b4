"""Stage `ingest`: validate the catalog and the interactions on Ray Data, build sequences.

What it is for: turning the user's files (`gti.data.adapters`; a MiniOneRec folder with
`data.root`) into the contract files of docs/ARCHITECTURE.md. Ray Data reads and checks rows in
parallel and streams the validated batches back in input order, so the driver applies the
checks that need everything seen so far (duplicate ids, caps, unknown items) while it writes;
sequences are built in one process (`gti.data.sequences`). Every input row ends in exactly one
of the output or a quarantine file with its reason (`*_rows_in == *_rows_ok +
*_rows_quarantined`); caps, the dense subset, warnings and damaged files: docs/data.md. What
`gti refresh` shares with it lives below, in `gti.data.batches` and `gti.data.items`.

What it does not know: embeddings or anything downstream.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gti.run.contract import StageContext, StageResult
from gti.data.sources import ReadTask
from gti.data import catalog as cat
from gti.data.batches import Source, fill_interaction_raw, iterate, local_stream, raise_file_error, validated_batches
from gti.data.dense import DenseCut, cut_interactions, quarantine_items
from gti.data.idset import IdSet
from gti.data.items import ROW_GROUP, ingest_items
from gti.data.schemas import INTER_OUT_SCHEMA, INTER_Q_SCHEMA, SEQ_SCHEMA
from gti.data.sequences import build_sequences
from gti.common.errors import DataError, user_error
from gti.run.input_files import fingerprint_files
from gti.common.redact import redact_text
from gti.common.timing import Timer

# Caps and filters that can silently remove most of a data set: quarantine reason -> config key.
CAP_KEYS = {cat.OUTSIDE_MAX_ITEMS: "data.max_items", cat.OUTSIDE_MAX_USERS: "data.max_users",
            cat.SHORT_SEQUENCE: "data.min_seq_len"}


# --------------------------------------------------------------------------- fingerprints
def input_fingerprints(cfg) -> dict[str, str]:
    d = cfg.data
    if d.root is not None:  # MiniOneRec's folder: its files are the input, not data.items/interactions
        from dataclasses import astuple

        from gti.data.minionerec import find_files

        found = [str(p) for p in astuple(find_files(d.root, d.dataset))[:4]]
        return {"root": "|".join(fingerprint_files(p, "data.root") for p in found)}
    return {
        "items": fingerprint_files(d.items.path, "items", d.items.storage_options),
        "interactions": fingerprint_files(d.interactions.path, "interactions", d.interactions.storage_options),
    }


# --------------------------------------------------------------------------- Ray tasks
def _read_validate(batch: dict, kind: str, columns: dict, max_text_chars: int, batch_rows: int):
    """map_batches body (batch_size=1): one read task in, validated pyarrow batches out
    (`gti.data.batches.validated_batches`; the task and the columns travel as JSON / a dict)."""
    from gti.config import InteractionColumns, ItemColumns

    cols = ItemColumns(**columns) if kind == "items" else InteractionColumns(**columns)
    tasks = [ReadTask(**json.loads(spec)) for spec in batch["task"]]
    yield from validated_batches(tasks, kind, cols, max_text_chars, batch_rows)


def ray_stream(tasks: list[ReadTask], kind: str, columns, max_text_chars: int, parallelism):
    """Validated batches of all tasks, in input order, read and checked by Ray Data tasks."""
    import ray

    ds = ray.data.from_items(
        [{"task": json.dumps(asdict(t))} for t in tasks], override_num_blocks=max(1, len(tasks))
    )
    ds = ds.map_batches(
        _read_validate,
        batch_size=1,
        fn_kwargs=dict(kind=kind, columns=columns.model_dump(), max_text_chars=max_text_chars,
                       batch_rows=8192),
        compute=ray.data.TaskPoolStrategy(size=parallelism),
    )
    try:
        yield from ds.iter_batches(batch_size=None, batch_format="pyarrow")
    except Exception as err:  # noqa: BLE001 - a user error inside a task is one line, not Ray's report
        user = user_error(err)
        if user is not None:
            raise user from None
        raise


def _small_local_stream(tasks: list[ReadTask], kind: str, columns, max_text_chars: int, parallelism):
    """A source of one read task (one small file) has nothing for Ray Data to run in parallel,
    and a task's start-up is most of its time (bench/small_catalog/RESULTS.md, "Small catalogs without Ray
    Data"): it is read in this process, the same batches. More tasks: `ray_stream`."""
    if len(tasks) <= 1:
        yield from local_stream(tasks, kind, columns, max_text_chars, parallelism)
    else:
        yield from ray_stream(tasks, kind, columns, max_text_chars, parallelism)


# --------------------------------------------------------------------------- interactions
def _ingest_interactions(ctx: StageContext, out: Path, kept_ids: IdSet, items_limited: bool,
                         stream, source: Source | None = None, cuts: tuple[int, int] | None = None) -> dict:
    source = source or Source(ctx.cfg.data, "interactions", ctx.log)
    ctx.log(f"interactions: {len(source.files)} file(s) from {redact_text(ctx.cfg.data.interactions.path)}")
    return source.passes(lambda tasks: _interactions_pass(ctx, out, kept_ids, items_limited, stream,
                                                          tasks, source.skip, cuts))


def _interactions_pass(ctx: StageContext, out: Path, kept_ids: IdSet, items_limited: bool,
                       stream, tasks, skip: bool, cuts: tuple[int, int] | None = None) -> dict:
    d = ctx.cfg.data
    src = d.interactions
    reasons: Counter[str] = Counter()
    rows_in = quarantined = 0
    order = 0
    has_ts = src.columns.ts is not None
    movielens = any(t.fmt == "movielens" for t in tasks)  # u.data always has timestamps
    kept_parts: list[pa.Table] = []
    w_q = pq.ParquetWriter(out / "interactions_quarantine.parquet", INTER_Q_SCHEMA)
    try:
        for batch in iterate(stream, tasks, "interactions", src.columns, d.max_text_chars, d.parallelism):
            raise_file_error(batch, skip)
            n = batch.num_rows
            rows_in += n
            batch = batch.append_column("order", pa.array(range(order, order + n), pa.int64()))
            order += n
            valid = pc.is_null(batch.column("reason"))
            known = pa.array(kept_ids.contains(batch.column("item_id")))
            unknown = pc.and_(valid, pc.invert(known))
            unknown_reason = cat.OUTSIDE_MAX_ITEMS if items_limited else cat.UNKNOWN_ITEM
            reason = pc.if_else(unknown, pa.scalar(unknown_reason, pa.string()), batch.column("reason"))
            detail = pc.if_else(unknown, pa.scalar("item_id", pa.string()), batch.column("detail"))
            batch = batch.set_column(batch.schema.get_field_index("reason"), "reason", reason)
            batch = batch.set_column(batch.schema.get_field_index("detail"), "detail", detail)
            ok_mask = pc.is_null(reason)
            bad = batch.filter(pc.invert(ok_mask))
            if bad.num_rows:
                bad = fill_interaction_raw(bad)
                w_q.write_table(bad.select(cat.INTERACTIONS_QUARANTINE_COLUMNS).cast(INTER_Q_SCHEMA))
                quarantined += bad.num_rows
                reasons.update(bad.column("reason").to_pylist())
            ok = batch.filter(ok_mask).select(["user_id", "item_id", "ts", "order", "source_file", "source_row"])
            if not has_ts and not movielens:
                # No ts column: the global file position is the clock.
                ok = ok.set_column(2, "ts", ok.column("order"))
            kept_parts.append(ok)
        if not kept_parts or sum(t.num_rows for t in kept_parts) == 0:
            raise DataError(
                f"data.interactions.path {redact_text(src.path)}: no valid interactions ({rows_in} rows read; "
                + (", ".join(f"{k}: {v}" for k, v in reasons.most_common()) or "no rows") + ")"
            )
        df = pl.from_arrow(pa.concat_tables(kept_parts))
        kept_parts.clear()
        cut = _dense_cut(ctx, out, df)
        res = build_sequences(df if cut is None else cut.interactions, d.min_seq_len, d.max_users,
                              d.split, d.split_ratios, cuts)
        dropped = res.dropped.with_columns(pl.lit("user_id").alias("detail"))
        if cut is not None:  # the dense cut's rows first: they left before the sequence filters
            dropped = pl.concat([cut.dropped.select(dropped.columns), dropped])
        if dropped.height:
            dropped = dropped.with_columns(
                pl.struct("user_id", "item_id", "ts").map_elements(
                    lambda s: json.dumps({k: None if v is None else str(v) for k, v in s.items()}),
                    return_dtype=pl.String,
                ).alias("raw"),
            ).select(cat.INTERACTIONS_QUARANTINE_COLUMNS)
            w_q.write_table(dropped.to_arrow().cast(INTER_Q_SCHEMA))
            quarantined += dropped.height
            reasons.update(dropped.get_column("reason").to_list())
    finally:
        w_q.close()
    if res.sequences.height == 0:
        raise DataError(
            f"data.interactions.path {redact_text(src.path)}: no user has >= {res.min_seq_len} valid interactions "
            f"({', '.join(f'{k}: {v}' for k, v in reasons.most_common())})"
        )
    pq.write_table(res.interactions.to_arrow().cast(INTER_OUT_SCHEMA), out / "interactions.parquet",
                   row_group_size=ROW_GROUP)
    pq.write_table(res.sequences.to_arrow().cast(SEQ_SCHEMA), out / "sequences.parquet",
                   row_group_size=ROW_GROUP)
    return dict(
        rows_in=rows_in, ok=res.interactions.height, quarantined=quarantined, reasons=dict(reasons),
        n_users=res.sequences.height, min_seq_len=res.min_seq_len,
        n_items_interacted=res.interactions.get_column("item_id").n_unique(), dense=cut, split=res.split,
    )


def _dense_cut(ctx: StageContext, out: Path, df: pl.DataFrame) -> DenseCut | None:
    """`data.dense`'s subset of the valid interactions `df` (None when data.dense.top_items is
    unset); the catalog order that breaks ties is items.parquet's, written by the items pass."""
    dense = ctx.cfg.data.dense
    if dense.top_items is None:
        return None
    ids = pl.read_parquet(out / "items.parquet", columns=["item_id"])["item_id"].to_list()
    cut = cut_interactions(ids, df, dense.top_items, dense.min_user_len)
    f = cut.facts
    ctx.log(f"data.dense: kept {f['items_after']:,} of {f['items_before']:,} items, {f['users_after']:,} of "
            f"{f['users_before']:,} users, {f['interactions_after']:,} of {f['interactions_before']:,} interactions")
    return cut


def cap_warnings(cfg, rows_in: int, reasons: dict[str, int], share: float = 0.5) -> list[str]:
    """One line per cap or filter that removed more than `share` of the interactions read
    (e.g. `max_items: 300` copied from tiny.yaml onto a real data set), naming its key."""
    out = []
    for reason, key in CAP_KEYS.items():
        n = reasons.get(reason, 0)
        if rows_in and n > share * rows_in:
            value = getattr(cfg.data, key.split(".", 1)[1])
            change = "lower it" if key == "data.min_seq_len" else "raise or remove it"
            out.append(f"{key}={value} removed {n / rows_in:.0%} of the interactions ({n:,} of {rows_in:,} "
                       f"rows, reason {reason}); {change} to keep them")
    return out


# --------------------------------------------------------------------------- data.root
def _from_root(ctx: StageContext) -> tuple[StageContext, tuple[int, int] | None, dict | None]:
    """With `data.root` (MiniOneRec's layout, `gti.data.minionerec`): its catalog and
    interactions written to `source/` in the work dir, and a context whose data block reads
    them like any parquet source, so every row check applies; plus the cut timestamps of the
    files' split and the reader's facts. Without it: (ctx, None, None)."""
    d = ctx.cfg.data
    if d.root is None:
        return ctx, None, None
    from dataclasses import replace

    from gti.config import InteractionsSource, ItemColumns, ItemsSource
    from gti.data import minionerec

    conv = minionerec.read(minionerec.find_files(d.root, d.dataset))
    src = ctx.work_dir / "source"
    src.mkdir(parents=True, exist_ok=True)
    conv.items.write_parquet(src / "items.parquet")
    conv.interactions.write_parquet(src / "interactions.parquet")
    ctx.log(f"data.root {d.root}: {conv.facts['rows']} rows of {conv.facts['users']:,} users, "
            f"{conv.items.height:,} items ({conv.facts['item_json']})")
    data = d.model_copy(update={
        "root": None,  # the staged files are the sources now
        "items": ItemsSource(path=str(src / "items.parquet"), format="parquet",
                             columns=ItemColumns(attributes=["brand"])),
        "interactions": InteractionsSource(path=str(src / "interactions.parquet"), format="parquet"),
    })
    return replace(ctx, cfg=ctx.cfg.model_copy(update={"data": data})), conv.cuts, conv.facts


# --------------------------------------------------------------------------- stage
def run(ctx: StageContext) -> StageResult:
    from gti.ray_start import ensure_ray

    ctx, cuts, root_facts = _from_root(ctx)
    # Both sources' files and headers are checked before Ray starts and any row is read.
    sources = _sources(ctx)
    t0 = time.perf_counter()
    ensure_ray(ctx.cfg)  # a no-op after an earlier stage of the same `gti run` started it
    import ray

    # Input order matters: "first kept" for duplicates and ties in sequences follow file order.
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    res = ingest(ctx, ray_stream if ctx.cfg.local_max_items == 0 else _small_local_stream, sources,
                 cuts, root_facts)
    res.facts["timing"]["ray_start_s"] = round(time.perf_counter() - t0 - res.facts["timing"]["total_s"], 3)
    return res


def _sources(ctx: StageContext) -> dict[str, Source]:
    return {kind: Source(ctx.cfg.data, kind, ctx.log) for kind in ("items", "interactions")}


def ingest(ctx: StageContext, stream=local_stream, sources: dict[str, Source] | None = None,
           cuts: tuple[int, int] | None = None, root_facts: dict | None = None) -> StageResult:
    """The stage body; `stream` yields validated batches in input order (`ray_stream` in the
    pipeline, `local_stream` in-process); `cuts` / `root_facts` from `_from_root` (called
    here when the caller has not)."""
    if ctx.cfg.data.root is not None:
        ctx, cuts, root_facts = _from_root(ctx)
    out = ctx.work_dir
    timer = Timer()
    sources = sources or _sources(ctx)  # files and headers of both, before any row is read
    with timer.phase("items"):
        items, kept_ids = ingest_items(ctx, out, stream, sources["items"])
    ctx.log(f"items: {items.ok:,} ok, {items.quarantined:,} quarantined in {timer.seconds['items']:.1f}s")
    with timer.phase("interactions"):
        inter = _ingest_interactions(ctx, out, kept_ids, items.limit_reached, stream, sources["interactions"],
                                     cuts)
    ctx.log(f"interactions: {inter['ok']:,} ok, {inter['quarantined']:,} quarantined; {inter['n_users']:,} users")
    cut = inter.pop("dense")
    if cut is not None:  # items outside the subset leave items.parquet for its quarantine
        with timer.phase("dense_items"):
            moved = quarantine_items(out, cut.items, ROW_GROUP)
        items.ok, items.quarantined = items.ok - moved, items.quarantined + moved
        items.reasons[cat.OUTSIDE_DENSE] += moved
    all_reasons = Counter(items.reasons) + Counter(inter["reasons"])
    warnings = cap_warnings(ctx.cfg, inter["rows_in"], inter["reasons"])
    for w in warnings:
        ctx.log(f"WARNING: {w}")
    skipped = {kind: s.skipped for kind, s in sources.items()}
    facts = {
        "items_rows_in": items.rows_in,
        "items_rows_ok": items.ok,
        "items_rows_quarantined": items.quarantined,
        "interactions_rows_in": inter["rows_in"],
        "interactions_rows_ok": inter["ok"],
        "interactions_rows_quarantined": inter["quarantined"],
        "n_items": items.ok,
        "n_users": inter["n_users"],
        "n_items_interacted": inter["n_items_interacted"],
        "truncated_texts": int(items.truncated),
        "pseudo_texts": int(items.pseudo),
        "quarantine_reasons": dict(all_reasons),
        "items_quarantine_reasons": dict(items.reasons),
        "interactions_quarantine_reasons": inter["reasons"],
        "items_limit_reached": items.limit_reached,
        "items_missing_columns": items.missing_columns,  # type: ignore[attr-defined]
        "min_seq_len_effective": inter["min_seq_len"],
        "max_history": ctx.cfg.data.max_history,
        "split": inter["split"],  # name; global_time: interactions per period and where it cut
        "skipped_files": skipped,
        "warnings": warnings,
        "dense": None if cut is None else cut.facts,
        "root": root_facts,  # data.root: the files read, their rows and users
        "timing": timer.facts(),
    }
    if any(skipped.values()):
        facts["skipped_files_rows_in"] = (
            "unknown: skipped files could not be read, so their rows are in no *_rows_in count")
    return StageResult(
        outputs={
            "items": "items.parquet",
            "items_quarantine": "items_quarantine.parquet",
            "interactions": "interactions.parquet",
            "interactions_quarantine": "interactions_quarantine.parquet",
            "sequences": "sequences.parquet",
        },
        facts=facts,
    )
