"""What a decoder returns, and the plumbing every decoder over SIDs shares.

What it is for: `DecodeResult` (per user the top-K catalog items with their scores and SIDs,
plus every final beam and the invalid-SID counts), `TrieLike` (what a decoder needs from
`gti.sid.trie.SidTrie`), `finalise` (final beams -> the top-K distinct valid items), the prompt
batching every decoder and scorer uses (`as_prompt_lists`, `left_pad`, `chunks`, `model_device`),
and `topk_agreement` (our search against the transformers peer in tests and
bench/decode/decode.py).

What it does NOT know: how beams are searched (`gti.eval.decode`), transformers `generate`
(`gti.eval.generate`), how prompts are rendered or the trie built, item ids or titles (callers
map trie rows to items), metrics, or Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence

import torch

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


# --------------------------------------------------------------------------- prompt batches
def as_prompt_lists(prompt_ids: Sequence[Sequence[int]] | torch.Tensor) -> list[list[int]]:
    """U prompts as lists of ints: a [U, T] tensor row by row, or sequences (none empty)."""
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


def model_device(model: Any) -> torch.device:
    """Where the model's parameters live (cpu for a model without any)."""
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - a model without parameters is not a model
        return torch.device("cpu")


def chunks(n: int, size: int) -> Iterator[slice]:
    """Consecutive slices of at most `size` over range(n)."""
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


# --------------------------------------------------------------------------- final beams
def finalise(
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


# --------------------------------------------------------------------------- comparing results
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
