"""Step 1 of `gti refresh`: the new items and new interactions, read and validated as ingest does.

What it is for: `ingest_step(job)` writes `<work>/ingest/` with the ingest stage's own readers
and items pass (`gti.data.batches`, `gti.data.items.ingest_items`): the new items and their
quarantine; with `--interactions`, the new interactions and their quarantine, the sequences of
the parent's interactions + the new ones, split as the run did (`split_cuts`), and the users
they touch. Step by step: docs/refresh.md#what-it-does.

What it does not know: embeddings, SIDs, models, Ray (everything runs in this process).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gti.data import catalog as cat
from gti.data.batches import Source, fill_interaction_raw, iterate, local_stream, raise_file_error
from gti.data.idset import IdSet
from gti.data.items import ingest_items
from gti.data.schemas import INTER_OUT_SCHEMA, INTER_Q_SCHEMA, SEQ_SCHEMA
from gti.data.sequences import build_sequences
from gti.common.errors import DataError
from gti.refresh.attempt import Job, RefreshError, read_manifest
from gti.run.manifest import MANIFEST_NAME


def ingest_step(job: Job) -> dict:
    """Step 1; `<work>/ingest/` is written afresh: items.parquet and items_quarantine.parquet
    (the ingest stage's items pass, `gti.data.items.ingest_items`, on the in-process stream of
    `gti.data.batches`); with `--interactions`, also interactions_quarantine.parquet (row check
    failures; `unknown_item` for an item neither in the parent's map nor new; users left without
    enough history), interactions.parquet and sequences.parquet (the parent's interactions + the
    new ones, each user's history in time order, split as the run's `data.split`: leave-one-out
    again, or global_time by the cut timestamps of the run's ingest (`facts.split.cut_ts`), the
    old rows keeping the parent's periods) and touched_users.parquet (users with new
    interactions). Without a ts column the file order is the clock, after everything the run saw.
    Returns the step's facts (rows in / ok / quarantined, reasons, users, the split's facts)."""
    out = job.work / "ingest"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    ctx = SimpleNamespace(cfg=job.cfg, log=lambda m: job.log(f"ingest: {m}"), work_dir=out)
    facts, kept = _new_items(job, ctx, out)
    if job.interactions_given:
        facts.update(_new_interactions(job, ctx, out, kept))
    return facts


def _new_items(job: Job, ctx, out: Path) -> tuple[dict[str, Any], IdSet]:
    st, kept = ingest_items(ctx, out, local_stream, Source(job.cfg.data, "items", ctx.log))
    facts: dict[str, Any] = {"items_rows_in": st.rows_in, "items_rows_ok": st.ok,
                             "items_rows_quarantined": st.quarantined,
                             "items_quarantine_reasons": dict(st.reasons)}
    job.log(f"ingest: {st.ok} new items ok, {st.quarantined} quarantined "
            f"({', '.join(f'{r}: {n}' for r, n in st.reasons.most_common()) or 'none'})")
    return facts, kept


def _new_interactions(job: Job, ctx, out: Path, kept: IdSet) -> dict[str, Any]:
    old_ids = IdSet()
    old_ids.add(pq.read_table(str(job.parent.map_path), columns=["item_id"]).column("item_id"))
    d = job.cfg.data
    src = Source(d, "interactions", ctx.log)
    old = pl.read_parquet(job.parent.interactions_path)
    cuts = split_cuts(job.run_dir, d)
    if cuts is not None:
        old = old.with_columns(period=_old_periods(job, old))
    w_q = pq.ParquetWriter(out / "interactions_quarantine.parquet", INTER_Q_SCHEMA)
    try:
        new, rows_in, reasons = _read_new(d, src, old, old_ids, kept, w_q)
        res = _merge(old, new, d, w_q, reasons, cuts)
    finally:
        w_q.close()
    pq.write_table(res.interactions.to_arrow().cast(INTER_OUT_SCHEMA), out / "interactions.parquet")
    pq.write_table(res.sequences.to_arrow().cast(SEQ_SCHEMA), out / "sequences.parquet")
    touched = sorted(set(new["user_id"].to_list()) & set(res.sequences["user_id"].to_list()))
    pl.DataFrame({"user_id": touched}, schema={"user_id": pl.Utf8}).write_parquet(out / "touched_users.parquet")
    facts = {"interactions_rows_in": rows_in, "interactions_rows_ok": new.height - res.dropped.height,
             "interactions_rows_quarantined": rows_in - new.height + res.dropped.height,
             "interactions_quarantine_reasons": reasons, "n_users": res.sequences.height,
             "touched_users": len(touched), "split": res.split}
    job.log(f"ingest: {facts['interactions_rows_ok']} new interactions ok, "
            f"{facts['interactions_rows_quarantined']} quarantined; {len(touched)} users touched")
    return facts


def _read_new(d, src: Source, old: pl.DataFrame, old_ids: IdSet, kept: IdSet,
              w_q: pq.ParquetWriter) -> tuple[pl.DataFrame, int, dict[str, int]]:
    """(the valid new interactions with their global order, rows read, quarantine reasons);
    bad rows go to `w_q`. DataError when none is valid."""
    has_ts = d.interactions.columns.ts is not None
    ts0 = int(old["ts"].max()) + 1 if old.height else 0
    parts, rows_in, reasons = [], 0, {}
    for batch in iterate(local_stream, src.tasks, "interactions", d.interactions.columns, d.max_text_chars, None):
        raise_file_error(batch)
        ok, bad = _split_known(batch, old_ids, kept)
        if bad.num_rows:
            bad = fill_interaction_raw(bad)
            w_q.write_table(bad.select(cat.INTERACTIONS_QUARANTINE_COLUMNS).cast(INTER_Q_SCHEMA))
            for r in bad.column("reason").to_pylist():
                reasons[r] = reasons.get(r, 0) + 1
        ok = ok.select(["user_id", "item_id", "ts", "source_file", "source_row"])
        ok = ok.append_column("order", pa.array(range(old.height + rows_in, old.height + rows_in + ok.num_rows),
                                                pa.int64()))
        if not has_ts:  # file order is the clock: after everything the run saw
            ok = ok.set_column(2, "ts", pa.array(np.asarray(ok.column("order").to_numpy()) - old.height + ts0))
        parts.append(ok)
        rows_in += batch.num_rows
    new = pl.from_arrow(pa.concat_tables(parts)) if parts else None
    if new is None or new.height == 0:
        raise DataError(f"data.interactions.path {d.interactions.path}: no valid new interactions "
                        f"({rows_in} rows read; {', '.join(f'{k}: {v}' for k, v in reasons.items()) or 'no rows'})")
    return new, rows_in, reasons


def _split_known(batch: pa.Table, old_ids: IdSet, kept: IdSet) -> tuple[pa.Table, pa.Table]:
    """(valid rows naming a known item, the rest): a valid row naming an item neither in the
    parent's map nor among the new items becomes `unknown_item`."""
    valid = np.asarray(pc.is_null(batch.column("reason")).to_numpy(zero_copy_only=False))
    ids = batch.column("item_id")
    known = old_ids.contains(ids) | kept.contains(ids)
    unknown = valid & ~known
    reason = batch.column("reason").to_pylist()
    detail = batch.column("detail").to_pylist()
    for i in np.nonzero(unknown)[0]:
        reason[i], detail[i] = cat.UNKNOWN_ITEM, "item_id"
    batch = batch.set_column(batch.schema.get_field_index("reason"), "reason", pa.array(reason, pa.string()))
    batch = batch.set_column(batch.schema.get_field_index("detail"), "detail", pa.array(detail, pa.string()))
    return batch.filter(pa.array(valid & known)), batch.filter(pa.array(~(valid & known)))


def split_cuts(run_dir: Path, d) -> tuple[int, int] | None:
    """The cuts (first valid ts, first test ts) of the run's global_time split, from its ingest
    manifest (None with leave-one-out); RefreshError (one line) when `data.split` (`d`: the data
    config) is not the split the run's ingest recorded, or a global_time run's ingest did not
    record its cuts. `gti.refresh.command` asks first, before any work."""
    where = run_dir / "ingest" / MANIFEST_NAME
    split = read_manifest(run_dir, "ingest").facts.get("split") or {}
    if split.get("name", d.split) != d.split:
        raise RefreshError(f"data.split={d.split}, but the run's ingest split {split['name']} ({where} "
                           "facts.split.name): a refresh splits new interactions as the run did")
    if d.split != "global_time":
        return None
    cuts = split.get("cut_ts")
    if not cuts or None in cuts:
        raise RefreshError(f"{where} has no facts.split.cut_ts (the cut timestamps of data.split=global_time; "
                           "the run was ingested before ingest recorded them), so refresh cannot split new "
                           f"interactions as the run did; rerun its ingest (gti stage ingest --config "
                           f"{run_dir / 'config.yaml'}) to record them")
    return int(cuts[0]), int(cuts[1])


def _old_periods(job: Job, old: pl.DataFrame) -> pl.Series:
    """Each row of the parent's interactions' period (0 train, 1 valid, 2 test) as the parent's
    sequences hold it (both list each user's items in time order); RefreshError when those
    sequences were not split by the run's global_time cuts or do not match the interactions."""
    p = job.parent
    name = (p.sequences_split or {}).get("name")
    if p.sequences_path is None or name != "global_time":
        raise RefreshError(f"{p.interactions_path.parent}: its sequences were split {name or '(not recorded)'}, "
                           "not by the run's global_time cuts (a refresh made before refresh kept them): "
                           "cannot keep the parent's periods")
    seqs = pl.read_parquet(p.sequences_path, columns=["user_id", "train_items", "valid_items", "test_items"])
    rows = pl.concat([
        seqs.with_row_index("_u").select("_u", "user_id", pl.col(c).alias("item_id"), period=pl.lit(k, pl.Int8))
        .explode("item_id").drop_nulls("item_id")
        for k, c in enumerate(("train_items", "valid_items", "test_items"))
    ]).sort(["_u", "period"], maintain_order=True)
    if not rows.select("user_id", "item_id").equals(old.select("user_id", "item_id")):
        raise RefreshError(f"{p.sequences_path}: its users' items are not {p.interactions_path}'s in order; "
                           "cannot keep the parent's periods")
    return rows["period"]


def _merge(old: pl.DataFrame, new: pl.DataFrame, d, w_q: pq.ParquetWriter, reasons: dict[str, int],
           cuts: tuple[int, int] | None):
    """The parent's interactions + the new ones as sequences (`build_sequences`, no user cap,
    `data.split`; global_time by `cuts`, old rows keeping their `period`); users dropped for
    short histories go to `w_q` and `reasons`."""
    merged = pl.concat([
        old.with_columns(order=pl.int_range(0, old.height, dtype=pl.Int64),
                         source_file=pl.lit(None, pl.Utf8), source_row=pl.lit(None, pl.Int64)),
        new.select("user_id", "item_id", pl.col("ts").cast(pl.Int64), "order", "source_file", "source_row"),
    ], how="diagonal_relaxed")
    res = build_sequences(merged, d.min_seq_len, None, d.split, d.split_ratios, cuts)
    if res.dropped.height:  # only new rows can drop: old users only grow
        dropped = res.dropped.with_columns(
            pl.lit("user_id").alias("detail"),
            pl.struct("user_id", "item_id", "ts").map_elements(
                lambda s: json.dumps({k: None if v is None else str(v) for k, v in s.items()}),
                return_dtype=pl.String).alias("raw"),
        ).select(cat.INTERACTIONS_QUARANTINE_COLUMNS)
        w_q.write_table(dropped.to_arrow().cast(INTER_Q_SCHEMA))
        for r in res.dropped["reason"].to_list():
            reasons[r] = reasons.get(r, 0) + 1
    return res
