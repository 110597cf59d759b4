"""Rendering grounding pairs and recommendation prompts through a tokenizer's chat template,
straight to token ids with answer-only labels.

What it is for: `PairRenderer` renders the six bidirectional grounding tasks (`TASKS`);
`render_rec_prompt` (the paper's templates, `REC_TEMPLATES`), `render_compact_prompt` and
`render_sequence_prompt` render recommendation prompts, and `RecRenderer` (`make_renderer`) turns
(history, target) windows into rows. Every prompt is `prefix + user ids + suffix` around the chat
skeleton of `gti.lm.chat` (no Jinja per row); labels are -100 everywhere except the answer (SID
or text ids) and `eot_ids`.

What it does NOT know: where items, SIDs or tokenizers come from (the `pairs` stage), which
tokens are new (`gti.lm.new_rows`), or Ray. No torch needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from gti.common.errors import ConfigError, DataError
from gti.lm.chat import (
    IGNORE,
    _encode,
    _encode_many,
    _SKELETONS,
    _Piece,
    _tokenise_literals,
    chat_skeleton,
    end_of_turn_ids,
    fit_segments,
    parse_template,
)

if TYPE_CHECKING:
    import polars as pl


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

SEQ_TASK = "seqrec"  # the task name of a recommendation (SFT) row
ROW_COLUMNS = ("task", "input_ids", "labels", "prompt_ids", "answer_ids")

# The paper's three retrieval templates; {history} is the SIDs of the history.
REC_TEMPLATES: tuple[str, ...] = (
    "The user has interacted with items {history} in chronological order. "
    "Can you predict the next possible item that the user may expect?",
    "Based on the items that the user has interacted with: {history}, "
    "can you determine what item would be recommended to the user next?",
    "Here is the item interaction history of the user: {history}, "
    "what to recommend to the user next?",
)


# --------------------------------------------------------------------------- grounding pairs
class PairRenderer:
    """Renders the grounding tasks of one item into token rows.

    Templates are strings with `{title}`, `{description}`, `{sid}` slots. Text pieces are
    tokenised separately and SID token ids are spliced in from the codec's ids, never by
    re-tokenising rendered text (which is also exactly how an HF tokenizer splits text around
    added tokens). A space just before a text slot moves into the slot, so " Glass" tokenises as
    the model would see it in running text. Rows longer than `max_len` are fitted by cutting TEXT
    tokens (longest text first, from the end); SID tokens, the chat scaffolding and the end of
    turn are never cut. Labels cover the answer only: the SID ids (text->SID) or the text ids
    (SID->text), followed by the end-of-turn ids.

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
    back to back (`render_sequence_prompt`), then the chat template's assistant header
    (`ChatSkeleton.suffix_ids`), which marks where the answer (next SID + end of turn) starts;
    no system prompt, no template text (`template`, `system_prompt` are ignored). A chat prompt
    spends most of its tokens on scaffolding (bench/train_throughput/RESULTS.md, "Training step throughput")."""
    ids = render_sequence_prompt(tokenizer, history_sid_ids, sid_wrap=sid_wrap)
    ids.extend(chat_skeleton(tokenizer, "").suffix_ids)
    return ids


def render_sequence_prompt(tokenizer, history_sid_ids: Sequence[Sequence[int]], template: str = "",
                           system_prompt: str = "", *,
                           sid_wrap: tuple[int, int] | None = None) -> list[int]:
    """The prompt of the `sequence` SFT objective: the history's SID ids back to back (each
    wrapped in the markers when the vocabulary has them) and nothing else, so a prompt is
    exactly a prefix of the training row `RecRenderer.sequence_row` renders for the same items.
    The next item's SID tokens follow directly; there is no end of turn, since beam search
    stops after the SID's L levels. `template` and `system_prompt` are ignored."""
    ids: list[int] = []
    for sid in history_sid_ids:
        if sid_wrap:
            ids.append(sid_wrap[0])
        ids.extend(int(x) for x in sid)
        if sid_wrap:
            ids.append(sid_wrap[1])
    return ids


# "sequence" is implied by `sft.objective: sequence`, not a `sft.prompt_style` value.
PROMPT_RENDERERS = {"chat": render_rec_prompt, "compact": render_compact_prompt, "sequence": render_sequence_prompt}


# --------------------------------------------------------------------------- SID ids
def sid_id_table(sid_map: pl.DataFrame, codec: Any, tokenizer: Any) -> dict[str, np.ndarray]:
    """item_id -> int64[L] token ids of its SID, through `codec.token_ids` (never re-tokenised)."""
    for col in ("item_id", "codes"):
        if col not in sid_map.columns:
            raise DataError(f"sid_map.parquet: missing column '{col}'")
    codes = np.asarray(sid_map["codes"].to_list(), dtype=np.int64)
    ids = codec.token_ids(codes, tokenizer)
    ids = ids.numpy() if hasattr(ids, "numpy") else np.asarray(ids)
    return dict(zip(sid_map["item_id"].to_list(), ids.astype(np.int64)))


# --------------------------------------------------------------------------- recommendation rows
RenderFn = Callable[[Any, list[list[int]], str, str], list[int]]


def _default_render() -> RenderFn:
    return render_rec_prompt


@dataclass
class RecRenderer:
    """Renders (history, target) windows into token rows.

    `sid_ids` maps item_id -> int[L] SID token ids; `eot_ids` are the ids that close the
    assistant turn (appended to the answer so the model learns to stop). `render` is
    `render_rec_prompt(tokenizer, history_sid_ids, template, system_prompt) -> prompt ids`
    (up to and including the assistant header). `sid_wrap` = (<sid_start>, <sid_end>) ids when
    the vocabulary has SID markers: history SIDs are wrapped, the answer is
    [<sid_start>, SID, <sid_end>, eot], and an evaluation prompt ends with <sid_start> so that
    decoding starts at the first SID token.
    """

    tokenizer: Any
    sid_ids: dict[str, np.ndarray]
    system_prompt: str
    max_len: int
    eot_ids: list[int]
    templates: Sequence[str] = REC_TEMPLATES
    render: RenderFn = field(default_factory=_default_render)
    sid_wrap: tuple[int, int] | None = None

    def _render(self, hist: list[list[int]], template: str) -> list[int]:
        if self.sid_wrap is None:
            return list(self.render(self.tokenizer, hist, template, self.system_prompt))
        return list(self.render(self.tokenizer, hist, template, self.system_prompt, sid_wrap=self.sid_wrap))

    def item_ids(self, item: str) -> list[int]:
        """One item's SID ids, wrapped in the markers if any."""
        sid = self.sid_ids[item].tolist()
        return [self.sid_wrap[0], *sid, self.sid_wrap[1]] if self.sid_wrap is not None else sid

    def answer_ids(self, target: str) -> list[int]:
        """`item_ids(target)` + end of turn (none for the sequence style)."""
        return self.item_ids(target) + list(self.eot_ids)

    def _prompt(self, history: Sequence[str], template: str, budget: int) -> tuple[list[int], int]:
        """Prompt ids with as many of the newest history items as fit in `budget` tokens.

        Returns (prompt_ids, number of history items kept)."""
        hist = [self.sid_ids[i].tolist() for i in history]

        def render(k: int) -> list[int]:
            return self._render(hist[len(hist) - k :], template)

        ids = render(len(hist))
        if len(ids) <= budget:  # the common case: one render
            return ids, len(hist)
        # Binary search for the most newest-items that fit (prompt length grows with k).
        lo, hi, best = 1, len(hist) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            cand = render(mid)
            if len(cand) <= budget:
                best, lo = (cand, mid), mid + 1
            else:
                hi = mid - 1
        if best is None:
            raise ConfigError(
                f"sft.max_len={self.max_len} is too small: a prompt with one history item "
                f"needs {len(render(1))} tokens plus {self.max_len - budget} for the answer"
            )
        return best

    def prompt(self, history: Sequence[str], template_idx: int = 0) -> tuple[list[int], int]:
        """Evaluation prompt: ids leaving room for one SID answer + end of turn (ending with
        <sid_start> when the vocabulary has markers). Returns (ids, history items kept)."""
        answer_len = len(self.answer_ids(next(iter(self.sid_ids))))
        ids, kept = self._prompt(history, self.templates[template_idx], self.max_len - answer_len)
        if self.sid_wrap is not None:
            ids = ids + [self.sid_wrap[0]]
        return ids, kept

    def example(self, history: Sequence[str], target: str, template_idx: int) -> dict[str, Any]:
        """One training row: input_ids = prompt + answer, labels = -100 on the prompt."""
        answer = self.answer_ids(target)
        prompt, kept = self._prompt(history, self.templates[template_idx], self.max_len - len(answer))
        return _rec_row(prompt, answer, kept)

    def sequence_row(self, items: Sequence[str]) -> dict[str, Any]:
        """One training row of the `sequence` objective: `items` (oldest first, >= 2) as SID
        tokens back to back, labels on every item's tokens but the first item's, so one forward
        pass trains len(items) - 1 targets; item t follows exactly `prompt(items[:t])`.
        prompt_ids = the first item, answer_ids = the rest; ConfigError past `max_len`."""
        if len(items) < 2:
            raise DataError(f"a sequence row needs >= 2 items, got {len(items)}")
        parts = [self.item_ids(i) for i in items]
        first, rest = parts[0], [t for p in parts[1:] for t in p]
        if len(first) + len(rest) > self.max_len:
            raise ConfigError(
                f"sft.max_len={self.max_len} is too small for a sequence row of {len(items)} items "
                f"({len(first) + len(rest)} tokens)"
            )
        return _rec_row(first, rest, len(items) - 1)

    def render_windows(self, windows: dict[str, Any]) -> dict[str, list]:
        """Batch form for `map_batches` / plain use: columns history, target, template (one
        `example` each), or items (sequence chunks, one `sequence_row` each)."""
        if "items" in windows:
            rows = [self.sequence_row([str(i) for i in items]) for items in windows["items"]]
        else:
            rows = [self.example(list(h), str(t), int(k))
                    for h, t, k in zip(windows["history"], windows["target"], windows["template"])]
        return {c: [r[c] for r in rows] for c in (*ROW_COLUMNS, "history_kept")}

    def render_prompts(self, windows: dict[str, Any]) -> dict[str, list]:
        """Batch form of evaluation prompts (columns user_id, split, history, target)."""
        out: dict[str, list] = {"user_id": [], "split": [], "prompt_ids": [], "target": []}
        for u, s, h, t in zip(windows["user_id"], windows["split"], windows["history"], windows["target"]):
            ids, _ = self.prompt(list(h))
            out["user_id"].append(str(u))
            out["split"].append(str(s))
            out["prompt_ids"].append(ids)
            out["target"].append(str(t))
        return out


def _rec_row(prompt: list[int], answer: list[int], kept: int) -> dict[str, Any]:
    """A recommendation training row: the answer labelled, the prompt not."""
    return {"task": SEQ_TASK, "input_ids": prompt + answer, "labels": [IGNORE] * len(prompt) + answer,
            "prompt_ids": prompt, "answer_ids": answer, "history_kept": kept}


def make_renderer(
    tokenizer: Any, sid_ids: dict[str, np.ndarray], system_prompt: str, max_len: int,
    templates: Sequence[str] = REC_TEMPLATES, prompt_style: str = "chat",
) -> RecRenderer:
    """A `RecRenderer` wired to this module's renderers (chat-template, compact or sequence
    rendering, end-of-turn ids); `prompt_style` is `SftConfig.render_style` ("chat" | "compact"
    | "sequence", the last implied by `sft.objective: sequence`).

    SID markers are used iff the tokenizer has them (`model.sid_markers` added them)."""
    if prompt_style not in PROMPT_RENDERERS:
        raise ConfigError(
            f"sft.prompt_style must be one of {sorted(set(PROMPT_RENDERERS) - {'sequence'})}, got '{prompt_style}'"
        )
    from gti.lm.new_rows import SID_END, SID_START

    vocab = tokenizer.get_vocab()
    wrap = (vocab[SID_START], vocab[SID_END]) if SID_START in vocab and SID_END in vocab else None
    # A sequence row runs straight from one item's SID into the next: no end of turn.
    eot = [] if prompt_style == "sequence" else list(end_of_turn_ids(tokenizer))
    return RecRenderer(
        tokenizer=tokenizer, sid_ids=sid_ids, system_prompt=system_prompt, max_len=max_len,
        eot_ids=eot, templates=templates,
        render=PROMPT_RENDERERS[prompt_style], sid_wrap=wrap,
    )
