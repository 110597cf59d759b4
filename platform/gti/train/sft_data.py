"""SFT examples for generative recommendation: user history of SIDs -> next item's SID.

What it is for: turning sequences.parquet and the SID map into token-id rows for the shared
training loop, in the grounding pairs' row format. `sft.objective: window` makes one row per
target over each user's TRAINING items (`training_windows`); `sequence` cuts them into chunks
whose every item after the first is a target (`training_sequences`); valid and test items are
never a target or in a training history. `multitask_mix` adds LC-Rec's seeded share of
grounding pairs. Evaluation prompts are `gti.eval.slices.eval_windows`.

What it does not know: Ray, devices, models, or where files live. It is pure polars/numpy and
never calls the tokenizer itself (rendering is `gti.lm.templates`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from gti.data.sequences import check_sequences
from gti.common.errors import ConfigError
from gti.common.errors import DataError
from gti.lm.templates import REC_TEMPLATES, ROW_COLUMNS


# --------------------------------------------------------------------------- windows
def training_windows(
    seqs: pl.DataFrame, max_history: int, seed: int = 0, n_templates: int = len(REC_TEMPLATES)
) -> pl.DataFrame:
    """Sliding windows over each user's training items.

    Returns one row per (user, position i >= 1): user_id, pos, history list<str> (at most
    `max_history` items, oldest first), target str, template (int8 index into the templates,
    drawn by a seeded generator over the window order). Row order is the input user order, then
    position, so it is deterministic. Rendering (`gti.lm.templates.RecRenderer`) cuts an
    over-long row's OLDEST history items (never the target or the template).
    """
    check_sequences(seqs)
    if max_history < 1:
        raise ConfigError(f"data.max_history must be >= 1, got {max_history}")
    h = pl.lit(max_history)
    w = (
        seqs.select("user_id", "train_items")
        .with_columns(pos=pl.int_ranges(1, pl.col("train_items").list.len()))
        .explode("pos")
        .drop_nulls("pos")  # users with < 2 training items give no window (explode -> null)
        .with_columns(
            target=pl.col("train_items").list.get(pl.col("pos")),
            history=pl.col("train_items").list.slice(
                pl.max_horizontal(pl.col("pos") - h, pl.lit(0)), pl.min_horizontal(pl.col("pos"), h)
            ),
        )
        .drop("train_items")
    )
    rng = np.random.default_rng([seed, 0x5F7])
    tmpl = rng.integers(0, n_templates, size=w.height, dtype=np.int8)
    return w.with_columns(pos=pl.col("pos").cast(pl.Int32), template=pl.Series(tmpl, dtype=pl.Int8))


def training_sequences(seqs: pl.DataFrame, max_history: int) -> pl.DataFrame:
    """Each user's TRAINING items cut into the chunks of the `sequence` objective.

    A chunk holds at most `max_history + 1` items and starts where the previous one ended
    (stride `max_history`, one shared item): every item after a user's first is a target in
    exactly one chunk (the shared item is the history of the next chunk, not its target), so
    one epoch over the chunks trains each target once, like one epoch over the windows. A
    target at chunk position j sees j items of history (<= max_history), where its window
    would have seen min(i, max_history).
    Returns user_id, chunk (int32, 0-based), items list<str> (2..max_history + 1 items, oldest
    first), in input user order then chunk order. Valid and test items are never included.
    """
    check_sequences(seqs)
    if max_history < 1:
        raise ConfigError(f"data.max_history must be >= 1, got {max_history}")
    n = pl.col("train_items").list.len().cast(pl.Int64)  # u32: n - 1 would wrap for an empty list
    return (
        seqs.select("user_id", "train_items")
        # chunk k starts at k * max_history; the last start leaves at least one target after it
        .with_columns(chunk=pl.int_ranges(0, (n - 1 + max_history - 1) // max_history))
        .explode("chunk")
        .drop_nulls("chunk")  # users with < 2 training items give no chunk
        .with_columns(
            items=pl.col("train_items").list.slice(pl.col("chunk") * max_history, max_history + 1),
            chunk=pl.col("chunk").cast(pl.Int32),
        )
        .drop("train_items")
    )


def sequence_chunk_history(max_history: int, max_len: int, item_tokens: int) -> int:
    """History items per sequence chunk: `max_history`, or fewer when `max_len` cannot hold
    max_history + 1 items of `item_tokens` tokens each (an evaluation prompt, which keeps the
    newest history items that fit with one answer, is then cut to the same number).
    ConfigError when not even two items fit."""
    fit = max_len // item_tokens - 1
    if fit < 1:
        raise ConfigError(f"sft.max_len={max_len} cannot hold two items of {item_tokens} tokens (a sequence row)")
    return min(max_history, fit)


def sft_target_counts(seqs: pl.DataFrame) -> dict[str, int]:
    """How many SFT training windows have each item as their target. -> {item_id: count}.

    The targets of `training_windows` are train_items[1:] of every user, so the count does
    not depend on `max_history` or the template draw. Valid and test items are never counted
    (they are never training targets); an item that is never a target is absent (count 0).
    """
    check_sequences(seqs)
    targets = (
        seqs.select(target=pl.col("train_items").list.slice(1))
        .explode("target")
        .drop_nulls("target")  # users with < 2 training items (explode of [] -> null)
    )
    counts = targets.group_by("target").len()
    return dict(zip(counts["target"].to_list(), counts["len"].to_list()))


# --------------------------------------------------------------------------- SID ids
def check_items_known(frame: pl.DataFrame, sid_ids: dict[str, np.ndarray], what: str) -> None:
    """DataError naming the first item of `frame` (history/target) that has no SID."""
    items = pl.concat([frame["history"].explode(), frame["target"]]).drop_nulls().unique()
    unknown = items.filter(~items.is_in(pl.Series(list(sid_ids), dtype=pl.Utf8))).sort()
    if unknown.len():
        raise DataError(
            f"{what}: item '{unknown[0]}' has no SID in sid_map.parquet ({unknown.len()} such items)"
        )


def val_prompt_table(seqs: pl.DataFrame, renderer, item_ids: list[str], n_users: int, seed: int,
                     max_history: int) -> pl.DataFrame:
    """The validation prompts of a seeded sample of `n_users` users (the SFT and RL stages'
    validation): user_id, prompt list<int32> (`renderer.render_prompts`, the evaluation form),
    target_row int64 (the row of the user's valid item in `item_ids`, the SID-map order)."""
    from gti.eval.slices import eval_windows, sample_users

    val_w = eval_windows(seqs, "valid", max_history)
    users = sample_users(val_w["user_id"].to_list(), n_users, seed)
    prompts = renderer.render_prompts(val_w.filter(pl.col("user_id").is_in(users)).to_dict(as_series=False))
    row_of = {it: i for i, it in enumerate(item_ids)}
    return pl.DataFrame(
        {"user_id": prompts["user_id"], "prompt": prompts["prompt_ids"],
         "target_row": [row_of[t] for t in prompts["target"]]},
        schema={"user_id": pl.Utf8, "prompt": pl.List(pl.Int32), "target_row": pl.Int64},
    )


def rows_frame(rows: dict[str, list]) -> pl.DataFrame:
    """Rendered rows as a polars frame with list<int32> token columns."""
    lists = {c: pl.List(pl.Int32) for c in ("input_ids", "labels", "prompt_ids", "answer_ids")}
    return pl.DataFrame({c: rows[c] for c in ROW_COLUMNS}, schema={"task": pl.Utf8, **lists})


# --------------------------------------------------------------------------- multitask mix
@dataclass
class MixStats:
    n_sequence: int
    n_pairs_available: int
    n_pairs_too_long: int
    n_pairs_used: int
    tasks: dict[str, int]


def multitask_mix(
    seq_rows: pl.DataFrame, pairs: pl.DataFrame | None, weight: float, seed: int, max_len: int
) -> tuple[pl.DataFrame, MixStats]:
    """Sequence rows plus `round(weight * len(seq_rows))` grounding-pair rows, shuffled.

    Pairs come from pairs.parquet (split == "train"); pairs longer than `max_len` cannot be
    trained on and are counted in `n_pairs_too_long` (never dropped silently). With `pairs`
    None or weight 0 this only shuffles. Deterministic for a given seed.
    """
    rng = np.random.default_rng([seed, 0x3A7])
    parts = [seq_rows.select(ROW_COLUMNS)]
    n_avail = n_long = n_used = 0
    if pairs is not None and weight > 0:
        for col in ROW_COLUMNS:
            if col not in pairs.columns:
                raise DataError(f"pairs.parquet: missing column '{col}'")
        train = pairs.filter(pl.col("split") == "train") if "split" in pairs.columns else pairs
        n_avail = train.height
        fit = train.filter(pl.col("input_ids").list.len() <= max_len)
        n_long = n_avail - fit.height
        want = int(round(weight * seq_rows.height))
        if want and fit.height == 0:
            raise DataError(
                f"pairs.parquet: no train pair fits sft.max_len={max_len} ({n_long} too long)"
            )
        if want:
            reps = -(-want // fit.height)
            idx = np.concatenate([rng.permutation(fit.height) for _ in range(reps)])[:want]
            parts.append(fit.select(ROW_COLUMNS)[idx])
            n_used = want
    mixed = pl.concat([p.cast(parts[0].schema) for p in parts])
    mixed = mixed[rng.permutation(mixed.height)]
    tasks = dict(mixed.group_by("task").len().sort("task").iter_rows())
    return mixed, MixStats(seq_rows.height, n_avail, n_long, n_used, tasks)
