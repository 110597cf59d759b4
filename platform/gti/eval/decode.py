"""Constrained beam search over semantic IDs, batched across users, with a KV cache.

What it is for: given a causal LM whose vocabulary was extended with SID tokens, a prompt per
user and a `SidTrie` of the catalog, return per user the top-K distinct catalog items the model
ranks highest, with their scores (the sum of the L SID tokens' log-probs over the FULL
vocabulary, so they equal transformers `generate`'s with `length_penalty=0`), faster than
`generate` (how: the comment above `_search_batch`). Also here: `score_all_sids`, the
exhaustive teacher-forced reference. The result type, trie protocol and padding live in
`gti.eval.beams`; the peer method (`generate` over the same trie) in `gti.eval.generate`.

What it does NOT know: how prompts are rendered (`gti.lm.templates`), how the trie is built
(`gti.sid.trie`), item ids or titles (callers map trie rows to items), metrics, or Ray.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from gti.eval.beams import NEG_INF, DecodeResult, TrieLike, as_prompt_lists, chunks, finalise, left_pad, model_device


# --------------------------------------------------------------------------- our search
def constrained_beam_search(
    model: Any,
    prompt_ids: Sequence[Sequence[int]] | torch.Tensor,
    trie: TrieLike,
    *,
    beam_width: int,
    k: int,
    levels: int,
    pad_id: int,
    constrained: bool = True,
    normalise: str = "vocab",
    batch_users: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> DecodeResult:
    """Beam search of width W = `beam_width` over L = `levels` SID tokens for every prompt.

    Args:
        model: a causal LM (transformers, supports `cache=` / `attention_mask` / `position_ids`
            / `logits_to_keep`); run in eval mode (a training model is switched back after)
            under `torch.no_grad` (not inference_mode: ZeRO-3 gathers parameters inside the
            forward, and inference tensors would leak into training); its generation_config is
            ignored. Every call runs the same number of forwards for the same number of
            prompts, so ranks of a sharded model stay in step.
        prompt_ids: U prompts (lists of token ids, any lengths) or a LongTensor [U, T] of
            unpadded prompts of equal length.
        trie: the catalog's `SidTrie` (new-token slice [vocab_new_start, vocab_new_end)).
        k: items returned per user (K <= W).
        pad_id: token used for left padding (masked out; its value does not matter).
        constrained: mask every token that does not extend a catalog SID (and every non-SID
            token) to -inf. False = free search over the whole vocabulary, for comparison.
        normalise: "vocab" = each step's log-probs over the full vocabulary (generate's scores);
            "trie" = over the catalog children of the beam's prefix only, so an item's score is
            its log-prob under the model's distribution restricted to catalog items (needs
            constrained).
        batch_users: users per forward batch (U_b prompt rows at prefill, U_b x W rows after).
        progress: called as progress(users_done, users_total) after each batch.

    Returns: `DecodeResult` with items [U, K], scores [U, K], sid_ids [U, K, L].
    """
    if not 1 <= k <= beam_width:
        raise ValueError(f"k={k} must be in 1..beam_width={beam_width}")
    if levels < 1:
        raise ValueError(f"levels must be >= 1, got {levels}")
    if normalise not in NORMALISE:
        raise ValueError(f"normalise={normalise!r} is not one of {NORMALISE}")
    if normalise == "trie" and not constrained:
        raise ValueError("normalise='trie' needs constrained=True (it normalises over the trie's children)")
    prompts = as_prompt_lists(prompt_ids)
    parts = []
    # Validation during training calls this on a model in train mode: dropout must be off for
    # the search, and the caller's mode is restored afterwards.
    was_training = bool(getattr(model, "training", False))
    model.eval()
    try:
        for sl in chunks(len(prompts), max(1, batch_users)):
            parts.append(
                _search_batch(model, prompts[sl], trie, beam_width, k, levels, pad_id, constrained, normalise)
            )
            if progress is not None:
                progress(sl.stop, len(prompts))
    finally:
        if was_training:
            model.train()
    if not parts:
        empty = torch.empty
        return DecodeResult(
            items=empty((0, k), dtype=torch.long),
            scores=empty((0, k)),
            sid_ids=empty((0, k, levels), dtype=torch.long),
            beam_sids=empty((0, beam_width, levels), dtype=torch.long),
            beam_scores=empty((0, beam_width)),
        )
    return DecodeResult.concat(parts)


NORMALISE = ("vocab", "trie")


def _step_candidates(
    logits: torch.Tensor,
    prefixes: torch.Tensor,
    trie: TrieLike,
    constrained: bool,
    normalise: str = "vocab",
) -> tuple[torch.Tensor, int]:
    """Log-probs of the next token for each row, restricted to the searched token range.

    logits: [R, V] (last position); prefixes: [R, t] SID tokens generated so far.
    Returns (logp [R, C], offset): candidate c is token id offset + c. Constrained: C = V_new
    (the new-token slice, disallowed entries -inf); unconstrained: C = V, offset 0.
    normalise "vocab": log_softmax over all V (generate's scores); "trie": over each row's
    allowed children only (a row's finite entries then sum to probability 1).
    """
    if not constrained:
        return F.log_softmax(logits.float(), dim=-1), 0
    lo, hi = trie.vocab_new_start, trie.vocab_new_end
    allowed = trie.allowed(prefixes).to(logits.device)
    if normalise == "trie":
        # The second mask turns a row with no allowed child (a padded beam: all -inf -> NaN) back to -inf.
        sub = F.log_softmax(logits[:, lo:hi].float().masked_fill(~allowed, NEG_INF), dim=-1)
        return sub.masked_fill(~allowed, NEG_INF), lo
    # Full-vocabulary normalisation, so scores match generate's log_softmax + masking.
    sub = F.log_softmax(logits.float(), dim=-1)[:, lo:hi]
    return sub.masked_fill(~allowed, NEG_INF), lo


@torch.no_grad()
# How the search is fast (bench/decode/RESULTS.md, "Constrained decoding"): transformers `generate` copies
# every prompt to all beams before the prefill (U users x W beams prompt rows, most of its time).
# Here the prompts are left-padded into one batch and prefilled ONCE per user; the KV cache is
# then repeated across the W beams (`DynamicCache.batch_repeat_interleave`) and only L-1
# single-token steps follow, with a reorder after each beam selection that moves only the
# generated positions (a user's beams share identical prompt rows; `DynamicCache.reorder_cache`
# would copy the whole cache). The trie's `allowed()` mask is applied as a tensor over the
# new-token slice of the log-probs only, so a step's top-W runs over W x V_new candidates
# instead of W x V.
# Forward calls use the transformers 5.24 argument `cache=` (`past_key_values=` is deprecated
# there, see `deprecate_kwarg` on `LlamaForCausalLM.forward`).
def _search_batch(
    model: Any,
    prompts: list[list[int]],
    trie: TrieLike,
    width: int,
    k: int,
    levels: int,
    pad_id: int,
    constrained: bool,
    normalise: str = "vocab",
) -> DecodeResult:
    t0 = time.perf_counter()
    device = model_device(model)
    n_users = len(prompts)
    ids, mask, pos = left_pad(prompts, pad_id, device)
    cache = DynamicCache(config=model.config)
    # Prefill once per user; only the last position's logits are needed.
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    t_prefill = time.perf_counter() - t0

    empty_prefix = torch.empty((n_users, 0), dtype=torch.long, device=device)
    logp, offset = _step_candidates(out.logits[:, -1, :], empty_prefix, trie, constrained, normalise)
    del out
    n_cand = logp.shape[1]
    if n_cand < width:  # fewer candidate tokens than beams (tiny vocabularies): pad with -inf
        logp = F.pad(logp, (0, width - n_cand), value=NEG_INF)
    beam_scores, tok = logp.topk(width, dim=-1)  # [U, W]
    tok = tok.clamp_max(n_cand - 1) + offset
    seqs = tok.unsqueeze(-1)  # [U, W, 1]

    if levels > 1:
        cache.batch_repeat_interleave(width)
        mask = mask.repeat_interleave(width, dim=0)  # [U*W, T]
        next_pos = pos[:, -1].repeat_interleave(width) + 1  # [U*W]
        user_base = (torch.arange(n_users, device=device) * width).unsqueeze(-1)  # [U, 1]
        ones = torch.ones((n_users * width, 1), dtype=mask.dtype, device=device)
    for step in range(1, levels):
        mask = torch.cat([mask, ones], dim=-1)
        out = model(
            input_ids=seqs[:, :, -1].reshape(-1, 1),
            attention_mask=mask,
            position_ids=(next_pos + (step - 1)).unsqueeze(-1),
            cache=cache,
            use_cache=True,
        )
        logp, offset = _step_candidates(
            out.logits[:, -1, :], seqs.reshape(n_users * width, step), trie, constrained, normalise
        )
        del out
        n_cand = logp.shape[1]
        # [U, W, C] -> [U, W*C]: the best W continuations of all beams of a user.
        total = (beam_scores.unsqueeze(-1) + logp.view(n_users, width, n_cand)).view(n_users, -1)
        beam_scores, flat = total.topk(width, dim=-1)
        src_beam = flat // n_cand
        tok = flat % n_cand + offset
        seqs = torch.cat([seqs.gather(1, src_beam.unsqueeze(-1).expand(-1, -1, step)), tok.unsqueeze(-1)], -1)
        if step < levels - 1:
            _reorder_beams(cache, (user_base + src_beam).reshape(-1), ids.shape[1])
    del cache
    return finalise(seqs, beam_scores, trie, k, {"prefill_s": t_prefill, "total_s": time.perf_counter() - t0})


def _reorder_beams(cache: DynamicCache, rows: torch.Tensor, prompt_len: int) -> None:
    """Reorder the cache rows to `rows` [U*W] (each index stays within its user's W rows).

    A user's W beams share the same prompt keys/values (they were repeated from one prefill),
    so only the generated positions [prompt_len:] need moving: an in-place index_select of
    (t, not P + t) positions per row. Layers of another kind fall back to `reorder_cache`.
    """
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if type(layer) is DynamicLayer and keys is not None and keys.dim() == 4:
            layer.keys[:, :, prompt_len:] = layer.keys[:, :, prompt_len:].index_select(0, rows)
            layer.values[:, :, prompt_len:] = layer.values[:, :, prompt_len:].index_select(0, rows)
        else:
            layer.reorder_cache(rows)


# --------------------------------------------------------------------------- exhaustive reference
@torch.inference_mode()
def score_all_sids(
    model: Any, prompt: Sequence[int], sid_token_ids: torch.Tensor, *, batch: int = 256
) -> torch.Tensor:
    """Teacher-forced score of every SID for one prompt: sum over the L tokens of the
    full-vocabulary log-prob. sid_token_ids: [N, L] -> FloatTensor [N]. Exact but O(N) forwards
    of L tokens (after one shared prefill); the ground truth for tests on small catalogs."""
    device = model_device(model)
    prompt_t = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    n_items, levels = sid_token_ids.shape
    out_scores = []
    for sl in chunks(n_items, batch):
        sids = sid_token_ids[sl].to(device)
        rows = sids.shape[0]
        ids = torch.cat([prompt_t.expand(rows, -1), sids[:, :-1]], dim=1)
        logits = model(input_ids=ids, logits_to_keep=levels).logits.float()  # [rows, L, V]
        logp = F.log_softmax(logits, dim=-1)
        out_scores.append(logp.gather(-1, sids.unsqueeze(-1)).squeeze(-1).sum(-1).cpu())
    return torch.cat(out_scores)

