"""Chat-template mechanics the renderers share: the skeleton around one user turn, template
parsing into text and slots, and fitting token segments into a length budget.

What it is for: `chat_skeleton(tokenizer, system_prompt)` renders the chat template ONCE around
a placeholder user turn (`prefix_ids`, `suffix_ids`, `eot_ids`: what closes an assistant turn,
trailing whitespace dropped), cached per tokenizer; `end_of_turn_ids`; `parse_template` (a
template's literal text and `{slot}`s; a space before a text slot moves into the slot);
`fit_segments` (cut the longest cuttable segments first until a row fits). Used by
`gti.lm.templates` (grounding pairs, recommendation prompts).

What it does not know: which tasks or templates exist, SIDs, or models. No torch needed.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field
from typing import Any

from gti.common.errors import ConfigError

IGNORE = -100
_PH_USER = "\ue000gti-user\ue001"
_PH_ANSWER = "\ue000gti-answer\ue001"
_SLOT_RE = re.compile(r"\{(\w+)\}")


# --------------------------------------------------------------------------- tokenizer helpers
def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _encode_many(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    nonempty = [t if t else " " for t in texts]
    enc = tokenizer(nonempty, add_special_tokens=False)["input_ids"]
    return [list(ids) if t else [] for t, ids in zip(texts, enc)]


def _render_chat(tokenizer, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("model.name: the tokenizer has no chat template; gti needs an instruct/chat model")
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


@dataclass(frozen=True)
class ChatSkeleton:
    """Token ids around one user turn: prompt = prefix_ids + user ids + suffix_ids."""

    prefix_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]
    eot_ids: tuple[int, ...]


def _messages(system_prompt: str, user: str) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return msgs + [{"role": "user", "content": user}]


def _build_skeleton(tokenizer, system_prompt: str) -> ChatSkeleton:
    text = _render_chat(tokenizer, _messages(system_prompt, _PH_USER), True)
    if text.count(_PH_USER) != 1:
        raise ConfigError("model.name: the chat template does not render the user message verbatim")
    pre, post = text.split(_PH_USER)
    full = _render_chat(
        tokenizer, _messages(system_prompt, "q") + [{"role": "assistant", "content": _PH_ANSWER}], False
    )
    eot = _encode(tokenizer, full.split(_PH_ANSWER, 1)[1]) if _PH_ANSWER in full else []
    # Trailing whitespace after the end-of-turn token is not part of what the model must emit.
    while eot and not tokenizer.decode([eot[-1]]).strip():
        eot.pop()
    if not eot:
        if tokenizer.eos_token_id is None:
            raise ConfigError("model.name: cannot tell how an assistant turn ends (no eos token)")
        eot = [tokenizer.eos_token_id]
    return ChatSkeleton(tuple(_encode(tokenizer, pre)), tuple(_encode(tokenizer, post)), tuple(eot))


_SKELETONS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def chat_skeleton(tokenizer, system_prompt: str) -> ChatSkeleton:
    """Cached per (tokenizer object, system prompt, tokenizer length)."""
    try:
        per_tok = _SKELETONS.setdefault(tokenizer, {})
    except TypeError:  # an object that cannot be weakly referenced: no cache
        return _build_skeleton(tokenizer, system_prompt)
    key = (system_prompt, len(tokenizer), tokenizer.chat_template)
    if key not in per_tok:
        per_tok[key] = _build_skeleton(tokenizer, system_prompt)
    return per_tok[key]


def end_of_turn_ids(tokenizer) -> list[int]:
    """Ids that close an assistant turn in this chat template (e.g. [<|im_end|>])."""
    return list(chat_skeleton(tokenizer, "").eot_ids)


# --------------------------------------------------------------------------- template parsing
@dataclass
class _Piece:
    kind: str  # "text" (fixed template text), "slot" (title/description/sid/history)
    value: str  # literal text or slot name
    ids: list[int] = field(default_factory=list)


def parse_template(template: str, allowed: set[str], name: str) -> list[_Piece]:
    """Split a template into literal text and slots; a space right before a text slot moves
    into the slot (see module doc). ConfigError names the template on an unknown slot."""
    pieces: list[_Piece] = []
    pos = 0
    for m in _SLOT_RE.finditer(template):
        slot = m.group(1)
        if slot not in allowed:
            raise ConfigError(f"template '{name}': unknown slot {{{slot}}} (allowed: {sorted(allowed)})")
        if m.start() > pos:
            pieces.append(_Piece("text", template[pos: m.start()]))
        pieces.append(_Piece("slot", slot))
        pos = m.end()
    if pos < len(template):
        pieces.append(_Piece("text", template[pos:]))
    return pieces


def _slot_text(pieces: list[_Piece], i: int, text: str) -> str:
    """Text for slot i, with the leading space it takes over from the piece before it."""
    if i > 0 and pieces[i - 1].kind == "text" and pieces[i - 1].value.endswith(" ") and text:
        return " " + text
    return text


def _tokenise_literals(tokenizer, pieces: list[_Piece], text_slots: set[str]) -> list[_Piece]:
    for i, p in enumerate(pieces):
        if p.kind != "text":
            continue
        value = p.value
        nxt = pieces[i + 1] if i + 1 < len(pieces) else None
        if nxt is not None and nxt.kind == "slot" and nxt.value in text_slots and value.endswith(" "):
            value = value[:-1]  # the space travels with the slot text
        p.ids = _encode(tokenizer, value)
    return pieces


def fit_segments(segments: list[tuple[list[int], bool]], max_len: int, what: str) -> tuple[list[list[int]], bool]:
    """Cut cuttable segments from their ends until the total length is <= max_len.

    Water-filling: the longest texts are cut first, down to a common length T (>= 1 token
    each), so a long description is trimmed before a short title. Exactly the excess is cut.
    Returns (segments' ids, whether anything was cut)."""
    ids = [list(s) for s, _ in segments]
    excess = sum(map(len, ids)) - max_len
    if excess <= 0:
        return ids, False
    cands = [i for i, (_, c) in enumerate(segments) if c]
    lens = [len(ids[i]) for i in cands]

    def removed(t: int) -> int:
        return sum(max(0, n - t) for n in lens)

    if removed(1) < excess:
        raise ConfigError(
            f"pairs.max_len={max_len} is too small for {what}: "
            f"{sum(map(len, ids)) - removed(1)} tokens even with its text cut to one token"
        )
    # Largest T with removed(T) >= excess (removed() is non-increasing in T).
    lo, hi = 1, max(lens)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if removed(mid) >= excess:
            lo = mid
        else:
            hi = mid - 1
    t = lo
    # Cut everything to t + 1 first, then one more token from as many as still needed.
    extra = excess - removed(t + 1)
    for i, n in zip(cands, lens):
        keep = min(n, t + 1)
        if keep == t + 1 and extra > 0:
            keep, extra = t, extra - 1
        ids[i] = ids[i][:keep]
    return ids, True
