"""Reference rows of the evaluation table: MostPop, Markov and SASRec on the model's users.

What it is for: the evaluate stage's baseline rows (`eval.baselines`), computed with the same
metric code (`gti.eval.metrics`) on the same users and split frames as the model, so the rows
compare like with like: mostpop / markov (`gti.eval.baselines`) fitted per split on its training
data (`baseline_rows`), sasrec (`gti.eval.sasrec`) trained once per evaluation on the training
items only (`fit_reference_models`), and the model minus each reference row with a paired
bootstrap CI over users (`paired_differences`). Means are over rows; every CI resamples users.

What it does not know: Ray, files, the LM, decoding. Pure polars/numpy (+ torch via SASRec).
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np
import polars as pl

from gti.data.sequences import split_lists
from gti.common.errors import ConfigError, DataError


def split_train_sequences(seqs: pl.DataFrame, split: str) -> list[list[str]]:
    """Per-user chronological sequences the baselines may learn from for `split`: valid ->
    train items; test -> train items + valid items."""
    if split == "valid":
        return seqs["train_items"].to_list()
    s = split_lists(seqs)
    return [t + v for t, v in zip(s["train_items"].to_list(), s["valid_items"].to_list())]


def metric_block(ranked: list[list[str]], targets: list[str], ks: list[int], n_boot: int, seed: int,
                 groups: Sequence[str] | None = None):
    """({metric@k: {"value", "ci"}}, {metric@k: per-row values}) for ranked lists; `groups`:
    each row's user, whom the CIs resample."""
    from gti.eval import metrics as M

    return M.metrics_table(ranked, targets, ks, n_boot=n_boot, seed=seed, return_per_user=True, groups=groups)


SASREC_ITEMS, SASREC_RANK = "sasrec_items", "sasrec_rank"  # split-frame columns (add_reference_columns)
DEFAULT_BASELINES = ("mostpop", "markov")


def baseline_rows(seqs: pl.DataFrame, split: str, frame: pl.DataFrame, ks: list[int],
                  n_boot: int, seed: int, catalog: list[str],
                  names: tuple[str, ...] | list[str] = DEFAULT_BASELINES,
                  per_user: dict[str, dict] | None = None) -> dict[str, dict]:
    """Reference rows on `frame` (same users): {name: metric@k table} in `names` order.

    mostpop/markov are fitted here on the split's training data; sasrec reads the top-K lists
    that `add_reference_columns` put in the frame (DataError when absent). `per_user`, when
    given, receives {name: {metric@k: per-user values}} (frame order).
    """
    from gti.eval import baselines as B

    histories = frame["history"].to_list()
    targets = frame["target"].to_list()
    users = frame["user_id"].to_list()
    k = max(ks)
    out = {}
    train = None
    for name in names:
        if name == "sasrec":
            if SASREC_ITEMS not in frame.columns:
                raise DataError("evaluate: the sasrec row needs the SASRec recommendations (add_reference_columns)")
            ranked = [list(r)[:k] for r in frame[SASREC_ITEMS].to_list()]
        elif name in ("mostpop", "markov"):
            train = split_train_sequences(seqs, split) if train is None else train
            model = B.MostPop(catalog) if name == "mostpop" else B.Markov(catalog)
            ranked = model.fit(train).recommend(histories, k)
        else:
            raise ConfigError(f"eval.baselines: unknown baseline '{name}'")
        out[name], pu = metric_block(ranked, targets, ks, n_boot, seed, users)
        if per_user is not None:
            per_user[name] = pu
    return out


def baseline_rank_rows(frame: pl.DataFrame, n_items: int, n_boot: int, seed: int) -> dict[str, dict]:
    """{"sasrec": rank_metrics} from the frame's exact SASRec ranks; {} when it has none."""
    if SASREC_RANK not in frame.columns or frame[SASREC_RANK].null_count():
        return {}
    from gti.eval.rank import rank_metrics

    return {"sasrec": rank_metrics(frame[SASREC_RANK].to_numpy(), n_items, n_boot, seed,
                                   groups=frame["user_id"].to_list())}


def fit_reference_models(seqs: pl.DataFrame, catalog: list[str], names: Sequence[str], max_history: int,
                         sasrec: Mapping[str, Any] | None = None, seed: int = 0,
                         log=lambda m: None) -> dict[str, Any]:
    """The reference models trained once per evaluation (not per split): {"sasrec": fitted
    `gti.eval.sasrec.SasrecRecommender`} when `names` has sasrec, else {}.

    SASRec learns from the training items only (`train_items`) and is selected on the valid
    rows only (every valid-period target with the items before it, `valid_rows`; its settings
    by eval.sasrec.sweep when enabled, `tune_sasrec`; its checkpoint in any case); test items
    are never read. `sasrec`: the eval.sasrec block (`SasrecParams` fields, max_len (None:
    `max_history` = data.max_history) and sweep).
    """
    if "sasrec" not in names:
        return {}
    from gti.eval.sasrec import SasrecParams, fit_sasrec, tune_sasrec

    cfg = dict(sasrec or {})
    sweep, max_len = cfg.pop("sweep", None), cfg.pop("max_len", None) or max_history
    val_ids, val_hist, val_targets = valid_rows(seqs)
    users = seqs["user_id"].to_list()
    args = (users, seqs["train_items"].to_list(), val_targets, catalog)
    # One valid row per user, in user order (leave-one-out): the per-user call, as before.
    valid = {} if val_ids == users else dict(valid_histories=val_hist, valid_ids=val_ids)
    if sweep and sweep.get("enabled"):
        model = tune_sasrec(*args, max_history, SasrecParams(**cfg), sweep, seed=seed, log=log, **valid)
    else:
        model = fit_sasrec(*args, max_len, SasrecParams(**cfg), seed=seed, log=log, **valid)
    return {"sasrec": model}


def valid_rows(seqs: pl.DataFrame) -> tuple[list[str], list[list[str]], list[str]]:
    """The valid split's rows for SASRec's selection: (a session id per row, every item before
    the target, the target). Leave-one-out: per user (user id, train items, valid item)."""
    from gti.eval.slices import eval_windows

    w = eval_windows(seqs, "valid", 1)
    hist = sasrec_histories(seqs, w, "valid")
    users = w["user_id"].to_list()
    one_each = len(set(users)) == len(users)  # leave-one-out: the session is the user, as before
    ids = users if one_each else [f"{u}#{p}" for u, p in zip(users, w["pos"].to_list())]
    return ids, hist, w["target"].to_list()


def sasrec_histories(seqs: pl.DataFrame, frame: pl.DataFrame, split: str) -> list[list[str]]:
    """Per row of a split frame, the whole history SASRec reads (it keeps its own last max_len,
    not the LM's data.max_history): every item of the user before the row's target (the
    frame's `pos`); leave-one-out: the split's training sequence (`split_train_sequences`:
    valid -> train items; test -> train items + valid item). No row sees its own target."""
    if "pos" not in frame.columns:  # a frame from before `pos`: one row per user
        full = dict(zip(seqs["user_id"].to_list(), split_train_sequences(seqs, split)))
        return [full[u] for u in frame["user_id"].to_list()]
    s = split_lists(seqs)
    full = dict(zip(s["user_id"].to_list(), (t + v + x for t, v, x in zip(
        s["train_items"].to_list(), s["valid_items"].to_list(), s["test_items"].to_list()))))
    return [full[u][:p] for u, p in zip(frame["user_id"].to_list(), frame["pos"].to_list())]


def add_reference_columns(frame: pl.DataFrame, models: dict[str, Any], k: int, exact_rank: bool,
                          histories: list[list[str]] | None = None) -> pl.DataFrame:
    """`frame` (history, target) plus, when models has "sasrec", its top-k lists (sasrec_items
    list<str>) and, with exact_rank, each target's exact rank over the whole catalog (sasrec_rank),
    so any slice of the frame (the cold-item slice) carries them.
    `histories`: SASRec's input per row (`sasrec_histories`; None: the frame's history)."""
    if "sasrec" not in models:
        return frame
    try:
        ranked, ranks = models["sasrec"].ranked_and_ranks(
            histories if histories is not None else frame["history"].to_list(), frame["target"].to_list(), k,
            exact_rank)
    except KeyError as e:
        raise DataError(f"evaluate: SASRec: {e.args[0]}") from None
    out = frame.with_columns(pl.Series(SASREC_ITEMS, ranked, dtype=pl.List(pl.String)))
    if exact_rank:
        out = out.with_columns(pl.Series(SASREC_RANK, ranks, dtype=pl.Float64))
    return out


def reference_frames(frames: dict[str, pl.DataFrame], seqs: pl.DataFrame, catalog: list[str],
                     names: Sequence[str], max_history: int, sasrec: Mapping[str, Any] | None, seed: int,
                     k: int, exact_rank: bool, log=lambda m: None) -> tuple[dict[str, pl.DataFrame], dict[str, Any]]:
    """Train the once-per-evaluation reference models (`fit_reference_models`) and add their
    columns to every split frame (`add_reference_columns`, SASRec reading `sasrec_histories`).
    -> (frames, facts {"sasrec": {label, train_seconds, score_seconds, max_len, sweep, ...}} or {})."""
    models = fit_reference_models(seqs, catalog, names, max_history, sasrec, seed, log)
    if not models:
        return frames, {}
    t0 = time.time()
    frames = {s: add_reference_columns(f, models, k, exact_rank, sasrec_histories(seqs, f, s))
              for s, f in frames.items()}
    facts = dict(models["sasrec"].facts, score_seconds=round(time.time() - t0, 2))
    sweep = facts.get("sweep")
    trained = (f"tuned on valid ({len(sweep['candidates'])} candidates) in {sweep['wall_seconds']:.1f}s" if sweep
               else f"trained in {facts['train_seconds']:.1f}s")
    log(f"{facts['label']}: {trained}, max_len {facts['max_len']}, scored {sum(f.height for f in frames.values()):,} "
        f"prompts in {facts['score_seconds']:.1f}s")
    return frames, {"sasrec": facts}


def reference_block(seqs: pl.DataFrame, split: str, frame: pl.DataFrame, ks: list[int], n_boot: int,
                    seed: int, catalog: list[str], names, exact_rank: bool) -> dict[str, dict]:
    """One split's reference rows. -> {"baselines": {name: metric@k table}, "ranks": {"sasrec":
    rank_metrics} (with exact_rank), "per_user": {name: {"user_ids", metric@k: [...]}, with
    "exact_rank": [...] for sasrec with exact_rank}} (per-user values in frame order, for
    paired CIs against the model and the summary's MRR@K)."""
    per_user: dict[str, dict] = {}
    rows = baseline_rows(seqs, split, frame, ks, n_boot, seed, catalog, names, per_user=per_user)
    ranks = baseline_rank_rows(frame, len(catalog), n_boot, seed) if exact_rank else {}
    users = frame["user_id"].to_list()
    pu = {name: {"user_ids": users, **vals} for name, vals in per_user.items()}
    if "sasrec" in pu and "sasrec" in ranks:
        pu["sasrec"]["exact_rank"] = frame[SASREC_RANK].to_list()
    return {"baselines": rows, "ranks": ranks, "per_user": pu}


# --------------------------------------------------------------------------- paired differences
def row_keys(user_ids: Sequence[str]) -> list[tuple[str, int]]:
    """(user, n-th row of that user) per row: the rows of two tables built from the same split
    frame pair up by it (one row per user: the user alone decides, as before)."""
    seen: dict[str, int] = {}
    out = []
    for u in user_ids:
        out.append((u, seen.get(u, 0)))
        seen[u] = seen.get(u, 0) + 1
    return out


def paired_k(ks: Sequence[int]) -> int:
    """The K of the headline columns (Recall@K, NDCG@K, MRR@K): 10 when eval.ks has it, else the largest."""
    return 10 if 10 in ks else max(ks)


def reciprocal_ranks_at_k(ndcg: Sequence[float]) -> np.ndarray:
    """Per-user reciprocal rank within the top K from per-user NDCG@K of one target per user:
    a hit at 0-based rank r has NDCG 1/log2(r + 2), so its reciprocal rank is 1/(r + 1); a
    miss (NDCG 0) counts 0. -> float64 [U]."""
    v = np.asarray(ndcg, dtype=np.float64)
    hit = v > 0
    rank = np.rint(np.exp2(1.0 / np.where(hit, v, 1.0)) - 2.0)  # 0-based, exact for a hit
    return np.where(hit, 1.0 / (rank + 1.0), 0.0)


def paired_differences(model: Mapping[str, Any], baselines: Mapping[str, Mapping[str, Any]], ks: Sequence[int],
                       n_boot: int, seed: int) -> dict[str, dict[str, dict[str, Any]]]:
    """The model minus each reference row on the same users: {name: {metric: {"value": mean of
    the per-user differences, "ci": [lo, hi] (paired user bootstrap, `paired_bootstrap_ci`),
    "n_users"}}}.

    model / baselines[name]: per-row blocks as metrics.json holds them ({"user_ids", "recall@k":
    [...], "ndcg@k": [...], optionally "exact_rank": [...]}); a baseline's rows are matched to
    the model's by (user, n-th row of the user) (`row_keys`; DataError when they are not the
    same rows); the CIs resample users, and a cell has "n_rows" where rows outnumber users. Metrics: recall@k and ndcg@k
    for every k in `ks`, then one MRR: "mrr" (1 / exact rank over the whole catalog) when both
    sides have exact ranks, else "mrr@K" (K = `paired_k(ks)`, from the top-K lists).
    """
    from gti.eval.metrics import paired_bootstrap_ci

    users = list(model["user_ids"])
    keys = row_keys(users)
    k0 = paired_k(ks)
    n_users = len(set(users))

    def diff(a, b) -> dict[str, Any]:
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        lo, hi = paired_bootstrap_ci(a, b, n_boot=n_boot, seed=seed, groups=users)
        cell = {"value": float((a - b).mean()) if a.size else 0.0, "ci": [lo, hi], "n_users": n_users}
        return cell if n_users == a.size else {**cell, "n_rows": int(a.size)}

    out = {}
    for name, base in baselines.items():
        pos = {key: i for i, key in enumerate(row_keys(list(base["user_ids"])))}
        if len(pos) != len(keys) or any(key not in pos for key in keys):
            raise DataError(f"evaluate: paired differences: the {name} row was scored on other users")
        order = [pos[key] for key in keys]

        def of(key: str, vals=base):
            return [vals[key][i] for i in order]

        block = {m: diff(model[m], of(m)) for m in [f"{n}@{k}" for n in ("recall", "ndcg") for k in ks]}
        if model.get("exact_rank") is not None and base.get("exact_rank") is not None:
            block["mrr"] = diff(1.0 / np.asarray(model["exact_rank"], dtype=np.float64),
                                1.0 / np.asarray(of("exact_rank"), dtype=np.float64))
        else:
            block[f"mrr@{k0}"] = diff(reciprocal_ranks_at_k(model[f"ndcg@{k0}"]),
                                      reciprocal_ranks_at_k(of(f"ndcg@{k0}")))
        out[name] = block
    return out
