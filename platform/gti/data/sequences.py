"""Per-user chronological sequences and their split into periods (polars, one process).

What it is for: from validated interactions, each user's sequence sorted by (ts, file order),
so ties are deterministic, split by `data.split` (leave-one-out, or global time by ratios or
by given cuts: docs/data.md, "Splits"). Both layouts carry `valid_items` and `test_items`, so
readers never ask which split made them, and a user's periods follow each other, so a training
item is never later than a held-out one. Users too short or past `data.max_users` come back as
dropped rows with their reason, for ingest's quarantine. `check_sequences` is the check every
reader of sequences.parquet runs first.

What it does not know: files, Ray, or item validity (unknown items are removed before).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import polars as pl

from gti.data.catalog import OUTSIDE_MAX_USERS, SHORT_SEQUENCE
from gti.data.schemas import SEQ_SCHEMA
from gti.common.errors import DataError

MIN_LEAVE_ONE_OUT = 3
MIN_GLOBAL_TIME = 2  # one item of history and one target
SPLITS = ("leave_one_out", "global_time")
# What every reader needs; valid_items / test_items are added by `split_lists` when absent.
_SEQ_COLUMNS = ("user_id", "train_items", "valid_item", "test_item")
PERIODS = ("train", "valid", "test")


def check_sequences(seqs: pl.DataFrame, source: str = "sequences.parquet") -> None:
    """Raise DataError naming the first missing column of an ingest sequences table."""
    missing = [c for c in _SEQ_COLUMNS if c not in seqs.columns]
    if missing:
        raise DataError(f"{source}: missing column(s) {missing}; expected {list(_SEQ_COLUMNS)}")


def split_lists(seqs: pl.DataFrame) -> pl.DataFrame:
    """`seqs` with the period lists valid_items / test_items: as they are, or (a table written
    before they existed, always leave-one-out) the one valid / test item as a list."""
    add = [pl.concat_list(pl.col(one)).alias(many) for one, many in (("valid_item", "valid_items"),
                                                                    ("test_item", "test_items"))
           if many not in seqs.columns]
    return seqs.with_columns(add) if add else seqs


@dataclass
class SequenceResult:
    interactions: pl.DataFrame  # kept rows: user_id, item_id, ts (users in first-seen order, then chronological)
    sequences: pl.DataFrame  # SEQ_SCHEMA: user_id, train_items, valid_item, test_item, valid_items, test_items
    dropped: pl.DataFrame  # the input rows that were not kept, plus a `reason` column
    min_seq_len: int  # the effective minimum that was applied
    split: dict = field(default_factory=dict)  # the split's facts: name, interactions per period, cuts


def build_sequences(df: pl.DataFrame, min_seq_len: int, max_users: int | None = None,
                    split: str = "leave_one_out", ratios: Sequence[float] = (8, 1, 1),
                    cuts: tuple[int, int] | None = None) -> SequenceResult:
    """df: user_id str, item_id str, ts int64, order int64 (global file row), any extra columns
    (carried into `dropped`). Returns kept interactions, sequences and dropped rows.

    split: "leave_one_out" or "global_time" (by `ratios` of all kept interactions, or, given
    `cuts` = (first valid ts, first test ts), by timestamp). `train_items` keeps the whole
    history (`data.max_history` cuts windows later, so one ingest serves any length); repeat
    interactions are kept, so what the split guarantees is positional. A user needs
    max(3, min_seq_len) interactions for leave_one_out, max(2, min_seq_len) for global_time
    (else `short_sequence`); `max_users` keeps the first N eligible users by first appearance
    (the rest `outside_max_users`). With `cuts`, a row whose optional `period` column (0/1/2)
    is set keeps that period (a refresh's old rows: ties on a cut stay where ingest put them).
    The facts' `cut_ts` are the cuts, or the first valid and test timestamps of a position cut."""
    if split not in SPLITS:
        raise DataError(f"data.split must be one of {list(SPLITS)}, got '{split}'")
    need = max(MIN_LEAVE_ONE_OUT if split == "leave_one_out" else MIN_GLOBAL_TIME, min_seq_len)
    users = (
        df.group_by("user_id")
        .agg(pl.col("order").min().alias("_first"), pl.len().alias("_n"))
        .sort("_first")
        .with_columns((pl.col("_n") >= need).alias("_eligible"))
    )
    users = users.with_columns(
        pl.when(pl.col("_eligible")).then(pl.col("_eligible").cast(pl.Int64).cum_sum()).otherwise(None).alias("_rank")
    )
    users = users.with_columns(
        pl.when(~pl.col("_eligible"))
        .then(pl.lit(SHORT_SEQUENCE))
        .when(pl.lit(max_users is not None) & (pl.col("_rank") > (max_users or 0)))
        .then(pl.lit(OUTSIDE_MAX_USERS))
        .otherwise(None)
        .alias("reason")
    )
    tagged = df.join(users.select("user_id", "_first", "reason"), on="user_id", how="left")
    dropped = tagged.filter(pl.col("reason").is_not_null()).sort("order").drop("_first")
    kept = (
        tagged.filter(pl.col("reason").is_null())
        .sort(["_first", "ts", "order"])  # users in first-seen order; ties by file order
    )
    if split == "leave_one_out":
        sequences = (
            kept.group_by("_first", maintain_order=True)
            .agg(pl.col("user_id").first(), pl.col("item_id").alias("_items"))
            .select(
                "user_id",
                pl.col("_items").list.slice(0, pl.col("_items").list.len() - 2).alias("train_items"),
                pl.col("_items").list.get(-2).alias("valid_item"),
                pl.col("_items").list.get(-1).alias("test_item"),
            )
        )
        sequences, facts = split_lists(sequences), {"name": split}
    else:
        sequences, facts = _global_time(kept, ratios, cuts)
    return SequenceResult(
        interactions=kept.select("user_id", "item_id", pl.col("ts").cast(pl.Int64)),
        sequences=sequences.select(SEQ_SCHEMA.names),
        dropped=dropped,
        min_seq_len=need,
        split=facts,
    )


def _global_time(kept: pl.DataFrame, ratios: Sequence[float], cuts: tuple[int, int] | None
                 ) -> tuple[pl.DataFrame, dict]:
    """Periods of the kept interactions (sorted by user, then ts and file order) -> sequences
    with the period lists, and the facts (interactions per period, the cuts)."""
    n = kept.height
    if cuts is None:
        total = float(sum(ratios))
        c1, c2 = int(n * (ratios[0] / total)), int(n * ((ratios[0] + ratios[1]) / total))
        # The position in the global (ts, file order) sort decides, so equal timestamps on a
        # boundary are split by file order: deterministic, and never a later row in training.
        order_rank = kept.select("ts", "order").with_row_index("_i").sort(["ts", "order"]).with_row_index("_g")
        period = (pl.when(pl.col("_g") < c1).then(0).when(pl.col("_g") < c2).then(1).otherwise(2))
        periods = order_rank.select("_i", period.cast(pl.Int8).alias("_p")).sort("_i")["_p"]
        first_ts = order_rank["ts"]  # what a refresh cuts its new interactions by
        by = {"by": "position", "ratios": [float(r) for r in ratios], "cut_positions": [c1, c2],
              "cut_ts": [int(first_ts[c]) if c < n else None for c in (c1, c2)]}
    else:
        by_ts = pl.when(pl.col("ts") < cuts[0]).then(0).when(pl.col("ts") < cuts[1]).then(1).otherwise(2)
        if "period" in kept.columns:
            by_ts = pl.coalesce(pl.col("period"), by_ts)
        periods = kept.select(by_ts.cast(pl.Int8).alias("_p"))["_p"]
        by = {"by": "timestamp", "cut_ts": [int(cuts[0]), int(cuts[1])]}
    counts = [int((periods == p).sum()) for p in range(3)]
    empty = [PERIODS[p] for p in range(3) if counts[p] == 0]
    if empty:
        raise DataError(f"data.split=global_time: the {' and '.join(empty)} period(s) of the {n:,} kept "
                        f"interactions are empty ({dict(zip(PERIODS, counts))}); add data or change "
                        f"data.split_ratios")
    p = pl.col("_p")
    sequences = (
        kept.with_columns(periods.alias("_p"))
        .group_by("_first", maintain_order=True)
        .agg(pl.col("user_id").first(),
             pl.col("item_id").filter(p == 0).alias("train_items"),
             pl.col("item_id").filter(p == 1).alias("valid_items"),
             pl.col("item_id").filter(p == 2).alias("test_items"))
        .with_columns(pl.lit(None, pl.Utf8).alias("valid_item"), pl.lit(None, pl.Utf8).alias("test_item"))
    )
    return sequences, {"name": "global_time", **by, "interactions": dict(zip(PERIODS, counts))}
