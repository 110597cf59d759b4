"""Top-K recommendations for one item history from a loaded model, and their text table.

What it is for: `top_k(run, history, k)` decodes the items for one history with
`gti.eval.decode.constrained_beam_search` over the catalog's SID trie; `format_recommendations`
prints them. `decode_plan` is THE rule of how one request is decoded and `answer_items` applies
its exclusion to the search's rows: `gti recommend` (here), `gti serve` and `gti infer` (both
through `gti.serve.service`) call these two, so one request gets one answer whichever path
serves it.

What it does NOT know: run directories, manifests, configs, training, or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from gti.common.errors import ConfigError, DataError

MAX_K = 1000  # the beam search keeps max(k, beam_width) beams per level: bounded like a config value


def check_k(k: int, key: str = "k") -> int:
    """`k` itself when 1 <= k <= MAX_K, else ConfigError naming `key` (`--k` for the CLI)."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise ConfigError(f"{key} must be an integer, got {k!r}")
    if k < 1:
        raise ConfigError(f"{key} must be >= 1, got {k}")
    if k > MAX_K:
        raise ConfigError(f"{key} must be <= {MAX_K}, got {k}")
    return k


@dataclass(frozen=True)
class DecodePlan:
    """How one request is decoded (`decode_plan`)."""

    used: tuple[str, ...]  # the history items the prompt holds: the newest max_history
    exclude: tuple[str, ...]  # left out of the answer: the distinct items of `used` (exclusion on), else ()
    k: int  # items answered: k, at most the catalog
    k_decode: int  # items the search returns: k + len(exclude), at most the catalog
    width: int  # beams per level: max(k_decode, beam_width)


def decode_plan(history: Sequence[str], k: int, *, exclude_history: bool, beam_width: int, max_history: int,
                catalog_size: int) -> DecodePlan:
    """The plan for `history` (known item ids, oldest first, already checked non-empty) and `k`:
    which history items go into the prompt, which are left out of the answer, how many items the
    search returns, and its beam width, max(k + the excluded items, beam_width).

    The search returns k + (the excluded items) so that k remain once they are dropped, and its
    width follows that count: a wider beam can rank the items differently, so every path must
    take the width from here, not recompute it (else `gti recommend` and `gti serve` could
    answer the same k differently). Only the items in the prompt are excluded, which bounds the
    beams by k + max_history."""
    used = tuple(history[-max_history:])
    exclude = tuple(dict.fromkeys(used)) if exclude_history else ()
    k = min(int(k), catalog_size)
    k_decode = min(k + len(exclude), catalog_size)
    return DecodePlan(used=used, exclude=exclude, k=k, k_decode=k_decode, width=max(k_decode, int(beam_width)))


def answer_items(run: Any, rows: Sequence[int], scores: Sequence[float], plan: DecodePlan) -> list[dict[str, Any]]:
    """The search's rows for one request (best first) as item dicts, without the plan's
    excluded items and padding rows (< 0), at most `plan.k`."""
    exclude, items = set(plan.exclude), []
    for row, score in zip(rows, scores):
        if row < 0:
            continue
        item = run.item_ids[row]
        if item in exclude:
            continue
        items.append({"item_id": item, "title": run.titles.get(item, ""), "score": float(score),
                      "sid": run.sids[row]})
        if len(items) == plan.k:
            break
    return items


def top_k(run: Any, history: Sequence[str], k: int = 10, where: str = "the SID map", *,
          exclude_history: bool = False) -> list[dict[str, Any]]:
    """Top-k items for `history` (item ids, oldest first), best first:
    [{"item_id", "title", "score", "sid"}]; score = sum of the SID tokens' log-probs.
    `exclude_history`: leave the items of the history in the prompt out (as `gti serve`).
    The prompt is rendered exactly as the evaluate stage renders it (first retrieval template,
    the run's system prompt, the newest `max_history` items, cut to `sft.max_len`). `run` is any
    object with the attributes of `gti.run.loaded.LoadedRun` (model, trie, renderer, item_ids,
    sids, sid_ids, titles, max_history, beam_width, pad_id, levels), which is where a run
    directory is loaded and its SID map checked."""
    from gti.eval.decode import constrained_beam_search

    history = [str(h).strip() for h in history if str(h).strip()]
    if not history:
        raise DataError("history is empty: give at least one item id")
    check_k(k)
    unknown = [h for h in dict.fromkeys(history) if h not in run.sid_ids]
    if unknown:
        raise DataError(
            f"unknown item id(s) in history: {', '.join(unknown[:10])}"
            + (f" (+{len(unknown) - 10} more)" if len(unknown) > 10 else "")
            + f"; they have no SID in {where}"
        )
    plan = decode_plan(history, k, exclude_history=exclude_history, beam_width=run.beam_width,
                       max_history=run.max_history, catalog_size=len(run.item_ids))
    prompt, _ = run.renderer.prompt(list(plan.used))
    res = constrained_beam_search(
        run.model, [prompt], run.trie, beam_width=plan.width, k=plan.k_decode,
        levels=run.levels, pad_id=run.pad_id, constrained=True, normalise=run.normalise, batch_users=1,
    )
    return answer_items(run, res.items[0].tolist(), res.scores[0].tolist(), plan)


def format_recommendations(recs: list[dict[str, Any]], title_width: int = 60) -> str:
    """A plain-text table: rank, item id, score, SID, title."""
    id_w = max([7, *(len(r["item_id"]) for r in recs)])
    sid_w = max([3, *(len(r["sid"]) for r in recs)])
    lines = [f"{'rank':>4}  {'item_id':<{id_w}}  {'score':>9}  {'sid':<{sid_w}}  title"]
    for i, r in enumerate(recs, 1):
        title = r["title"] if len(r["title"]) <= title_width else r["title"][: title_width - 3] + "..."
        lines.append(f"{i:>4}  {r['item_id']:<{id_w}}  {r['score']:>9.4f}  {r['sid']:<{sid_w}}  {title}")
    return "\n".join(lines)
