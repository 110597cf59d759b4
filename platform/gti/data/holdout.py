"""Held-out "new" items for refresh experiments (`bench/refresh/refresh.py`, tests of `gti refresh`).

What it is for: `holdout_new_items(items, interactions, n_new, seed)` picks `n_new` items that
are some user's last interaction (so test users with a new target exist), and splits the data
into the catalog a run trains on (every other item, and the interactions with them) and the
"new" slice a refresh adds later (those items, and every interaction with them). Merging the
new interactions back into the base run's (what `gti refresh --interactions` does) gives each
user their full history again, so the users whose last interaction is a new item are the test
users whose target is new (`new_target_users`).

What it does not know: files, validation, Ray. Pure polars; row order of the inputs is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from gti.common.errors import DataError


@dataclass
class Holdout:
    base_items: pl.DataFrame
    base_interactions: pl.DataFrame
    new_items: pl.DataFrame
    new_interactions: pl.DataFrame
    new_ids: list[str]


def _last_items(interactions: pl.DataFrame, user: str, item: str, ts: str | None) -> pl.DataFrame:
    df = interactions.with_row_index("_order")
    keys = [ts, "_order"] if ts else ["_order"]
    return df.sort(keys).group_by(user, maintain_order=True).agg(pl.col(item).last().alias("_last"))


def holdout_new_items(items: pl.DataFrame, interactions: pl.DataFrame, n_new: int, seed: int = 0, *,
                      item_col: str = "item_id", user_col: str = "user_id", ts_col: str | None = "ts",
                      max_interactions: int | None = None) -> Holdout:
    """Split off `n_new` items that end some user's history (seeded choice among them).

    max_interactions: only items with at most this many interactions are candidates (a new
    item is usually a rare one; None: no limit)."""
    if n_new < 1:
        raise DataError(f"holdout: n_new must be >= 1, got {n_new}")
    ts = ts_col if ts_col and ts_col in interactions.columns else None
    ids = items[item_col].cast(pl.Utf8)
    inter = interactions.with_columns(pl.col(item_col).cast(pl.Utf8))
    last = _last_items(inter, user_col, item_col, ts)
    cand = last.group_by("_last").len().rename({"_last": item_col})
    counts = inter.group_by(item_col).len().rename({"len": "_n"})
    cand = cand.join(counts, on=item_col).filter(pl.col(item_col).is_in(ids.implode()))
    if max_interactions is not None:
        cand = cand.filter(pl.col("_n") <= max_interactions)
    pool = sorted(cand[item_col].to_list())
    if len(pool) < n_new:
        raise DataError(f"holdout: only {len(pool)} items end a user's history (asked for {n_new} new items)")
    rng = np.random.default_rng([seed, 0x40D])
    new_ids = sorted(pool[i] for i in rng.choice(len(pool), size=n_new, replace=False))
    is_new_item = items[item_col].cast(pl.Utf8).is_in(new_ids)
    is_new_inter = inter[item_col].is_in(new_ids)
    return Holdout(
        base_items=items.filter(~is_new_item), base_interactions=interactions.filter(~is_new_inter),
        new_items=items.filter(is_new_item), new_interactions=interactions.filter(is_new_inter),
        new_ids=new_ids,
    )


def new_target_users(sequences: pl.DataFrame, new_ids: list[str], split: str = "test") -> pl.DataFrame:
    """Rows of `sequences` (ingest's layout) whose `split` target is one of `new_ids`."""
    col = "test_item" if split == "test" else "valid_item"
    return sequences.filter(pl.col(col).is_in(list(new_ids)))
