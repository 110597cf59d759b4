"""Exact rank of the true next item among ALL catalog items, and the metrics built on it.

What it is for: Recall@K / NDCG@K from beam search stay at the floor for small or young models,
so they cannot tell two such models apart; the exact rank of the target under the model's own
scores moves long before. `score_catalog` scores every catalog SID for every user (the beam
search's score: the sum of the SID tokens' log-probs), fast because items share prefixes: one
prefill per prompt, then one token per distinct SID prefix with tree attention (how: the
comment above `score_catalog`). `exact_ranks` turns scores into the target's rank (mid-rank on
ties); `rank_metrics` reports MRR, mean percentile rank and the median rank with CIs over users.

What it does NOT know: how prompts are rendered, which row is a user's target (callers pass
trie/catalog rows), beam search or top-K metrics (`gti.eval.decode`, `gti.eval.metrics`), Ray.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from gti.eval.beams import as_prompt_lists, chunks, left_pad, model_device
from gti.eval.metrics import bootstrap_ci

MASKABLE_ATTENTION = ("eager", "sdpa")


# --------------------------------------------------------------------------- the catalog tree
class _Tree:
    """Distinct SID prefixes of a catalog, per depth. N items, L levels, P_d nodes at depth d.

    For depth d in 1..L-1 (prefix length d):
        item_node[d]: LongTensor [N], the node (0..P_d-1) of each item's prefix sids[:, :d].
        token[d]: LongTensor [P_d], the node's last token (sids[:, d-1] of its items).
        anc[d]: LongTensor [P_d, d-1], the node's ancestors at depths 1..d-1 (node ids there).
    Depth 0 (the empty prefix) is the prompt itself and has no entry.
    """

    def __init__(self, sids: torch.Tensor) -> None:
        n_items, levels = sids.shape
        self.levels = levels
        self.item_node: dict[int, torch.Tensor] = {}
        self.token: dict[int, torch.Tensor] = {}
        self.anc: dict[int, torch.Tensor] = {}
        self.n_nodes: dict[int, int] = {}
        for d in range(1, levels):
            uniq, inv = torch.unique(sids[:, :d], dim=0, return_inverse=True)
            self.item_node[d] = inv
            self.token[d] = uniq[:, d - 1].contiguous()
            self.n_nodes[d] = int(uniq.shape[0])
            # Any item below a node names its ancestors (they are prefixes of its SID).
            rep = torch.empty(self.n_nodes[d], dtype=torch.long).scatter_(0, inv, torch.arange(n_items))
            if d > 1:
                self.anc[d] = torch.stack([self.item_node[j][rep] for j in range(1, d)], dim=1)
            else:
                self.anc[d] = torch.empty((self.n_nodes[d], 0), dtype=torch.long)
        # Cache slot (offset in the tree part of the KV cache) of node 0 of each kept depth.
        self.offset: dict[int, int] = {}
        acc = 0
        for d in range(1, levels):
            self.offset[d] = acc
            acc += self.n_nodes[d]


def _truncate_cache(cache: DynamicCache, length: int) -> None:
    """Drop every cached position at or after `length` (all layers)."""
    for layer in cache.layers:
        cur = layer.get_seq_length()
        if cur <= length:
            continue
        if type(layer) is DynamicLayer:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]
        else:  # pragma: no cover - other layer kinds keep their own bookkeeping
            layer.crop(-(cur - length))


def _check_attention(model: Any) -> None:
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is not None and impl not in MASKABLE_ATTENTION:
        raise ValueError(
            f"score_catalog needs an attention implementation that honours a custom 4D mask "
            f"({', '.join(MASKABLE_ATTENTION)}); the model uses {impl!r}"
        )


# --------------------------------------------------------------------------- scoring
# How `score_catalog` is fast: items share prefixes. Per batch of users the prompts are left-padded and
# prefilled ONCE (attention mask + position ids counting real tokens only, as decode.py does);
# the prefill's last position gives the level-0 distribution. Then, level by level, every
# DISTINCT prefix of length l >= 1 present in the catalog (a node of the SID trie) is fed as ONE
# extra token on top of the prompt's KV cache, in chunks of `prefix_batch` tokens per user.
# All nodes of a user share one batch row (the prompt cache is not copied per prefix): a custom
# 4D attention mask lets each node attend to the user's real prompt tokens, to its ancestors in
# the trie (already in the cache) and to itself, and its position id is prompt_len + l - 1 -- so
# each node sees exactly the sequence prompt + its prefix ("tree attention"). The node's logits
# give the log-probs of the level-l token of every item below it. Nodes of the deepest level
# (most of them) are cropped from the cache after each chunk; shallower nodes stay as ancestors.
# Model work per user: 1 prefill + sum over levels 1..L-1 of #distinct prefixes single-token
# positions, instead of N forwards of prompt + L tokens.
#
# Requirements: a transformers causal LM that accepts `cache=`, `position_ids` and a prepared
# 4D float attention mask ([B, 1, q, kv], 0 = attend, dtype-min = masked) passed through as-is;
# i.e. attention implementation "eager" or "sdpa" over full-attention `DynamicCache` layers
# (flash-attention kernels ignore arbitrary masks, so they are refused).
def score_catalog(
    model: Any,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    sid_token_ids: torch.Tensor,
    *,
    pad_id: int,
    batch_users: int = 4,
    prefix_batch: int = 1024,
    progress: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """Score of EVERY catalog SID for every user. -> FloatTensor [U, N] (on CPU).

    Args:
        model: causal LM (see the comment above for the attention requirement); run in eval
            mode under `torch.no_grad` (the caller's train mode is restored).
        prompts: U prompts (lists of token ids, any lengths) or a LongTensor [U, T].
        sid_token_ids: LongTensor [N, L], row i = SID token ids of catalog item i (the rows of
            `SidTrie`). Duplicate SIDs get equal scores.
        pad_id: left-padding token (masked out).
        batch_users: users per forward (U_b rows).
        prefix_batch: trie nodes fed per forward per user (C); bounds memory at about
            U_b x C x V logits plus a [U_b, 1, C, T + nodes kept + C] mask.
        progress: called as progress(users_done, users_total) after each user batch.

    scores[u, i] = sum_l log_softmax(logits(prompt_u + sids[i, :l]))[sids[i, l]], equal to
    `gti.eval.decode.score_all_sids(model, prompts[u], sid_token_ids)[i]` up to float error.
    """
    sids = torch.as_tensor(sid_token_ids, dtype=torch.long).cpu()
    if sids.ndim != 2 or sids.shape[0] == 0 or sids.shape[1] == 0:
        raise ValueError(f"sid_token_ids must be a non-empty [N, L] tensor, got {list(sids.shape)}")
    if prefix_batch < 1:
        raise ValueError(f"prefix_batch must be >= 1, got {prefix_batch}")
    _check_attention(model)
    prompt_lists = as_prompt_lists(prompts)
    tree = _Tree(sids)
    parts = []
    was_training = bool(getattr(model, "training", False))
    model.eval()
    try:
        for sl in chunks(len(prompt_lists), max(1, batch_users)):
            parts.append(_score_batch(model, prompt_lists[sl], sids, tree, pad_id, prefix_batch))
            if progress is not None:
                progress(sl.stop, len(prompt_lists))
    finally:
        if was_training:
            model.train()
    if not parts:
        return torch.empty((0, sids.shape[0]))
    return torch.cat(parts)


@torch.no_grad()
def _score_batch(
    model: Any,
    prompts: list[list[int]],
    sids: torch.Tensor,
    tree: _Tree,
    pad_id: int,
    prefix_batch: int,
) -> torch.Tensor:
    """Scores [U_b, N] for one batch of users (see `score_catalog`)."""
    device = model_device(model)
    n_users = len(prompts)
    n_items, levels = sids.shape
    ids, pmask, pos = left_pad(prompts, pad_id, device)  # [U_b, T] each
    width = ids.shape[1]
    prompt_len = pmask.sum(-1)  # [U_b] real tokens per user
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=ids, attention_mask=pmask, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1
    )
    logp0 = F.log_softmax(out.logits[:, -1, :].float(), dim=-1)  # [U_b, V]
    del out
    sids_dev = sids.to(device)
    scores = logp0[:, sids_dev[:, 0]]  # [U_b, N], level 0
    del logp0
    if levels == 1:
        return scores.cpu()

    dtype = model.get_input_embeddings().weight.dtype
    neg = torch.finfo(dtype).min
    # Prompt part of every mask row: attend to the user's real tokens only. [U_b, 1, 1, T]
    prompt_add = torch.where(pmask.bool(), 0.0, neg).to(dtype)[:, None, None, :]
    for d in range(1, levels):
        n_nodes = tree.n_nodes[d]
        deepest = d == levels - 1
        token = tree.token[d].to(device)
        anc = tree.anc[d].to(device)  # [P_d, d-1]
        item_node = tree.item_node[d].to(device)  # [N]
        item_tok = sids_dev[:, d]  # [N]
        # Items grouped by their depth-d node, so each chunk's items are one contiguous slice.
        order = torch.argsort(item_node, stable=True)
        bounds = torch.searchsorted(item_node[order], torch.arange(n_nodes + 1, device=device))
        kept = tree.offset[d]  # tree slots of the kept shallower depths
        for sl in chunks(n_nodes, prefix_batch):
            c = sl.stop - sl.start
            # Slots in the cache's tree part: ancestors at their kept slots, the chunk after
            # everything already cached (= offset[d] + sl.start for kept depths, offset[d]
            # at the deepest level, whose chunks are cropped after use).
            past = kept + (0 if deepest else sl.start)
            kv_tree = past + c
            tree_add = torch.full((c, kv_tree), neg, dtype=dtype, device=device)
            rows = torch.arange(c, device=device)
            for j in range(1, d):
                tree_add[rows, tree.offset[j] + anc[sl, j - 1]] = 0.0
            tree_add[rows, past + rows] = 0.0
            mask = torch.cat(
                [prompt_add.expand(n_users, 1, c, width), tree_add[None, None].expand(n_users, 1, c, kv_tree)],
                dim=-1,
            )
            step_pos = (prompt_len + (d - 1)).unsqueeze(-1).expand(n_users, c)
            out = model(
                input_ids=token[sl].unsqueeze(0).expand(n_users, c),
                attention_mask=mask,
                position_ids=step_pos,
                cache=cache,
                use_cache=True,
            )
            logits = out.logits.float()  # [U_b, c, V]
            del out
            lse = torch.logsumexp(logits, dim=-1)  # [U_b, c]
            sel = order[bounds[sl.start] : bounds[sl.stop]]  # items below this chunk's nodes
            local = item_node[sel] - sl.start
            scores[:, sel] += logits[:, local, item_tok[sel]] - lse[:, local]
            del logits, lse
            if deepest:
                _truncate_cache(cache, width + kept)
    del cache
    return scores.cpu()


# --------------------------------------------------------------------------- ranks and metrics
def exact_ranks(scores: torch.Tensor, target_rows: torch.Tensor) -> torch.Tensor:
    """Rank (1 = best) of each user's target among all N items. -> FloatTensor [U].

    scores: FloatTensor [U, N] (higher = better); target_rows: LongTensor [U] in 0..N-1.
    rank = 1 + #items scoring strictly higher + 0.5 x #OTHER items with exactly the target's
    score (mid-rank: a target tied with t others gets the mean of the ranks the tie spans, so
    ties neither help nor hurt on average; with no ties ranks are integers 1..N).
    """
    scores = torch.as_tensor(scores)
    target_rows = torch.as_tensor(target_rows, dtype=torch.long).to(scores.device)
    if scores.ndim != 2 or target_rows.shape != (scores.shape[0],):
        raise ValueError(f"need scores [U, N] and target_rows [U]; got {list(scores.shape)}, {list(target_rows.shape)}")
    n = scores.shape[1]
    if ((target_rows < 0) | (target_rows >= n)).any():
        raise ValueError(f"target rows must be in 0..{n - 1}")
    tgt = scores.gather(1, target_rows.unsqueeze(1))  # [U, 1]
    higher = (scores > tgt).sum(1)
    tied = (scores == tgt).sum(1) - 1  # the target itself is not a tie
    return 1.0 + higher.double() + 0.5 * tied.double()


def rank_metrics(
    ranks: torch.Tensor | np.ndarray | Sequence[float],
    n_items: int,
    bootstrap: int = 1000,
    seed: int = 0,
    groups: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """Rank metrics over U rows from their targets' ranks (1 = best, [U], mid-ranks allowed);
    `groups`: each row's user, whom the CIs resample (`gti.eval.metrics.bootstrap_ci`).

    Returns {"mrr": {"value", "ci": [lo, hi]}, "mean_percentile_rank": {"value", "ci"},
    "median_rank": float, "mean_rank": float, "n_users": U, "n_items": N}:
    MRR = mean of 1/rank (1 = always first); mean percentile rank = mean of (rank-1)/(N-1)
    (0 = always first, 0.5 = chance, 1 = always last; 0 when N == 1). CIs: percentile bootstrap
    over users, `bootstrap` resamples, seeded (`gti.eval.metrics.bootstrap_ci`).
    """
    if isinstance(ranks, torch.Tensor):
        ranks = ranks.detach().double().cpu().numpy()
    r = np.asarray(ranks, dtype=np.float64).reshape(-1)
    if n_items < 1:
        raise ValueError(f"n_items must be >= 1, got {n_items}")
    if r.size and ((r < 1) | (r > n_items)).any():
        raise ValueError(f"ranks must lie in 1..{n_items}")
    rr = 1.0 / r
    pct = (r - 1.0) / (n_items - 1) if n_items > 1 else np.zeros_like(r)

    def table(v: np.ndarray) -> dict[str, Any]:
        lo, hi = bootstrap_ci(v, n_boot=bootstrap, seed=seed, groups=groups)
        return {"value": float(v.mean()) if v.size else 0.0, "ci": [lo, hi]}

    return {
        "mrr": table(rr),
        "mean_percentile_rank": table(pct),
        "median_rank": float(np.median(r)) if r.size else 0.0,
        "mean_rank": float(r.mean()) if r.size else 0.0,
        "n_users": int(r.size),
        "n_items": int(n_items),
    }
