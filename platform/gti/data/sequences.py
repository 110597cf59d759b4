"""Per-user chronological sequences and the leave-one-out split (polars, one process).

What it is for: from validated interactions (user_id, item_id, ts, order = global file row),
build each user's sequence sorted by (ts, file order) — ties keep file order, so the result is
deterministic — and split it leave-one-out: the last item is `test_item`, the second-last
`valid_item`, everything before is `train_items`.

Decisions:
- `train_items` keeps the whole history; `data.max_history` is applied later, when SFT and
  evaluation cut windows, so one ingest output serves any history length.
- A user needs at least max(3, data.min_seq_len) interactions (one to train on, plus valid and
  test); shorter users are returned as dropped rows with reason `short_sequence`, so the ingest
  stage can quarantine them and keep rows_in == ok + quarantined.
- `data.max_users` keeps the first N eligible users by first appearance in file order; the rest
  are dropped with reason `outside_max_users`.
- Repeat interactions are kept. So the same item id can appear in `train_items` and as the
  valid/test item of the same user; what the split guarantees is positional: the held-out
  interactions are the user's last two, never inside `train_items`.

`check_sequences(seqs, source)` is the check every reader of sequences.parquet runs first (SFT
windows, evaluation prompts): each column of `gti.data.schemas.SEQ_SCHEMA` is there.

What it does not know: files, Ray, or item validity (unknown items are removed before).
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from gti.data.catalog import OUTSIDE_MAX_USERS, SHORT_SEQUENCE
from gti.data.schemas import SEQ_SCHEMA
from gti.errors import DataError

MIN_LEAVE_ONE_OUT = 3
_SEQ_COLUMNS = tuple(SEQ_SCHEMA.names)  # user_id, train_items, valid_item, test_item


def check_sequences(seqs: pl.DataFrame, source: str = "sequences.parquet") -> None:
    """Raise DataError naming the first missing column of an ingest sequences table."""
    missing = [c for c in _SEQ_COLUMNS if c not in seqs.columns]
    if missing:
        raise DataError(f"{source}: missing column(s) {missing}; expected {list(_SEQ_COLUMNS)}")


@dataclass
class SequenceResult:
    interactions: pl.DataFrame  # kept rows: user_id, item_id, ts (users in first-seen order, then chronological)
    sequences: pl.DataFrame  # user_id, train_items list[str], valid_item, test_item
    dropped: pl.DataFrame  # the input rows that were not kept, plus a `reason` column
    min_seq_len: int  # the effective minimum that was applied


def build_sequences(df: pl.DataFrame, min_seq_len: int, max_users: int | None = None) -> SequenceResult:
    """df: user_id str, item_id str, ts int64, order int64 (global file row), any extra columns
    (carried into `dropped`). Returns kept interactions, sequences and dropped rows."""
    need = max(MIN_LEAVE_ONE_OUT, min_seq_len)
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
    return SequenceResult(
        interactions=kept.select("user_id", "item_id", pl.col("ts").cast(pl.Int64)),
        sequences=sequences,
        dropped=dropped,
        min_seq_len=need,
    )
