"""Rollouts for RL: G candidate SIDs per prompt from the policy, always valid catalog SIDs, and
the training batch that scores them.

What it is for: the rollout step of GRPO (`rl.rollout`). `beam_rollouts` takes the G best
distinct items of gti's batched constrained beam search (`gti.eval.decode`); `sample_rollouts`
draws G SIDs per prompt with a temperature under the trie mask. Both return `Rollouts`,
candidates best first by their sequence log-prob (the score beam search ranks by).
`completion_batch` builds the right-padded batch that `gti.rl.grpo.labelled_logprobs` scores.

What it does not know: rewards, advantages, the loss, how prompts were rendered, how the trie
was built, codes (map `items` through the SID map for those), or Ray.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from gti.eval.beams import TrieLike, as_prompt_lists, chunks, left_pad, model_device
from gti.eval.decode import constrained_beam_search
from gti.train.loss import IGNORE_INDEX

MODES = ("beam", "sample")


@dataclass
class Rollouts:
    """G candidates for each of B prompts, best first (L = SID levels).

    sid_ids: LongTensor [B, G, L], the SID token ids of each completion (every row a catalog
        SID of the trie).
    items: LongTensor [B, G], the trie row (item) of each completion.
    scores: FloatTensor [B, G], sum of the L full-vocabulary log-probs at temperature 1.
    mode: "beam" (candidates distinct within a prompt) or "sample" (duplicates possible).
    timings: seconds: `rollout_s` (the whole call) and `prefill_s` (the prompt forwards).
    """

    sid_ids: torch.Tensor
    items: torch.Tensor
    scores: torch.Tensor
    mode: str
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def group_size(self) -> int:
        return int(self.sid_ids.shape[1])

    def candidates(self) -> list[list[tuple[int, ...]]]:
        """[B][G] SID token-id tuples, the input `gti.rl.rewards` takes."""
        return [[tuple(s) for s in group] for group in self.sid_ids.tolist()]


def _check(group_size: int, levels: int) -> None:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if levels < 1:
        raise ValueError(f"levels must be >= 1, got {levels}")


def beam_rollouts(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    trie: TrieLike,
    *,
    group_size: int,
    levels: int,
    pad_id: int,
    beam_width: int | None = None,
    batch_users: int = 8,
) -> Rollouts:
    """The G = `group_size` best distinct catalog items per prompt by constrained beam search
    (`gti.eval.decode.constrained_beam_search` with k = G and width max(beam_width, G)).
    prompt_ids: B token-id lists (any lengths). ValueError when the catalog has fewer than G
    items (a group could not be filled)."""
    _check(group_size, levels)
    t0 = time.perf_counter()
    width = max(int(beam_width or group_size), group_size)
    res = constrained_beam_search(
        model, as_prompt_lists(prompt_ids), trie, beam_width=width, k=group_size, levels=levels,
        pad_id=pad_id, batch_users=batch_users,
    )
    if (res.items < 0).any():
        raise ValueError(f"beam rollouts need at least group_size={group_size} catalog items per prompt; "
                         "the trie holds fewer")
    timings = {"rollout_s": time.perf_counter() - t0, "prefill_s": float(res.timings.get("prefill_s", 0.0))}
    return Rollouts(sid_ids=res.sid_ids, items=res.items, scores=res.scores, mode="beam", timings=timings)


def sample_rollouts(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    trie: TrieLike,
    *,
    group_size: int,
    levels: int,
    pad_id: int,
    temperature: float = 1.0,
    batch_users: int = 8,
    seed: int | None = None,
) -> Rollouts:
    """G = `group_size` SIDs per prompt sampled token by token from softmax(logits / T)
    restricted to the tokens the trie allows after the prefix (so every sample is a catalog
    SID), sorted best first by their sequence log-prob: one prefill per prompt, the cache
    repeated G times, then L-1 single-token steps; duplicates allowed. Runs in eval mode under
    no_grad (the caller's mode is restored). seed: for a reproducible draw (a generator on the
    model's device); None uses torch's global RNG."""
    _check(group_size, levels)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    prompts = as_prompt_lists(prompt_ids)
    device = model_device(model)
    gen = torch.Generator(device=device).manual_seed(int(seed)) if seed is not None else None
    t0 = time.perf_counter()
    parts: list[tuple[torch.Tensor, torch.Tensor, float]] = []
    was_training = bool(getattr(model, "training", False))
    model.eval()
    try:
        for sl in chunks(len(prompts), max(1, batch_users)):
            parts.append(_sample_batch(model, prompts[sl], trie, group_size, levels, pad_id, temperature, gen))
    finally:
        if was_training:
            model.train()
    sids = torch.cat([p[0] for p in parts]) if parts else torch.empty((0, group_size, levels), dtype=torch.long)
    scores = torch.cat([p[1] for p in parts]) if parts else torch.empty((0, group_size))
    order = scores.argsort(dim=1, descending=True, stable=True)
    scores = scores.gather(1, order)
    sids = sids.gather(1, order.unsqueeze(-1).expand_as(sids))
    items = trie.item_index(sids.reshape(-1, levels)).view(len(prompts), group_size).cpu()
    timings = {"rollout_s": time.perf_counter() - t0, "prefill_s": sum(p[2] for p in parts)}
    return Rollouts(sid_ids=sids, items=items, scores=scores, mode="sample", timings=timings)


@torch.no_grad()
def _sample_batch(
    model: Any, prompts: list[list[int]], trie: TrieLike, g: int, levels: int, pad_id: int,
    temperature: float, gen: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Samples for U prompts: (sid_ids [U, G, L] cpu, scores [U, G] cpu float32, prefill seconds)."""
    t0 = time.perf_counter()
    device = model_device(model)
    n_users = len(prompts)
    ids, mask, pos = left_pad(prompts, pad_id, device)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1, :].repeat_interleave(g, dim=0)  # [U*G, V]
    del out
    t_prefill = time.perf_counter() - t0
    rows = n_users * g
    if levels > 1:
        cache.batch_repeat_interleave(g)
        mask = mask.repeat_interleave(g, dim=0)  # [U*G, T]
        next_pos = pos[:, -1].repeat_interleave(g) + 1  # [U*G]
        ones = torch.ones((rows, 1), dtype=mask.dtype, device=device)
    seqs = torch.empty((rows, 0), dtype=torch.long, device=device)
    score = torch.zeros(rows, dtype=torch.float32, device=device)
    lo, hi = trie.vocab_new_start, trie.vocab_new_end
    for step in range(levels):
        if step > 0:
            mask = torch.cat([mask, ones], dim=-1)
            out = model(input_ids=seqs[:, -1:], attention_mask=mask, position_ids=(next_pos + (step - 1)).unsqueeze(-1),
                        cache=cache, use_cache=True)
            logits = out.logits[:, -1, :]
            del out
        logp = F.log_softmax(logits.float(), dim=-1)[:, lo:hi]  # [U*G, V_new], full-vocabulary normalised
        allowed = trie.allowed(seqs).to(device)
        if not allowed.any(dim=1).all():  # pragma: no cover - a trie prefix always has a child
            raise RuntimeError("a sampled SID prefix has no continuation in the trie")
        probs = torch.softmax((logp / temperature).masked_fill(~allowed, float("-inf")), dim=-1)
        local = torch.multinomial(probs, 1, generator=gen)  # [U*G, 1]
        score += logp.gather(1, local).squeeze(1)
        seqs = torch.cat([seqs, local + lo], dim=1)
    del cache
    return seqs.view(n_users, g, levels).cpu(), score.view(n_users, g).cpu(), t_prefill


def rollout(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    trie: TrieLike,
    *,
    mode: str,
    group_size: int,
    levels: int,
    pad_id: int,
    beam_width: int | None = None,
    temperature: float = 1.0,
    batch_users: int = 8,
    seed: int | None = None,
) -> Rollouts:
    """`beam_rollouts` or `sample_rollouts` by `mode` ("beam" | "sample", the `rl.rollout`
    setting); arguments of the other mode are ignored."""
    if mode == "beam":
        return beam_rollouts(model, prompt_ids, trie, group_size=group_size, levels=levels, pad_id=pad_id,
                             beam_width=beam_width, batch_users=batch_users)
    if mode == "sample":
        return sample_rollouts(model, prompt_ids, trie, group_size=group_size, levels=levels, pad_id=pad_id,
                               temperature=temperature, batch_users=batch_users, seed=seed)
    raise ValueError(f"unknown rollout mode {mode!r}; expected one of {list(MODES)}")


def completion_batch(prompt_ids: Sequence[Sequence[int]], rollouts: Rollouts, pad_id: int) -> dict[str, torch.Tensor]:
    """The training batch of B prompts x G completions, prompt-major (row b*G + g is prompt b
    followed by candidate g), right-padded like `gti.train.shards.PadCollate`:
    input_ids LongTensor [B*G, T] (pad_id after the row's end), attention_mask [B*G, T]
    (1 = token), labels [B*G, T] (the L SID tokens at their own positions, IGNORE_INDEX on the
    prompt and the padding). T = longest prompt + L."""
    prompts = as_prompt_lists(prompt_ids)
    n, g, levels = rollouts.sid_ids.shape
    if n != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but rollouts for {n}")
    width = max(len(p) for p in prompts) + levels if prompts else levels
    ids = torch.full((n * g, width), int(pad_id), dtype=torch.long)
    labels = torch.full((n * g, width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((n * g, width), dtype=torch.long)
    sids = rollouts.sid_ids.cpu()
    for b, p in enumerate(prompts):
        plen = len(p)
        rows = slice(b * g, (b + 1) * g)
        ids[rows, :plen] = torch.tensor(p, dtype=torch.long)
        ids[rows, plen: plen + levels] = sids[b]
        labels[rows, plen: plen + levels] = sids[b]
        mask[rows, : plen + levels] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
