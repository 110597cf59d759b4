"""SASRec reference recommender: cornac's native-PyTorch SASRec, trained on the SFT windows.

What it is for: the reference row every sequential recommender is compared with (SASRec, Kang &
McAuley, ICDM 2018), computed beside MostPop and Markov on the same users, split, metric code
and (with exact ranks) the same whole-catalog ranking as the generative model, so a reader can
tell whether gti's model is any good.

The implementation is cornac's (`cornac.models.SASRec`, cornac==3.0.1, pure PyTorch: causal
self-attention blocks, learned positional embeddings, point-wise feed-forward, item embeddings
shared between input and output). This module only feeds it and reads it:

- Training data = exactly the SFT training windows (`gti.train.sft_data.training_windows`):
  each user's TRAINING items form one cornac session, and cornac's session iterator turns a
  session [i0..iT] into the windows (history items[:t][-max_len:], target items[t]) for
  t = 1..T with `max_len = data.max_history`, the same windows SFT trains on (cornac skips an
  epoch's last batch when it holds a single window). Valid and test
  items are never in a training session (`training_sessions`), so they are never a target, a
  history item or a sampled negative (negatives are drawn from training items only).
- Loss: cornac's "ce" by default: softmax cross-entropy over the batch's own targets plus
  `n_sample` shared negatives drawn by popularity^0.5 (sampled softmax, not the paper's BCE).
- Model selection: on the VALID split only. A seeded sample of `val_users` users, each one
  cornac session = last max_history training items + the valid item (`validation_sessions`),
  scored every `val_every` epochs with Recall@10 (cornac's `model_selection="best"`); the best
  checkpoint is kept. Training always runs `epochs` epochs (no patience stop); the valid item of
  these users is scored, never trained on. The valid split's SASRec row therefore is the split
  the checkpoint was picked on (like the SFT model's validation); the test row is untouched.
- Scoring (`SasrecRecommender.scores`): one batched forward per `batch_users` histories
  (left-padded to max_len, as cornac's own `score`), dot product with every item embedding.
  Items unknown to training (catalog items never seen among training items) score -inf: they
  rank last, tied (mid-rank under `gti.eval.rank.exact_ranks`); history items unknown to
  training are dropped from the input. Top-K lists break score ties by catalog order.

Determinism: cornac seeds torch (`torch.manual_seed(seed)`, init and dropout) and its own numpy
RandomState (session order, negatives); on CPU with a fixed thread count the same seed gives
the same model and scores.

What it does NOT know: SIDs, the LM, metrics (`gti.eval.metrics`, `gti.eval.rank`), files,
Ray. cornac is imported lazily, so importing this module is cheap.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np


@dataclass
class SasrecParams:
    """Hyper-parameters passed to cornac's SASRec (names as in `gti.config_eval.SasrecConfig`)."""

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
    known: set[str], max_history: int, max_users: int | None, seed: int,
) -> list[tuple]:
    """cornac USIT rows for best-on-valid selection: per sampled user the last `max_history`
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
        hist = [str(t) for t in train_items[i] if t in known][-max_history:]
        for t, item in enumerate(hist + [str(valid_items[i])]):
            rows.append((str(user_ids[i]), str(user_ids[i]), item, t))
    return rows


@dataclass
class SasrecRecommender:
    """A fitted SASRec over a fixed catalog.

    model: the fitted `cornac.models.SASRec`; catalog: N item ids (the ranking's columns, their
    order the tie-break); max_history: the input length; facts: what `fit_sasrec` measured.
    """

    model: Any
    catalog: list[str]
    max_history: int
    params: SasrecParams
    facts: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        iid = self.model.iid_map  # item id -> cornac index, training items only
        # [N] cornac index of each catalog item, -1 when training never saw it.
        self.col = np.array([iid.get(str(i), -1) for i in self.catalog], dtype=np.int64)
        self.known = self.col >= 0

    def _encode_histories(self, histories: Sequence[Sequence[str]]) -> np.ndarray:
        """-> int64 [U, max_history]: known history items' cornac indices, left-padded."""
        iid, pad, h = self.model.iid_map, self.model.pad_idx, self.max_history
        out = np.full((len(histories), h), pad, dtype=np.int64)
        for r, hist in enumerate(histories):
            ids = [iid[str(i)] for i in hist if str(i) in iid][-h:]
            if ids:
                out[r, h - len(ids):] = ids
        return out

    def scores(self, histories: Sequence[Sequence[str]]) -> np.ndarray:
        """Scores of every catalog item for each history. -> float32 [U, N]; -inf = unknown item.

        histories: U lists of item ids, oldest first (only the last max_history known ones are
        read). Higher = better, as `gti.eval.rank.exact_ranks` expects.
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
    max_history: int,
    params: SasrecParams | None = None,
    seed: int = 0,
    log: Callable[[str], None] = lambda m: None,
) -> SasrecRecommender:
    """Train cornac's SASRec on the SFT windows of `train_items`, pick the best checkpoint on the
    valid items (None: no selection, the last epoch), and wrap it for scoring over `catalog`.

    user_ids: U ids; train_items: U lists (oldest first; valid/test items must NOT be in them,
    as in ingest's `train_items`); valid_items: U ids or None; catalog: N item ids.
    facts: train_seconds (wall time of building the data and fitting), epochs, n_windows,
    n_train_items, n_val_users, loss, selection, implementation, max_history, seed, torch_threads.
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
        vrows = validation_sessions(train_items, valid_items, user_ids, known, max_history, p.val_users, seed)
        n_val = len({r[0] for r in vrows})
        if vrows:
            val = SequentialDataset.build(vrows, fmt="USIT", global_uid_map=OrderedDict(train.uid_map),
                                          global_iid_map=iid_map, seed=seed)
            assert len(iid_map) == len(known), "validation added items to the training map"
    model = SASRec(
        embedding_dim=p.dim, loss=p.loss, batch_size=p.batch_size, learning_rate=p.lr, n_sample=p.n_sample,
        n_epochs=p.epochs, max_len=max_history, num_blocks=p.blocks, num_heads=p.heads, dropout=p.dropout,
        seed=seed, model_selection="best" if val is not None else "last", val_eval_every=p.val_every,
        val_k=10, val_metric="recall", verbose=False,
    )
    n_windows = sum(max(0, len(t) - 1) for t in train_items)
    log(f"SASRec (cornac): {n_windows:,} SFT windows of {len(known):,} training items, history {max_history}, "
        f"{p.epochs} epochs, best of every {p.val_every} on {n_val:,} valid users")
    with _threads(p.threads):
        import torch

        threads = torch.get_num_threads()
        model.fit(train, val)
    seconds = time.time() - t0
    facts = {
        "implementation": "cornac 3.0.1 SASRec (PyTorch)",
        "train_seconds": round(seconds, 2),
        "epochs": p.epochs,
        "n_windows": n_windows,
        "n_train_items": len(known),
        "n_val_users": n_val,
        "loss": p.loss,
        "selection": f"best valid Recall@10 every {p.val_every} epochs" if val is not None else "last epoch",
        "max_history": max_history,
        "seed": seed,
        "torch_threads": threads,
    }
    log(f"SASRec trained in {seconds:.1f}s")
    return SasrecRecommender(model, [str(i) for i in catalog], max_history, p, facts)
