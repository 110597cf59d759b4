"""Constrained beam search over semantic IDs, batched across users, with a KV cache.

What it is for: given a causal LM whose vocabulary was extended with SID tokens, a prompt per
user and a `SidTrie` of the catalog, return per user the top-K distinct catalog items the model
ranks highest, with their scores (sum of log-probabilities of the L SID tokens, each a
log-softmax over the FULL vocabulary, so scores equal those of transformers `generate` with
`length_penalty=0`).

How it is fast (MISSION section 7): transformers `generate` copies every prompt to all beams
before the prefill (U users x W beams prompt rows, ~91% of its time). Here the prompts are
left-padded into one batch and prefilled ONCE per user; the KV cache is then repeated across the
W beams (`DynamicCache.batch_repeat_interleave`) and only L-1 single-token steps follow, with
a reorder after each beam selection that moves only the generated positions (a user's beams
share identical prompt rows; `DynamicCache.reorder_cache` would copy the whole cache). The
trie's `allowed()` mask is applied as a tensor over the new-token slice of the log-probs only,
so a step's top-W runs over W x V_new candidates instead of W x V.

Also here: `override_generation_config(model)` (neutralises sampling/top-k/top-p/penalties of a
checkpoint's generation_config, the trap of MISSION section 6) and `generate_with_prefix_fn`,
the peer method (`generate` + `prefix_allowed_tokens_fn` over the same trie, as LC-Rec and
MiniOneRec do), kept as the reference our search is compared with in tests and bench/decode.py.

Forward calls use the transformers 5.24 argument `cache=` (`past_key_values=` is deprecated
there, see `deprecate_kwarg` on `LlamaForCausalLM.forward`).

What it does NOT know: how prompts are rendered (`gti.lm.templates`), how the trie is built
(`gti.sid.trie`), item ids or titles (callers map trie rows to items), metrics, or Ray.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer

NEG_INF = float("-inf")


class TrieLike(Protocol):
    """What the search needs from `gti.sid.trie.SidTrie`."""

    vocab_new_start: int
    vocab_new_end: int

    def allowed(self, prefixes: torch.Tensor) -> torch.Tensor:  # [B, t] -> bool [B, V_new]
        ...

    def item_index(self, sid_ids: torch.Tensor) -> torch.Tensor:  # [B, L] -> long [B], -1 invalid
        ...


@dataclass
class DecodeResult:
    """Top-K per user. U users, K = k, L = SID length, W = beam width.

    items: LongTensor [U, K], trie row of each recommended item, best first; -1 pads a user for
        whom fewer than K valid items were found.
    scores: FloatTensor [U, K], sum of full-vocabulary log-probs of the item's SID; -inf on pads.
    sid_ids: LongTensor [U, K, L], the SID token ids of `items`; -1 on pads.
    beam_sids / beam_scores: [U, W, L] / [U, W], every final beam (valid or not), best first.
    n_returned: beams counted for the invalid rate: the top-K beams of every user that have a
        finite score (a beam is -inf only when the catalog has fewer than K valid items).
    n_invalid: of those, beams whose L tokens are not the SID of any catalog item. Always 0 when
        constrained; in unconstrained mode the items are taken from the valid beams only.
    """

    items: torch.Tensor
    scores: torch.Tensor
    sid_ids: torch.Tensor
    beam_sids: torch.Tensor
    beam_scores: torch.Tensor
    n_returned: int = 0
    n_invalid: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def invalid_sid_rate(self) -> float:
        return self.n_invalid / self.n_returned if self.n_returned else 0.0

    @staticmethod
    def concat(parts: Sequence["DecodeResult"]) -> "DecodeResult":
        if len(parts) == 1:
            return parts[0]
        timings: dict[str, float] = {}
        for p in parts:
            for key, val in p.timings.items():
                timings[key] = timings.get(key, 0.0) + val
        return DecodeResult(
            items=torch.cat([p.items for p in parts]),
            scores=torch.cat([p.scores for p in parts]),
            sid_ids=torch.cat([p.sid_ids for p in parts]),
            beam_sids=torch.cat([p.beam_sids for p in parts]),
            beam_scores=torch.cat([p.beam_scores for p in parts]),
            n_returned=sum(p.n_returned for p in parts),
            n_invalid=sum(p.n_invalid for p in parts),
            timings=timings,
        )


# --------------------------------------------------------------------------- generation config
def override_generation_config(
    model: Any,
    *,
    beam_width: int | None = None,
    k: int | None = None,
    levels: int | None = None,
    pad_id: int | None = None,
) -> GenerationConfig:
    """Replace `model.generation_config` by a neutral beam-search config and return it.

    Instruct checkpoints ship sampling settings (do_sample, temperature, top_k, top_p,
    repetition_penalty, ...). transformers fills every field a caller leaves as None from
    `model.generation_config`, so passing a fresh `GenerationConfig(num_beams=...)` to `generate`
    still inherits them, and a top_k/top_p warper or a penalty silently cuts or reorders valid
    beams. So the model's config itself is replaced by one built from scratch, with every
    scoring-relevant field set explicitly to its neutral value; only token ids are kept.

    `length_penalty=0`: all SIDs have the same length L, so it changes only the scale of the
    reported `sequences_scores`, which then equal the sums of log-probs our search reports.
    """
    old = getattr(model, "generation_config", None)
    keep = {}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        val = getattr(old, name, None) if old is not None else None
        if val is not None:
            keep[name] = val
    if pad_id is not None:
        keep["pad_token_id"] = pad_id
    neutral: dict[str, Any] = dict(
        do_sample=False,
        temperature=1.0,
        # None, not 0: with do_sample=False no warper runs, and transformers warns about a
        # non-default top_k; the checkpoint's value cannot leak back because the model's
        # config is replaced below (None falls through to the global default, inert here).
        top_k=None,
        top_p=1.0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        length_penalty=0.0,
        early_stopping=False,
        min_length=0,
        use_cache=True,
        num_beam_groups=1,
        diversity_penalty=0.0,
        renormalize_logits=False,
        remove_invalid_values=False,
    )
    if beam_width is not None:
        neutral["num_beams"] = beam_width
    if k is not None:
        neutral["num_return_sequences"] = k
    if levels is not None:
        neutral["max_new_tokens"] = levels
    cfg = GenerationConfig(**keep)
    for name, val in neutral.items():
        # Set one by one: some fields (num_beam_groups, diversity_penalty) may not exist in every
        # transformers release, and an unknown one must not stop the others.
        setattr(cfg, name, val)
    model.generation_config = cfg
    return cfg


# --------------------------------------------------------------------------- helpers
def _as_prompt_lists(prompt_ids: Sequence[Sequence[int]] | torch.Tensor) -> list[list[int]]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 2:
            raise ValueError(f"prompt_ids tensor must be [U, T], got shape {tuple(prompt_ids.shape)}")
        return [row.tolist() for row in prompt_ids]
    out = [list(map(int, p)) for p in prompt_ids]
    empty = [i for i, p in enumerate(out) if not p]
    if empty:
        raise ValueError(f"prompt {empty[0]} is empty")
    return out


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | str = "cpu"):
    """Left-pad prompts into ids [U, T], attention mask [U, T] (1 = real) and position ids
    [U, T] that count only real tokens (the convention `generate` uses), so a user's logits do
    not depend on who else is in the batch."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids.to(device), mask.to(device), pos.to(device)


def _model_device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - a model without parameters is not a model
        return torch.device("cpu")


def _chunks(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


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
        batch_users: users per forward batch (U_b prompt rows at prefill, U_b x W rows after).
        progress: called as progress(users_done, users_total) after each batch.

    Returns: `DecodeResult` with items [U, K], scores [U, K], sid_ids [U, K, L].
    """
    if not 1 <= k <= beam_width:
        raise ValueError(f"k={k} must be in 1..beam_width={beam_width}")
    if levels < 1:
        raise ValueError(f"levels must be >= 1, got {levels}")
    prompts = _as_prompt_lists(prompt_ids)
    parts = []
    # Validation during training calls this on a model in train mode: dropout must be off for
    # the search, and the caller's mode is restored afterwards.
    was_training = bool(getattr(model, "training", False))
    model.eval()
    try:
        for sl in _chunks(len(prompts), max(1, batch_users)):
            parts.append(
                _search_batch(model, prompts[sl], trie, beam_width, k, levels, pad_id, constrained)
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


def _step_candidates(
    logits: torch.Tensor,
    prefixes: torch.Tensor,
    trie: TrieLike,
    constrained: bool,
) -> tuple[torch.Tensor, int]:
    """Log-probs of the next token for each row, restricted to the searched token range.

    logits: [R, V] (last position); prefixes: [R, t] SID tokens generated so far.
    Returns (logp [R, C], offset): candidate c is token id offset + c. Constrained: C = V_new
    (the new-token slice, disallowed entries -inf); unconstrained: C = V, offset 0.
    """
    # Full-vocabulary normalisation, so scores match generate's log_softmax + masking.
    logp = F.log_softmax(logits.float(), dim=-1)
    if not constrained:
        return logp, 0
    lo, hi = trie.vocab_new_start, trie.vocab_new_end
    sub = logp[:, lo:hi]
    allowed = trie.allowed(prefixes).to(sub.device)
    return sub.masked_fill(~allowed, NEG_INF), lo


@torch.no_grad()
def _search_batch(
    model: Any,
    prompts: list[list[int]],
    trie: TrieLike,
    width: int,
    k: int,
    levels: int,
    pad_id: int,
    constrained: bool,
) -> DecodeResult:
    t0 = time.perf_counter()
    device = _model_device(model)
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
    logp, offset = _step_candidates(out.logits[:, -1, :], empty_prefix, trie, constrained)
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
            out.logits[:, -1, :], seqs.reshape(n_users * width, step), trie, constrained
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
    return _finalise(seqs, beam_scores, trie, k, {"prefill_s": t_prefill, "total_s": time.perf_counter() - t0})


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


def _finalise(
    seqs: torch.Tensor, beam_scores: torch.Tensor, trie: TrieLike, k: int, timings: dict[str, float]
) -> DecodeResult:
    """Top-K distinct valid items from the final beams (seqs [U, W, L], scores [U, W] sorted)."""
    n_users, width, levels = seqs.shape
    seqs, beam_scores = seqs.cpu(), beam_scores.float().cpu()
    rows = trie.item_index(seqs.reshape(-1, levels)).view(n_users, width).cpu()
    finite = torch.isfinite(beam_scores)
    valid = (rows >= 0) & finite
    top = finite[:, :k]
    n_returned = int(top.sum())
    n_invalid = int((top & (rows[:, :k] < 0)).sum())
    # Distinct beams are distinct token sequences, hence distinct items; keep valid beams in
    # score order (stable: valid first, then by rank).
    rank = torch.arange(width).expand(n_users, width)
    order = torch.where(valid, rank, rank + width).argsort(dim=1, stable=True)[:, :k]
    keep = valid.gather(1, order)
    items = torch.where(keep, rows.gather(1, order), torch.full_like(order, -1))
    scores = torch.where(keep, beam_scores.gather(1, order), torch.full((n_users, k), NEG_INF))
    sid = seqs.gather(1, order.unsqueeze(-1).expand(-1, -1, levels))
    sid = torch.where(keep.unsqueeze(-1), sid, torch.full_like(sid, -1))
    return DecodeResult(
        items=items,
        scores=scores,
        sid_ids=sid,
        beam_sids=seqs,
        beam_scores=beam_scores,
        n_returned=n_returned,
        n_invalid=n_invalid,
        timings=timings,
    )


# --------------------------------------------------------------------------- exhaustive reference
@torch.inference_mode()
def score_all_sids(
    model: Any, prompt: Sequence[int], sid_token_ids: torch.Tensor, *, batch: int = 256
) -> torch.Tensor:
    """Teacher-forced score of every SID for one prompt: sum over the L tokens of the
    full-vocabulary log-prob. sid_token_ids: [N, L] -> FloatTensor [N]. Exact but O(N) forwards
    of L tokens (after one shared prefill); the ground truth for tests on small catalogs."""
    device = _model_device(model)
    prompt_t = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    n_items, levels = sid_token_ids.shape
    out_scores = []
    for sl in _chunks(n_items, batch):
        sids = sid_token_ids[sl].to(device)
        rows = sids.shape[0]
        ids = torch.cat([prompt_t.expand(rows, -1), sids[:, :-1]], dim=1)
        logits = model(input_ids=ids, logits_to_keep=levels).logits.float()  # [rows, L, V]
        logp = F.log_softmax(logits, dim=-1)
        out_scores.append(logp.gather(-1, sids.unsqueeze(-1)).squeeze(-1).sum(-1).cpu())
    return torch.cat(out_scores)


# --------------------------------------------------------------------------- the peer method
def make_prefix_allowed_tokens_fn(
    trie: TrieLike, prompt_len: int
) -> Callable[[int, torch.Tensor], list[int]]:
    """`prefix_allowed_tokens_fn` for `generate`: allowed next tokens after the SID tokens that
    follow the (left-padded, hence common) prompt length. Called once per beam per step, the way
    LC-Rec / MiniOneRec use it."""

    def fn(batch_id: int, input_ids: torch.Tensor) -> list[int]:
        prefix = input_ids[prompt_len:].unsqueeze(0).cpu()
        allowed = trie.allowed(prefix)[0]
        return (allowed.nonzero().squeeze(-1) + trie.vocab_new_start).tolist()

    return fn


@torch.inference_mode()
def generate_with_prefix_fn(
    model: Any,
    prompt_ids: Sequence[Sequence[int]] | torch.Tensor,
    trie: TrieLike,
    *,
    beam_width: int,
    k: int,
    levels: int,
    pad_id: int,
    constrained: bool = True,
    batch_users: int = 8,
    generation_config: GenerationConfig | None = None,
) -> DecodeResult:
    """The peer: transformers `generate` (beam search, num_return_sequences=k) with
    `prefix_allowed_tokens_fn` over the same trie. `generation_config` defaults to
    `override_generation_config(model, ...)`; pass the model's own config to see the trap.
    Returns a DecodeResult comparable with `constrained_beam_search` (beam_* hold the K
    returned sequences)."""
    if generation_config is None:
        generation_config = override_generation_config(
            model, beam_width=beam_width, k=k, levels=levels, pad_id=pad_id
        )
    run_cfg = copy.deepcopy(generation_config)
    # sequences_scores needs both (LC-Rec asks for them the same way).
    run_cfg.return_dict_in_generate = True
    run_cfg.output_scores = True
    prompts = _as_prompt_lists(prompt_ids)
    device = _model_device(model)
    parts = []
    for sl in _chunks(len(prompts), max(1, batch_users)):
        t0 = time.perf_counter()
        ids, mask, _ = left_pad(prompts[sl], pad_id, device)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=run_cfg,
            prefix_allowed_tokens_fn=make_prefix_allowed_tokens_fn(trie, ids.shape[1]) if constrained else None,
        )
        n = ids.shape[0]
        gen = out.sequences[:, ids.shape[1] :]
        if gen.shape[1] < levels:  # finished early on EOS (only possible unconstrained)
            gen = F.pad(gen, (0, levels - gen.shape[1]), value=pad_id)
        gen = gen[:, :levels].reshape(n, k, levels)
        scores = out.sequences_scores.float().reshape(n, k)
        parts.append(_finalise(gen, scores, trie, k, {"total_s": time.perf_counter() - t0}))
    return DecodeResult.concat(parts)


def topk_agreement(
    a: DecodeResult, b: DecodeResult, *, atol: float = 1e-3
) -> dict[str, Any]:
    """Compare two top-K results user by user, treating near-ties as equal.

    A user agrees when, position by position, the scores match within `atol` and the items are
    the same, except inside groups of positions whose scores lie within `atol` of each other
    (near-ties), where only the set of items must match. Also counts users whose K-th item
    differs only because the (K+1)-th candidate was tied (items differ but scores match).
    Returns {identical_users, users, exact_users, max_score_diff, mismatched_users: [idx]}.
    """
    n_users = a.items.shape[0]
    exact = tie_ok = 0
    mismatched = []
    max_diff = 0.0
    for u in range(n_users):
        ia, ib = a.items[u].tolist(), b.items[u].tolist()
        sa, sb = a.scores[u].tolist(), b.scores[u].tolist()
        fin = [(x, y) for x, y in zip(sa, sb) if math.isfinite(x) and math.isfinite(y)]
        diffs = [abs(x - y) for x, y in fin]
        max_diff = max([max_diff, *diffs])
        if ia == ib and all(d <= atol for d in diffs):
            exact += 1
            continue
        # Near-tie groups: consecutive positions of `a` whose scores are within atol.
        ok = len(fin) == len(sa) and all(d <= atol for d in diffs)
        if ok:
            start = 0
            for pos in range(1, len(sa) + 1):
                if pos == len(sa) or abs(sa[pos] - sa[pos - 1]) > atol:
                    group_a, group_b = set(ia[start:pos]), set(ib[start:pos])
                    last_group = pos == len(sa)
                    # The last group may be cut by K inside a tie: items may differ there.
                    if group_a != group_b and not last_group:
                        ok = False
                        break
                    start = pos
        if ok:
            tie_ok += 1
        else:
            mismatched.append(u)
    return {
        "users": n_users,
        "exact_users": exact,
        "identical_users": exact + tie_ok,
        "max_score_diff": max_diff,
        "mismatched_users": mismatched,
    }
