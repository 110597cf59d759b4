"""Dense subsets of an interaction log (`gti data dense`): the most interacted items and the
users most active on them, for training budgets too small for the whole catalog.

What it is for: `dense_subset(items, interactions, n_items, min_user_len)` keeps "the top-N items
and their active users"; `cli_main` writes it as files ready for `data.items.path` /
`data.interactions.path`. In the pipeline (`data.dense` in the run config) the ingest stage calls
`cut_interactions` and `quarantine_items` instead (the same `dense_subset`, so the subset equals
`gti data dense` + ingest on clean data): every row left out goes to the quarantine files with
reason `outside_dense`, so ingest's accounting (rows in = ok + quarantined) still holds, and the
parameters are in the ingest fingerprint.

What it does not know: validation or the rest of ingest, Ray, or models. Pure polars/pyarrow.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gti.data import catalog as cat
from gti.common.errors import DataError


def dense_subset(items: pl.DataFrame, interactions: pl.DataFrame, n_items: int, min_user_len: int,
                 item_col: str = "item_id", user_col: str = "user_id") -> tuple[pl.DataFrame, pl.DataFrame]:
    """(items, interactions) restricted to the top `n_items` items by interaction count and the
    users with >= `min_user_len` interactions among them. Row order of both inputs is kept.

    The top items go by interaction count (ties by catalog order); every interaction with another
    item is dropped, then users left with fewer than `min_user_len`, repeated until both hold
    (items that lost interactions with the dropped users keep their place: the item set is fixed
    after the first cut)."""
    for name, df, cols in (("items", items, [item_col]), ("interactions", interactions, [user_col, item_col])):
        missing = [c for c in cols if c not in df.columns]
        if missing:
            raise DataError(f"{name}: missing column(s) {missing}")
    if n_items < 1 or min_user_len < 1:
        raise DataError("gti data dense: --items and --min-user-len must be >= 1")
    order = items.select(pl.col(item_col).cast(pl.Utf8)).with_row_index("_pos")
    counts = (
        interactions.group_by(pl.col(item_col).cast(pl.Utf8)).len()
        .join(order, on=item_col, how="inner")
        .sort(["len", "_pos"], descending=[True, False])
    )
    keep_items = counts.head(n_items)[item_col]
    inter = interactions.filter(pl.col(item_col).cast(pl.Utf8).is_in(keep_items))
    while True:
        lens = inter.group_by(user_col).len()
        users = lens.filter(pl.col("len") >= min_user_len)[user_col]
        if users.len() == lens.height:
            break
        inter = inter.filter(pl.col(user_col).is_in(users))
    kept_items = inter[item_col].cast(pl.Utf8).unique()
    return items.filter(pl.col(item_col).cast(pl.Utf8).is_in(kept_items)), inter


@dataclass
class DenseCut:
    """What `cut_interactions` keeps and leaves out."""

    interactions: pl.DataFrame  # kept rows, input order
    dropped: pl.DataFrame  # the other rows, input order, + reason (outside_dense) and detail
    items: list[str]  # ids of the subset's items, catalog order
    facts: dict[str, Any]  # parameters and counts before / after (the ingest facts' "dense")


def cut_interactions(item_ids: list[str], inter: pl.DataFrame, top_items: int, min_user_len: int) -> DenseCut:
    """`dense_subset` on validated interactions (user_id, item_id, any other columns) given the
    catalog's ids in catalog order. A dropped row's detail is `item_id` when its item is not in
    the subset, else `user_id` (its user has too few interactions on the subset's items)."""
    rows = inter.with_row_index("_row")
    sub_items, kept = dense_subset(pl.DataFrame({"item_id": item_ids}), rows, top_items, min_user_len)
    keep_ids = sub_items["item_id"]
    dropped = rows.filter(~pl.col("_row").is_in(kept["_row"])).with_columns(
        pl.lit(cat.OUTSIDE_DENSE).alias("reason"),
        pl.when(pl.col("item_id").is_in(keep_ids)).then(pl.lit("user_id"))
        .otherwise(pl.lit("item_id")).alias("detail"),
    )
    facts = {"top_items": top_items, "min_user_len": min_user_len,
             "items_before": len(item_ids), "items_after": sub_items.height,
             "users_before": int(inter["user_id"].n_unique()), "users_after": int(kept["user_id"].n_unique()),
             "interactions_before": inter.height, "interactions_after": kept.height}
    return DenseCut(kept.drop("_row"), dropped.drop("_row"), keep_ids.to_list(), facts)


def quarantine_items(out: Path, keep: list[str], row_group: int = 65_536) -> int:
    """Move the rows of `out`/items.parquet whose id is not in `keep` to the end of
    `out`/items_quarantine.parquet (reason outside_dense, detail item_id, raw: the item's text
    fields as JSON; source_file / source_row empty, as items.parquet does not carry them).
    Both files are rewritten whole: a dense subset is for catalogs a training budget can cover.
    Returns the number of rows moved."""
    items = pq.read_table(out / "items.parquet")
    mask = pc.is_in(items.column("item_id"), value_set=pa.array(keep, pa.string()))
    moved = items.filter(pc.invert(mask))
    n = moved.num_rows
    if n == 0:
        return 0
    quarantine = pq.read_table(out / "items_quarantine.parquet")
    text = moved.select(["item_id", "title", "description", "category", "attributes_text"]).to_pylist()
    rows = pa.table({
        "source_file": pa.nulls(n, pa.string()), "source_row": pa.nulls(n, pa.int64()),
        "item_id": moved.column("item_id"), "reason": pa.array([cat.OUTSIDE_DENSE] * n, pa.string()),
        "detail": pa.array(["item_id"] * n, pa.string()), "raw": pa.array([cat.raw_json(r) for r in text]),
    })
    pq.write_table(items.filter(mask), out / "items.parquet", row_group_size=row_group)
    pq.write_table(pa.concat_tables([quarantine, rows.select(quarantine.schema.names).cast(quarantine.schema)]),
                   out / "items_quarantine.parquet")
    return n


def cli_main(args) -> int:
    """`gti data dense --items-path P --interactions-path Q --items N --min-user-len M --out DIR`
    (paths may be `bundled:<name>`): `items.parquet` and `interactions.parquet` (the input's
    columns) and `dense.json` with the parameters and counts."""
    from gti.data import bundled

    items = pl.read_parquet(bundled.resolve(args.items_path, "items")) if str(args.items_path).endswith(
        ".parquet") or bundled.is_bundled(args.items_path) else pl.read_csv(args.items_path)
    inter_path = args.interactions_path or args.items_path
    inter = pl.read_parquet(bundled.resolve(inter_path, "interactions")) if str(inter_path).endswith(
        ".parquet") or bundled.is_bundled(inter_path) else pl.read_csv(inter_path)
    sub_items, sub_inter = dense_subset(items, inter, args.items, args.min_user_len)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sub_items.write_parquet(out / "items.parquet")
    sub_inter.write_parquet(out / "interactions.parquet")
    summary = {"source_items": args.items_path, "source_interactions": inter_path, "top_items": args.items,
               "min_user_len": args.min_user_len, "items": sub_items.height,
               "users": int(sub_inter["user_id"].n_unique()), "interactions": sub_inter.height}
    (out / "dense.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {summary['items']:,} items, {summary['users']:,} users, {summary['interactions']:,} "
          f"interactions to {out}")
    print(f"use: data.items.path={out / 'items.parquet'} data.interactions.path={out / 'interactions.parquet'}")
    return 0
