"""Top-K recommendations for one item history from a loaded model, and their text table.

What it is for: `top_k(run, history, k)` renders the prompt exactly as the evaluate stage
renders it (first retrieval template, the run's system prompt, the newest `max_history` items,
cut to `sft.max_len`) and decodes the items with `gti.eval.decode.constrained_beam_search` over
the catalog's SID trie (beam width = max(k, beam_width)); `format_recommendations` prints them.
`run` is any object with the attributes of `gti.loaded_run.LoadedRun` (model, trie,
renderer, item_ids, sids, sid_ids, titles, max_history, beam_width, pad_id, levels), which is
where a run directory is loaded and its SID map checked (`gti recommend`).

What it does NOT know: run directories, manifests, configs, training, or Ray.
"""

from __future__ import annotations

from typing import Any, Sequence

from gti.errors import ConfigError, DataError

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


def top_k(run: Any, history: Sequence[str], k: int = 10, where: str = "the SID map") -> list[dict[str, Any]]:
    """Top-k items for `history` (item ids, oldest first), best first:
    [{"item_id", "title", "score", "sid"}]; score = sum of the SID tokens' log-probs."""
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
    k = min(k, len(run.item_ids))
    prompt, _ = run.renderer.prompt(history[-run.max_history:])
    res = constrained_beam_search(
        run.model, [prompt], run.trie, beam_width=max(k, run.beam_width), k=k,
        levels=run.levels, pad_id=run.pad_id, constrained=True, batch_users=1,
    )
    out = []
    for row, score in zip(res.items[0].tolist(), res.scores[0].tolist()):
        if row < 0:
            continue
        item = run.item_ids[row]
        out.append({"item_id": item, "title": run.titles.get(item, ""), "score": float(score),
                    "sid": run.sids[row]})
    return out


def format_recommendations(recs: list[dict[str, Any]], title_width: int = 60) -> str:
    """A plain-text table: rank, item id, score, SID, title."""
    id_w = max([7, *(len(r["item_id"]) for r in recs)])
    sid_w = max([3, *(len(r["sid"]) for r in recs)])
    lines = [f"{'rank':>4}  {'item_id':<{id_w}}  {'score':>9}  {'sid':<{sid_w}}  title"]
    for i, r in enumerate(recs, 1):
        title = r["title"] if len(r["title"]) <= title_width else r["title"][: title_width - 3] + "..."
        lines.append(f"{i:>4}  {r['item_id']:<{id_w}}  {r['score']:>9.4f}  {r['sid']:<{sid_w}}  {title}")
    return "\n".join(lines)
