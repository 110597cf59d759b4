"""Rendering grounding pairs and recommendation prompts through a tokenizer's chat template,
straight to token ids with answer-only labels.

What it is for:
- `ChatSkeleton` / `chat_skeleton(tokenizer, system_prompt)`: the chat template rendered ONCE
  around a placeholder user turn, giving `prefix_ids` (everything before the user text),
  `suffix_ids` (end of the user turn + the assistant header) and `eot_ids` (what closes an
  assistant turn, e.g. `<|im_end|>`; trailing whitespace dropped so generation stops on it).
  Every prompt is then `prefix + user ids + suffix`; no Jinja per row.
- `PairRenderer`: the six bidirectional grounding tasks (title2sid, desc2sid, titledesc2sid,
  sid2title, sid2desc, sid2titledesc). Templates are strings with `{title}`, `{description}`,
  `{sid}` slots. Text pieces are tokenised separately and SID token ids are spliced in from the
  codec's ids, never by re-tokenising rendered text (which is also exactly how an HF tokenizer
  splits text around added tokens). A space just before a text slot moves into the slot, so
  " Glass" tokenises as the model would see it in running text. Rows longer than `max_len` are
  fitted by cutting TEXT tokens (longest text first, from the end); SID tokens, the chat
  scaffolding and the end of turn are never cut.
- `render_rec_prompt(tokenizer, history_sid_ids, template, system_prompt)`: a recommendation
  prompt (history of SIDs -> prompt ids up to and including the assistant header), with the
  paper's three retrieval templates in `REC_TEMPLATES`; `render_compact_prompt`: the same
  history with no chat scaffolding or template text (`sft.prompt_style: compact`).

Labels are -100 everywhere except the answer: the SID ids (text->SID) or the text ids
(SID->text), followed by `eot_ids`.

What it does NOT know: where items, SIDs or tokenizers come from (the `pairs` stage), which
tokens are new (`gti.lm.vocab`), or Ray. No torch needed.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

from gti.errors import ConfigError
from gti.names import DEFAULT_GROUNDING_TEMPLATES

IGNORE = -100
_PH_USER = "\ue000gti-user\ue001"
_PH_ANSWER = "\ue000gti-answer\ue001"
_SLOT_RE = re.compile(r"\{(\w+)\}")

# Grounding tasks: (direction, answer template). text->SID answers are the SID itself.
TASKS: dict[str, tuple[str, str]] = {
    "title2sid": ("text2sid", "{sid}"),
    "desc2sid": ("text2sid", "{sid}"),
    "titledesc2sid": ("text2sid", "{sid}"),
    "sid2title": ("sid2text", "{title}"),
    "sid2desc": ("sid2text", "{description}"),
    "sid2titledesc": ("sid2text", "{title}\n{description}"),
}
# Slots each task's question must contain.
_REQUIRED = {
    "title2sid": {"title"},
    "desc2sid": {"description"},
    "titledesc2sid": {"title", "description"},
    "sid2title": {"sid"},
    "sid2desc": {"sid"},
    "sid2titledesc": {"sid"},
}

# The paper's three retrieval templates (issue 5); {history} is the SIDs of the history.
REC_TEMPLATES: tuple[str, ...] = (
    "The user has interacted with items {history} in chronological order. "
    "Can you predict the next possible item that the user may expect?",
    "Based on the items that the user has interacted with: {history}, "
    "can you determine what item would be recommended to the user next?",
    "Here is the item interaction history of the user: {history}, "
    "what to recommend to the user next?",
)


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


# --------------------------------------------------------------------------- grounding pairs
class PairRenderer:
    """Renders the grounding tasks of one item into token rows.

    Args:
        tokenizer: the extended HF tokenizer (SID tokens already added).
        templates: {task: question template}; tasks not in `TASKS` raise ConfigError.
        system_prompt: the system turn ("" for none).
        max_len: tokens per row (input_ids); longer rows get their text cut.
        sid_wrap: (start_id, end_id) marker ids put around every SID, or None.
    """

    def __init__(self, tokenizer, templates: dict[str, str], system_prompt: str, max_len: int,
                 sid_wrap: tuple[int, int] | None = None):
        self.tokenizer = tokenizer
        self.max_len = int(max_len)
        self.sid_wrap = tuple(sid_wrap) if sid_wrap else None
        self.skeleton = chat_skeleton(tokenizer, system_prompt)
        self.tasks: list[str] = []
        self._questions: dict[str, list[_Piece]] = {}
        self._answers: dict[str, list[_Piece]] = {}
        text_slots = {"title", "description"}
        for task, tmpl in templates.items():
            if task not in TASKS:
                raise ConfigError(f"pairs.templates: unknown task '{task}' (known: {sorted(TASKS)})")
            q = parse_template(tmpl, {"title", "description", "sid"}, f"pairs.templates.{task}")
            slots = {p.value for p in q if p.kind == "slot"}
            if not _REQUIRED[task] <= slots:
                raise ConfigError(
                    f"pairs.templates.{task} must contain {sorted('{' + s + '}' for s in _REQUIRED[task])}"
                )
            if TASKS[task][0] == "text2sid" and "sid" in slots:
                raise ConfigError(f"pairs.templates.{task} must not contain {{sid}}: the SID is the answer")
            self._questions[task] = _tokenise_literals(tokenizer, q, text_slots)
            a = parse_template(TASKS[task][1], {"title", "description", "sid"}, task)
            # Answers start right after the assistant header: no leading-space logic.
            self._answers[task] = _tokenise_literals(tokenizer, a, set())
            self.tasks.append(task)

    def _sid(self, sid_ids: Sequence[int]) -> list[int]:
        ids = [int(x) for x in sid_ids]
        return [self.sid_wrap[0], *ids, self.sid_wrap[1]] if self.sid_wrap else ids

    def _segments(self, pieces: list[_Piece], texts: dict[str, list[int]], lead: dict[str, list[int]],
                  sid: list[int]) -> list[tuple[list[int], bool]]:
        segs: list[tuple[list[int], bool]] = []
        for i, p in enumerate(pieces):
            if p.kind == "text":
                segs.append((p.ids, False))
            elif p.value == "sid":
                segs.append((sid, False))
            else:
                prev = pieces[i - 1] if i > 0 else None
                spaced = prev is not None and prev.kind == "text" and prev.value.endswith(" ")
                segs.append(((lead if spaced else texts)[p.value], True))
        return segs

    def render_item(self, title: str, description: str, sid_ids: Sequence[int]) -> list[dict[str, Any]]:
        """Rows for one item, in `self.tasks` order (see `render_batch` for the columns)."""
        return self.render_batch([title], [description], [sid_ids])[0]

    def render_batch(self, titles: Sequence[str], descriptions: Sequence[str],
                     sid_ids: Sequence[Sequence[int]]) -> list[list[dict[str, Any]]]:
        """Per item, one row per task: {task, input_ids, labels, prompt_ids, answer_ids, truncated}.

        Text is tokenised in one batched call per field (plain and with a leading space)."""
        n = len(titles)
        enc = {
            "title": _encode_many(self.tokenizer, list(titles)),
            "description": _encode_many(self.tokenizer, list(descriptions)),
        }
        lead = {
            "title": _encode_many(self.tokenizer, [" " + t if t else "" for t in titles]),
            "description": _encode_many(self.tokenizer, [" " + d if d else "" for d in descriptions]),
        }
        sk = self.skeleton
        prefix, suffix, eot = list(sk.prefix_ids), list(sk.suffix_ids), list(sk.eot_ids)
        out: list[list[dict[str, Any]]] = []
        for k in range(n):
            texts = {f: enc[f][k] for f in enc}
            leads = {f: lead[f][k] for f in lead}
            sid = self._sid(sid_ids[k])
            rows = []
            for task in self.tasks:
                q = self._segments(self._questions[task], texts, leads, sid)
                a = self._segments(self._answers[task], texts, leads, sid)
                segs = [(prefix, False), *q, (suffix, False), *a, (eot, False)]
                ids, cut = fit_segments(segs, self.max_len, f"task {task}")
                n_prompt = 1 + len(q) + 1
                prompt = [t for s in ids[:n_prompt] for t in s]
                answer = [t for s in ids[n_prompt:] for t in s]
                rows.append({
                    "task": task,
                    "input_ids": prompt + answer,
                    "labels": [IGNORE] * len(prompt) + answer,
                    "prompt_ids": prompt,
                    "answer_ids": answer,
                    "truncated": cut,
                })
            out.append(rows)
        return out


# --------------------------------------------------------------------------- recommendation
def _rec_pieces(tokenizer, template: str) -> list[_Piece]:
    """Parsed recommendation template with its literal text tokenised, cached per tokenizer."""
    try:
        per_tok = _SKELETONS.setdefault(tokenizer, {})
    except TypeError:
        per_tok = {}
    key = ("rec", template, len(tokenizer))
    if key not in per_tok:
        pieces = parse_template(template, {"history"}, "recommendation template")
        if not any(p.kind == "slot" for p in pieces):
            raise ConfigError("recommendation template must contain {history}")
        for p in pieces:
            if p.kind == "text":
                p.ids = _encode(tokenizer, p.value)
        per_tok[key] = pieces
    return per_tok[key]


def render_rec_prompt(tokenizer, history_sid_ids: Sequence[Sequence[int]], template: str,
                      system_prompt: str, *, sep: str = ", ",
                      sid_wrap: tuple[int, int] | None = None) -> list[int]:
    """Prompt ids (chat prefix + question + assistant header) for a recommendation query.

    history_sid_ids: per history item (oldest first) its SID token ids [L]; they are joined
    with `sep` and spliced into `{history}` (the space before `{history}` stays in the literal
    text, as the tokenizer itself would split text around added tokens). The answer the model
    should produce is the next item's SID ids followed by `end_of_turn_ids(tokenizer)`.
    """
    pieces = _rec_pieces(tokenizer, template)
    sk = chat_skeleton(tokenizer, system_prompt)
    sep_ids = _rec_pieces(tokenizer, sep + "{history}")[0].ids if sep else []
    hist: list[int] = []
    for j, sid in enumerate(history_sid_ids):
        if j:
            hist.extend(sep_ids)
        if sid_wrap:
            hist.append(sid_wrap[0])
        hist.extend(int(x) for x in sid)
        if sid_wrap:
            hist.append(sid_wrap[1])
    ids = list(sk.prefix_ids)
    for p in pieces:
        ids.extend(hist if p.kind == "slot" else p.ids)
    ids.extend(sk.suffix_ids)
    return ids


def render_compact_prompt(tokenizer, history_sid_ids: Sequence[Sequence[int]], template: str = "",
                          system_prompt: str = "", *,
                          sid_wrap: tuple[int, int] | None = None) -> list[int]:
    """The compact recommendation prompt (`sft.prompt_style: compact`): the history's SID ids
    back to back (each wrapped in the markers when the vocabulary has them), then the chat
    template's assistant header (`ChatSkeleton.suffix_ids`, e.g. `<|im_end|>\n<|im_start|>
    assistant\n`); no system prompt, no template text.

    Same signature as `render_rec_prompt` so a renderer can take either; `template` and
    `system_prompt` are ignored. SID tokens delimit themselves (one token per level), so no
    separator is needed between items; the header marks where the history ends, so the model
    knows when the answer (next SID + end of turn) starts and when to stop; without it the
    end of turn would be unpredictable. A chat prompt spends ~30-90 tokens per row on
    scaffolding and template text (measured in bench/RESULTS.md), often more than the history.
    """
    ids: list[int] = []
    for sid in history_sid_ids:
        if sid_wrap:
            ids.append(sid_wrap[0])
        ids.extend(int(x) for x in sid)
        if sid_wrap:
            ids.append(sid_wrap[1])
    ids.extend(chat_skeleton(tokenizer, "").suffix_ids)
    return ids


PROMPT_RENDERERS = {"chat": render_rec_prompt, "compact": render_compact_prompt}


__all__ = [
    "DEFAULT_GROUNDING_TEMPLATES", "IGNORE", "REC_TEMPLATES", "TASKS", "ChatSkeleton", "PairRenderer",
    "chat_skeleton", "end_of_turn_ids", "fit_segments", "parse_template", "render_rec_prompt",
    "render_compact_prompt", "PROMPT_RENDERERS",
]
