"""Who is scored: the evaluation prompts of a split, the seeded user sample and the cold slice.

What it is for: the evaluate stage's user slicing, pure polars, for every caller that must score
the same users the same way (the stage, SFT's validation users, bench scripts): `eval_windows`
(one prompt per item of the split's period; docs/data.md, Splits), `sample_users` /
`eval_users` / `split_frame` (a deterministic user sample and its prompts), and the cold-item
slice (`cold_users`, `n_cold_items`) that `slice_metrics` scores like any other slice.

What it does not know: models, decoding, Ray, files, how the counts were made.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import polars as pl

from gti.data.sequences import check_sequences, split_lists
from gti.common.errors import ConfigError, DataError
from gti.eval.reference import DEFAULT_BASELINES, baseline_rank_rows, baseline_rows, metric_block


def eval_windows(seqs: pl.DataFrame, split: str, max_history: int) -> pl.DataFrame:
    """Evaluation prompts for one split: user_id, split, history list<str>, target str, pos
    int32 (the target's index in the user's train + valid + test items), in user order, then
    time. Every item of the split's period is a target; its history is the last `max_history`
    items before it (leave-one-out: valid = train items -> valid item, test = train items +
    valid item -> test item; global_time: one per valid/test interaction). The history is
    everything the user did before the target: train items, then the earlier items of the
    periods before, then the earlier items of its own period. Targets with nothing before them
    are left out. SASRec reads the full prefix through `pos`.
    """
    check_sequences(seqs)
    if split not in ("valid", "test"):
        raise ConfigError(f"eval split must be 'valid' or 'test', got '{split}'")
    s = split_lists(seqs)
    start = pl.col("train_items").list.len().cast(pl.Int64)
    if split == "test":
        start = start + pl.col("valid_items").list.len().cast(pl.Int64)
    pos, h = pl.col("pos"), pl.lit(max_history)
    return (
        s.select("user_id", full=pl.concat_list("train_items", "valid_items", "test_items"), start=start,
                 target=pl.col(f"{split}_items"))
        .with_columns(j=pl.int_ranges(0, pl.col("target").list.len()))
        .explode(["target", "j"])
        .drop_nulls("j")  # a user without an item in this period (explode of [] -> null)
        .with_columns(pos=pl.col("start") + pl.col("j"))
        .filter(pos > 0)
        .select("user_id", split=pl.lit(split),
                history=pl.col("full").list.slice(pl.max_horizontal(pos - h, pl.lit(0)), pl.min_horizontal(pos, h)),
                target="target", pos=pos.cast(pl.Int32))
    )


def sample_users(user_ids: Sequence[str], n: int | None, seed: int) -> list[str]:
    """A deterministic sample of `n` users (all, in input order, when n is None or too big)."""
    users = list(user_ids)
    if n is None or n >= len(users):
        return users
    idx = np.sort(np.random.default_rng([seed, 0xE7A1]).choice(len(users), size=n, replace=False))
    return [users[i] for i in idx]


def eval_users(seqs: pl.DataFrame, max_users: int | None, seed: int) -> list[str]:
    """The deterministic user sample shared by every split (all users when max_users is None);
    every row of a sampled user is scored."""
    return sample_users(seqs["user_id"].to_list(), max_users, seed)


def split_frame(seqs: pl.DataFrame, split: str, users: list[str], max_history: int) -> pl.DataFrame:
    """One split's prompts (`eval_windows`) of the sampled `users`, in sequences order."""
    w = eval_windows(seqs, split, max_history)
    return w.filter(pl.col("user_id").is_in(users))


def cold_users(frame: pl.DataFrame, counts: dict[str, int], max_targets: int) -> list[bool]:
    """Per row of a split frame: is its target cold, i.e. the target of at most `max_targets`
    SFT training windows (`counts` from `sft_data.sft_target_counts`, on training items only,
    never valid/test; absent = 0)?"""
    return [counts.get(t, 0) <= max_targets for t in frame["target"].to_list()]


def n_cold_items(catalog: list[str], counts: dict[str, int], max_targets: int) -> int:
    """Catalog items that are cold under the same definition as `cold_users`."""
    return sum(counts.get(item, 0) <= max_targets for item in catalog)


def slice_metrics(part: pl.DataFrame, frame: pl.DataFrame, seqs: pl.DataFrame, split: str,
                  ks: list[int], n_boot: int, seed: int, catalog: list[str],
                  exact_rank: bool, names: tuple[str, ...] | list[str] = DEFAULT_BASELINES) -> dict[str, Any]:
    """Every metric of one split on a slice of its users: the model's metric@k table, the
    reference rows (`gti.eval.reference`) and, with exact ranks, the rank metrics
    (`gti.eval.rank.rank_metrics`).

    part: the slice's decoded rows (items, target, exact_rank); frame: the same users' split
    frame (history, target; sasrec columns when `names` has sasrec) for the baselines.
    -> {"n_users", "n_rows", "model": metric@k table, "baselines": {name: table}, "ranks": rank_metrics
    or {}} (+ "baseline_ranks" {"sasrec": rank_metrics} when the frame has SASRec's exact
    ranks); empty blocks for 0 users.
    """
    if part.height != frame.height:
        raise DataError(f"evaluate: slice of {part.height} decoded rows but {frame.height} prompts")
    if part.height == 0:
        return {"n_users": 0, "n_rows": 0, "model": {}, "baselines": {b: {} for b in names}, "ranks": {}}
    users = part["user_id"].to_list()  # the CIs resample users, with all their rows
    model, _ = metric_block(part["items"].to_list(), part["target"].to_list(), ks, n_boot, seed, users)
    ranks = {}
    if exact_rank:
        from gti.eval.rank import rank_metrics

        ranks = rank_metrics(part["exact_rank"].to_numpy(), len(catalog), n_boot, seed, groups=users)
    out = {
        "n_users": len(set(users)),
        "n_rows": part.height,
        "model": model,
        "baselines": baseline_rows(seqs, split, frame, ks, n_boot, seed, catalog, names),
        "ranks": ranks,
    }
    if exact_rank and (b_ranks := baseline_rank_rows(frame, len(catalog), n_boot, seed)):
        out["baseline_ranks"] = b_ranks
    return out
