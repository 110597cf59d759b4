"""SASRec reference recommender: cornac's native-PyTorch SASRec, tuned on the valid split.

What it is for: the reference row every sequential recommender is compared with (SASRec, Kang &
McAuley, ICDM 2018), on the same users, split, metric code and (with exact ranks) the same
whole-catalog ranking as the generative model. `fit_sasrec` trains cornac's model on each user's
training items, `tune_sasrec` picks its settings on the valid split (`eval.sasrec.sweep`; its
cost: bench/proof/RESULTS.md, "What SASRec's default sweep costs"), and
`SasrecRecommender.scores` scores every catalog item. Test items are an argument of none of them.

What it does NOT know: SIDs, the LM, metrics (`gti.eval.metrics`, `gti.eval.rank`), files,
Ray. cornac is imported lazily, so importing this module is cheap.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np


@dataclass
class SasrecParams:
    """Hyper-parameters passed to cornac's SASRec (names as in `gti.config.eval.SasrecConfig`)."""

    epochs: int = 10
    dim: int = 64
    blocks: int = 2
    heads: int = 1
    dropout: float = 0.2
    lr: float = 1e-3
    batch_size: int = 256
    n_sample: int = 1024
    loss: str = "ce"
    val_every: int = 2
    val_users: int | None = 1000
    batch_users: int = 512  # scoring batch, not a training setting
    threads: int | None = 1  # torch threads while training/scoring; None keeps the process's


def training_sessions(train_items: Sequence[Sequence[str]], user_ids: Sequence[str]) -> list[tuple]:
    """cornac USIT rows (user, session, item, position) of every user's TRAINING items.

    One session per user, its items in order, so cornac's windows equal the SFT windows.
    train_items: U lists of item ids (oldest first); user_ids: U ids. -> list of 4-tuples.
    """
    return [(str(u), str(u), str(item), t) for u, items in zip(user_ids, train_items) for t, item in enumerate(items)]


def validation_sessions(
    train_items: Sequence[Sequence[str]], valid_items: Sequence[str], user_ids: Sequence[str],
    known: set[str], max_len: int, max_users: int | None, seed: int,
) -> list[tuple]:
    """cornac USIT rows for best-on-valid selection: per sampled user the last `max_len`
    known training items followed by the valid item (cornac scores the session's last item).

    Users whose valid item is not a training item (unknown to the model) or whose history has no
    known item are left out. `max_users` users at most, drawn with a seeded generator.
    """
    idx = [i for i, v in enumerate(valid_items) if v in known and any(t in known for t in train_items[i])]
    if max_users is not None and len(idx) > max_users:
        pick = np.random.default_rng([seed, 0x5A5]).choice(len(idx), size=max_users, replace=False)
        idx = [idx[i] for i in np.sort(pick)]
    rows = []
    for i in idx:
        hist = [str(t) for t in train_items[i] if t in known][-max_len:]
        for t, item in enumerate(hist + [str(valid_items[i])]):
            rows.append((str(user_ids[i]), str(user_ids[i]), item, t))
    return rows


@dataclass
class SasrecRecommender:
    """A fitted SASRec over a fixed catalog (`cornac.models.SASRec`; its default loss is a
    sampled softmax over the batch's targets and shared negatives, not the paper's BCE).

    model: the fitted `cornac.models.SASRec`; catalog: N item ids (the ranking's columns, their
    order the tie-break); max_len: the input length (a history's last max_len known items);
    facts: what `fit_sasrec` (and `tune_sasrec`) measured.
    """

    model: Any
    catalog: list[str]
    max_len: int
    params: SasrecParams
    facts: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        iid = self.model.iid_map  # item id -> cornac index, training items only
        # [N] cornac index of each catalog item, -1 when training never saw it.
        self.col = np.array([iid.get(str(i), -1) for i in self.catalog], dtype=np.int64)
        self.known = self.col >= 0

    def _encode_histories(self, histories: Sequence[Sequence[str]]) -> np.ndarray:
        """-> int64 [U, max_len]: known history items' cornac indices, left-padded."""
        iid, pad, h = self.model.iid_map, self.model.pad_idx, self.max_len
        out = np.full((len(histories), h), pad, dtype=np.int64)
        for r, hist in enumerate(histories):
            ids = [iid[str(i)] for i in hist if str(i) in iid][-h:]
            if ids:
                out[r, h - len(ids):] = ids
        return out

    def scores(self, histories: Sequence[Sequence[str]]) -> np.ndarray:
        """Scores of every catalog item for each history. -> float32 [U, N]; -inf = unknown item.

        histories: U lists of item ids, oldest first (only the last max_len known ones are
        read). Higher = better, as `gti.eval.rank.exact_ranks` expects; items unknown to
        training tie last.
        """
        import torch

        n = len(self.catalog)
        out = np.full((len(histories), n), -np.inf, dtype=np.float32)
        if not len(histories):
            return out
        net = self.model.model
        net.eval()
        enc = self._encode_histories(histories)
        with _threads(self.params.threads):
            for s in range(0, len(histories), self.params.batch_users):
                block = torch.as_tensor(enc[s:s + self.params.batch_users], dtype=torch.long)
                sc = np.asarray(net.predict(None, block), dtype=np.float32).reshape(block.shape[0], -1)
                out[s:s + block.shape[0], self.known] = sc[:, self.col[self.known]]
        return out

    def recommend(self, histories: Sequence[Sequence[str]], k: int) -> list[list[str]]:
        """Top-k catalog items per history, best first (ties: catalog order; unknown items last)."""
        sc = self.scores(histories)
        order = np.argsort(-sc, axis=1, kind="stable")[:, :k]
        return [[self.catalog[j] for j in row] for row in order]

    def ranked_and_ranks(self, histories: Sequence[Sequence[str]], targets: Sequence[str], k: int,
                         exact: bool) -> tuple[list[list[str]], list[float] | None]:
        """(top-k lists, exact ranks or None) from ONE scoring pass, batch by batch."""
        from gti.eval.rank import exact_ranks

        row = {item: r for r, item in enumerate(self.catalog)}
        if exact:
            missing = [t for t in targets if str(t) not in row]
            if missing:
                raise KeyError(f"target item(s) {missing[:5]} are not in the catalog")
        ranked: list[list[str]] = []
        ranks: list[float] = []
        step = self.params.batch_users
        for s in range(0, len(histories), step):
            sc = self.scores(histories[s:s + step])
            order = np.argsort(-sc, axis=1, kind="stable")[:, :k]
            ranked += [[self.catalog[j] for j in r] for r in order]
            if exact:
                ranks += exact_ranks(sc, np.array([row[str(t)] for t in targets[s:s + step]])).tolist()
        return ranked, (ranks if exact else None)


class _threads:
    """Context manager: torch intra-op threads = n inside (None: unchanged)."""

    def __init__(self, n: int | None) -> None:
        self.n, self.prev = n, None

    def __enter__(self):
        if self.n:
            import torch

            self.prev = torch.get_num_threads()
            torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc) -> None:
        if self.prev is not None:
            import torch

            torch.set_num_threads(self.prev)


def fit_sasrec(
    user_ids: Sequence[str],
    train_items: Sequence[Sequence[str]],
    valid_items: Sequence[str] | None,
    catalog: Sequence[str],
    max_len: int,
    params: SasrecParams | None = None,
    seed: int = 0,
    log: Callable[[str], None] = lambda m: None,
    valid_histories: Sequence[Sequence[str]] | None = None,
    valid_ids: Sequence[str] | None = None,
) -> SasrecRecommender:
    """Train cornac's SASRec on the windows of `train_items` (histories of at most `max_len`
    items), pick the best checkpoint on the valid items (None: no selection, the last epoch),
    and wrap it for scoring over `catalog`.

    user_ids: U ids; train_items: U lists (oldest first; valid/test items must NOT be in them,
    as in ingest's `train_items`); valid_items: U ids or None; catalog: N item ids. With
    `valid_histories` (and `valid_ids`, one session id each), valid_items are the targets of
    those V rows instead of one per user (the global time split's valid rows).
    facts: train_seconds (wall time of building the data and fitting), epochs, dim, dropout,
    n_windows, n_train_items, n_val_users, loss, selection, implementation, max_len, seed,
    torch_threads.
    """
    from cornac.data import SequentialDataset
    from cornac.models import SASRec

    p = params or SasrecParams()
    t0 = time.time()
    rows = training_sessions(train_items, user_ids)
    if not rows:
        raise ValueError("SASRec: no training items")
    iid_map: OrderedDict = OrderedDict()
    train = SequentialDataset.build(rows, fmt="USIT", global_iid_map=iid_map, seed=seed)
    known = set(iid_map)
    val = None
    n_val = 0
    if valid_items is not None and p.val_users != 0:
        vrows = validation_sessions(train_items if valid_histories is None else valid_histories, valid_items,
                                    user_ids if valid_ids is None else valid_ids, known, max_len, p.val_users, seed)
        n_val = len({r[0] for r in vrows})
        if vrows:
            val = SequentialDataset.build(vrows, fmt="USIT", global_uid_map=OrderedDict(train.uid_map),
                                          global_iid_map=iid_map, seed=seed)
            assert len(iid_map) == len(known), "validation added items to the training map"
    model = SASRec(
        embedding_dim=p.dim, loss=p.loss, batch_size=p.batch_size, learning_rate=p.lr, n_sample=p.n_sample,
        n_epochs=p.epochs, max_len=max_len, num_blocks=p.blocks, num_heads=p.heads, dropout=p.dropout,
        seed=seed, model_selection="best" if val is not None else "last", val_eval_every=p.val_every,
        val_k=10, val_metric="recall", verbose=False,
    )
    n_windows = sum(max(0, len(t) - 1) for t in train_items)
    log(f"SASRec (cornac): {n_windows:,} windows of {len(known):,} training items, max_len {max_len}, "
        f"dim {p.dim}, dropout {p.dropout}, {p.epochs} epochs, best of every {p.val_every} on {n_val:,} valid users")
    with _threads(p.threads):
        import torch

        threads = torch.get_num_threads()
        model.fit(train, val)
    seconds = time.time() - t0
    facts = {
        "implementation": "cornac 3.0.1 SASRec (PyTorch)",
        "train_seconds": round(seconds, 2),
        "epochs": p.epochs, "dim": p.dim, "dropout": p.dropout,
        "n_windows": n_windows,
        "n_train_items": len(known),
        "n_val_users": n_val,
        "loss": p.loss,
        "selection": f"best valid Recall@10 every {p.val_every} epochs" if val is not None else "last epoch",
        "max_len": max_len,
        "seed": seed,
        "torch_threads": threads,
        "label": LABEL,
    }
    log(f"SASRec trained in {seconds:.1f}s")
    return SasrecRecommender(model, [str(i) for i in catalog], max_len, p, facts)


# --------------------------------------------------------------------------- tuning on valid
LABEL, TUNED_LABEL = "SASRec", "SASRec (tuned on valid)"  # the row's name in tables (facts["label"])
# Swept keys, in the order the `axes` search visits them: regularisation, then capacity, then the
# epoch cap (cornac keeps the best valid checkpoint within it, so more epochs pay only when the
# others let the model improve longer), and max_len last: the others are tuned at the first,
# cheapest length (data.max_history), since cornac pads every window to max_len and an epoch at
# 50 costs several times one at 3 (bench/proof/RESULTS.md, "What SASRec's default sweep
# costs"); each longer length is then tried once.
SWEEP_AXES = ("dropout", "dim", "epochs", "max_len")


def sweep_axes(sweep: Mapping[str, Any], history: int) -> dict[str, list]:
    """{axis: distinct values in config order} of an eval.sasrec.sweep block; max_len "history"
    is `history` (= data.max_history)."""
    out = {}
    for axis in SWEEP_AXES:
        vals = [history if v == "history" else v for v in sweep[axis]]
        out[axis] = list(dict.fromkeys(vals))  # "history" may equal a listed length: train it once
    return out


def valid_scores(model: SasrecRecommender, train_items: Sequence[Sequence[str]],
                 valid_items: Sequence[str]) -> dict[str, float]:
    """{"mrr", "recall@10", "n_users"} of each valid item's exact rank over the whole catalog
    (mid-rank on ties; items unknown to training tie last), the history being the user's
    training items (the model reads the last max_len known ones), as the valid split's row."""
    _, ranks = model.ranked_and_ranks(list(train_items), list(valid_items), 10, exact=True)
    r = np.asarray(ranks, dtype=np.float64)
    return {"mrr": float((1.0 / r).mean()), "recall@10": float((r <= 10).mean()), "n_users": int(r.size)}


def tune_sasrec(
    user_ids: Sequence[str],
    train_items: Sequence[Sequence[str]],
    valid_items: Sequence[str],
    catalog: Sequence[str],
    history: int,
    params: SasrecParams,
    sweep: Mapping[str, Any],
    seed: int = 0,
    log: Callable[[str], None] = lambda m: None,
    valid_histories: Sequence[Sequence[str]] | None = None,
    valid_ids: Sequence[str] | None = None,
) -> SasrecRecommender:
    """SASRec with its settings chosen on the VALID split (`valid_histories` / `valid_ids`:
    its rows, as in `fit_sasrec`; None: one per user, the training items before it): every candidate of `sweep` (the
    eval.sasrec.sweep block: axes max_len/epochs/dim/dropout, search, metric, val_users) is
    trained by `fit_sasrec` on the training items (the rest of `params` shared) and scored by
    `valid_scores` on the valid items of every user (or a seeded sample of val_users); the
    candidate with the highest `metric` (ties: the first tried) is returned, as trained (the
    same seed and data would retrain it bit for bit, on CPU with a fixed thread count). Test
    items are never read: no argument holds them. facts: the kept model's, label TUNED_LABEL,
    and "sweep": {search, metric, n_users, candidates [{settings, valid, train_seconds,
    score_seconds}], chosen, wall_seconds}.
    """
    t0 = time.time()
    axes, metric = sweep_axes(sweep, history), sweep["metric"]
    v_hist = train_items if valid_histories is None else valid_histories
    valid = {} if valid_histories is None else dict(valid_histories=valid_histories, valid_ids=valid_ids)
    idx = np.arange(len(valid_items))
    if sweep.get("val_users") is not None and sweep["val_users"] < len(idx):
        idx = np.sort(np.random.default_rng([seed, 0x5EE9]).choice(len(idx), size=sweep["val_users"], replace=False))
    hist, targets = [v_hist[i] for i in idx], [valid_items[i] for i in idx]
    tried: dict[tuple, dict] = {}
    best: dict[str, Any] = {}  # "record", "model" of the best candidate so far

    def trial(settings: dict[str, Any]) -> None:
        key = tuple(settings[a] for a in SWEEP_AXES)
        if key in tried:
            return
        t1 = time.time()
        p = replace(params, epochs=settings["epochs"], dim=settings["dim"], dropout=settings["dropout"])
        model = fit_sasrec(user_ids, train_items, valid_items, catalog, settings["max_len"], p, seed, **valid)
        t2 = time.time()
        scores = valid_scores(model, hist, targets)
        tried[key] = rec = {"settings": dict(settings), "valid": scores, "train_seconds": round(t2 - t1, 2),
                            "score_seconds": round(time.time() - t2, 2)}
        log(f"SASRec sweep {len(tried)}: {settings} -> valid MRR {scores['mrr']:.4f}, Recall@10 "
            f"{scores['recall@10']:.4f} ({t2 - t1:.0f}s)")
        if not best or scores[metric] > best["record"]["valid"][metric]:
            best.update(record=rec, model=model)

    if sweep["search"] == "grid":
        for values in itertools.product(*(axes[a] for a in SWEEP_AXES)):
            trial(dict(zip(SWEEP_AXES, values)))
    else:  # one axis at a time, the others at the best values found so far
        current = {a: axes[a][0] for a in SWEEP_AXES}
        for axis in SWEEP_AXES:
            for v in axes[axis]:
                trial({**current, axis: v})
            current = dict(best["record"]["settings"])
    model, chosen = best["model"], best["record"]
    seconds = time.time() - t0
    model.facts.update(label=TUNED_LABEL, sweep={
        "search": sweep["search"], "metric": metric, "n_users": len(idx), "candidates": list(tried.values()),
        "chosen": chosen["settings"], "chosen_valid": chosen["valid"], "wall_seconds": round(seconds, 2)})
    log(f"SASRec tuned on valid: {len(tried)} candidates in {seconds:.0f}s; chosen {chosen['settings']} "
        f"(valid {metric} {chosen['valid'][metric]:.4f})")
    return model
