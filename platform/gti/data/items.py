"""The items pass of ingest: validated item batches in, items.parquet and its quarantine out.

What it is for: `ingest_items(ctx, out, stream, source)` is how the ingest stage (with Ray
Data's stream or in process) and `gti refresh` (new items, in process) keep a catalog:
items.parquet (`ITEMS_OUT_SCHEMA`) and items_quarantine.parquet (`ITEMS_Q_SCHEMA`, every row
with its `reason`), counted in an `ItemCounts` (the ingest facts' items_* numbers) with the kept
ids (`IdSet`).

What it does not know: interactions, sequences, Ray (the stream is the caller's), the stage
contract (`ctx` is anything with `.cfg`, a RunConfig, and `.log(msg)`).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gti.data import catalog as cat
from gti.data.batches import Source, fill_item_raw, iterate, raise_file_error
from gti.data.idset import IdSet
from gti.data.schemas import ITEMS_OUT_SCHEMA, ITEMS_Q_SCHEMA
from gti.common.errors import DataError
from gti.common.redact import redact_text

ROW_GROUP = 65_536  # rows per row group of the ingest outputs


class ItemCounts:
    """What the items pass counted (the ingest facts' items_* numbers) and the kept ids."""

    def __init__(self) -> None:
        self.rows_in = self.ok = self.quarantined = self.truncated = self.pseudo = 0
        self.reasons: Counter[str] = Counter()
        self.seen = IdSet()  # kept ids: duplicates and the unknown-item check (compact: gti.data.idset)
        self.limit_reached = False


def ingest_items(ctx, out: Path, stream, source: Source | None = None) -> tuple[ItemCounts, IdSet]:
    """The items pass: `stream` (`local_stream`, `ray_stream`) over `source` (default: planned
    from `ctx.cfg.data`) writes `out`/items.parquet and items_quarantine.parquet (duplicates:
    first kept, `duplicate_id` for the others; `data.max_items` ends the catalog at its N-th kept
    item: rows after it are not read and not counted). A file found unreadable inside a pass
    reruns it without that file (`Source.passes`, `data.on_unreadable_file: skip`). Returns
    (counts, the kept ids); DataError when no item is valid. `ctx`: anything with `.cfg` (a
    RunConfig) and `.log(msg)`."""
    d = ctx.cfg.data
    source = source or Source(d, "items", ctx.log)
    missing = source.missing_columns
    if missing:
        ctx.log(f"items: optional columns not in the input, treated as empty: {missing}")
    ctx.log(f"items: {len(source.files)} file(s), {len(source.tasks)} read task(s) from {redact_text(d.items.path)}")
    st = source.passes(lambda tasks: _items_pass(ctx, out, stream, tasks, source.skip))
    st.missing_columns = missing  # type: ignore[attr-defined]
    if st.ok == 0:
        detail = ", ".join(f"{k}: {v}" for k, v in st.reasons.most_common()) or "no rows"
        raise DataError(f"data.items.path {redact_text(d.items.path)}: no valid items "
                        f"({st.rows_in} rows read; {detail})")
    return st, st.seen


def _items_pass(ctx, out: Path, stream, tasks, skip: bool) -> ItemCounts:
    d = ctx.cfg.data
    st = ItemCounts()
    n_kept = 0
    w_ok = pq.ParquetWriter(out / "items.parquet", ITEMS_OUT_SCHEMA)
    w_q = pq.ParquetWriter(out / "items_quarantine.parquet", ITEMS_Q_SCHEMA)
    t0, last_log = time.time(), time.time()
    try:
        for batch in iterate(stream, tasks, "items", d.items.columns, d.max_text_chars, d.parallelism):
            raise_file_error(batch, skip)
            valid = pc.is_null(batch.column("reason")).to_numpy(zero_copy_only=False)
            new = st.seen.first_new(batch.column("item_id"), valid)
            n_used = batch.num_rows
            if d.max_items is not None:
                kept_at = np.nonzero(new)[0]
                room = d.max_items - n_kept
                if kept_at.size >= room:  # the N-th kept item ends the catalog
                    st.limit_reached = True
                    n_used = int(kept_at[room - 1]) + 1
                    new[n_used:] = False
            keep = new.tolist()
            n_kept += int(new.sum())
            reasons = batch.column("reason").to_pylist()
            for i in np.nonzero(valid & ~new)[0]:
                reasons[i] = cat.DUPLICATE_ID
            if n_used < batch.num_rows:
                batch, keep, reasons = batch.slice(0, n_used), keep[:n_used], reasons[:n_used]
            batch = batch.set_column(batch.schema.get_field_index("reason"), "reason",
                                     pa.array(reasons, pa.string()))
            dup = pa.array([r == cat.DUPLICATE_ID for r in reasons])
            batch = batch.set_column(batch.schema.get_field_index("detail"), "detail",
                                     pc.if_else(dup, pa.scalar("id", pa.string()), batch.column("detail")))
            mask = pa.array(keep, pa.bool_())
            ok = batch.filter(mask)
            bad = batch.filter(pc.invert(mask))
            if bad.num_rows:
                bad = fill_item_raw(bad)
                w_q.write_table(bad.select(cat.QUARANTINE_COLUMNS).cast(ITEMS_Q_SCHEMA))
            if ok.num_rows:
                st.seen.add(ok.column("item_id"))
                w_ok.write_table(ok.select(cat.ITEMS_OUT_COLUMNS).cast(ITEMS_OUT_SCHEMA), row_group_size=ROW_GROUP)
            st.rows_in += batch.num_rows
            st.ok += ok.num_rows
            st.quarantined += bad.num_rows
            st.truncated += pc.sum(ok.column("truncated")).as_py() or 0
            st.pseudo += pc.sum(ok.column("text_is_pseudo")).as_py() or 0
            st.reasons.update(r for r in reasons if r)
            if time.time() - last_log > 10:
                last_log = time.time()
                ctx.log(f"items: {st.rows_in:,} rows read, {st.ok:,} ok ({st.rows_in / (last_log - t0):,.0f} rows/s)")
            if st.limit_reached:
                break
    finally:
        w_ok.close()
        w_q.close()
    return st
