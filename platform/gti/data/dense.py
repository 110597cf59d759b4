"""Dense subsets of an interaction log (`gti data dense`): the most interacted items and the
users most active on them, for training budgets too small for the whole catalog.

What it is for: `dense_subset(items, interactions, n_items, min_user_len)` keeps the `n_items`
items with the most interactions (ties by catalog order), drops every interaction with another
item, keeps users left with at least `min_user_len` interactions, and repeats until both hold
(items that lost interactions with the dropped users keep their place: the item set is fixed
after the first cut, so the subset is "the top-N items and their active users"). Writes
`items.parquet` and `interactions.parquet` (same columns as the input) and `dense.json` with
the parameters and counts, ready for `data.items.path` / `data.interactions.path`.

What it does not know: validation or the rest of ingest (the output goes through ingest like
any catalog), Ray, or models. Pure polars.
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from gti.errors import DataError


def dense_subset(items: pl.DataFrame, interactions: pl.DataFrame, n_items: int, min_user_len: int,
                 item_col: str = "item_id", user_col: str = "user_id") -> tuple[pl.DataFrame, pl.DataFrame]:
    """(items, interactions) restricted to the top `n_items` items by interaction count and the
    users with >= `min_user_len` interactions among them. Row order of both inputs is kept."""
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


def cli_main(args) -> int:
    """`gti data dense --items-path P --interactions-path Q --items N --min-user-len M --out DIR`
    (paths may be `bundled:<name>`)."""
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
