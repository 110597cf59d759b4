"""Grounding any new vocabulary, the pure parts: token files, pair rendering, initial rows,
and how well a model maps a description to its token.

What it is for: `gti.vocab_ground` grounds arbitrary new tokens (tool calls, knowledge-graph
nodes, product codes) the way gti grounds SID tokens; this module holds what needs no Ray:
`read_tokens` (the token file), `pair_templates` / `render_pairs` (description -> token and
token -> description pairs, rendered by `gti.lm.templates.PairRenderer` with a token as a
one-level "SID", so chat template, answer-only labels and text cutting are those of gti's
grounding pairs), `initial_rows`, and `description_ranks` (the accuracy-vs-chance figure).

What it does NOT know: Ray, training, where files go (see `gti.vocab_ground`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from gti.common.errors import ConfigError
from gti.common.errors import DataError

# The two directions: description -> token (`desc2token`, slot `{description}`) and token ->
# description (`token2desc`, slot `{token}`), rendered as PairRenderer's desc2sid / sid2desc.
DEFAULT_TEMPLATES: dict[str, str] = {
    "desc2token": "Which token is described here? {description}",
    "token2desc": "Briefly describe the token {token}.",
}
# Our task name -> (PairRenderer task, our slot -> renderer slot).
_TASK_MAP = {"desc2token": "desc2sid", "token2desc": "sid2desc"}
_ALLOWED_KEYS = {"token", "descriptions", "eval_descriptions"}
VAL_TASK = "desc2token"


@dataclass(frozen=True)
class NewToken:
    """A new token, its training descriptions, and `eval_descriptions` held out of training and
    used for validation."""

    token: str
    descriptions: tuple[str, ...]
    eval_descriptions: tuple[str, ...] = field(default_factory=tuple)


def _strings(v: Any, where: str, key: str, required: bool) -> tuple[str, ...]:
    if v is None and not required:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or (required and not v):
        raise DataError(f"{where}: '{key}' must be a non-empty list of strings")
    out = []
    for s in v:
        if not isinstance(s, str) or not s.strip():
            raise DataError(f"{where}: '{key}' holds an empty or non-string entry")
        out.append(s.strip())
    return tuple(out)


def parse_tokens(entries: Sequence[Any], source: str = "<tokens>", labels: Sequence[str] | None = None) -> list[NewToken]:
    """NewTokens from a list of {"token", "descriptions", "eval_descriptions"?} dicts (or
    NewTokens); errors name `source` and the entry (`labels[n]`, default "entry n+1")."""
    out: list[NewToken] = []
    seen: set[str] = set()
    for n, e in enumerate(entries):
        where = f"{source}: {labels[n] if labels is not None else f'entry {n + 1}'}"
        if isinstance(e, NewToken):
            e = {"token": e.token, "descriptions": list(e.descriptions),
                 "eval_descriptions": list(e.eval_descriptions)}
        if not isinstance(e, dict):
            raise DataError(f"{where}: expected an object with 'token' and 'descriptions'")
        unknown = sorted(set(e) - _ALLOWED_KEYS)
        if unknown:
            raise DataError(f"{where}: unknown key '{unknown[0]}' (allowed: {sorted(_ALLOWED_KEYS)})")
        tok = e.get("token")
        if not isinstance(tok, str) or not tok.strip() or tok != tok.strip():
            raise DataError(f"{where}: 'token' must be a non-empty string without surrounding spaces")
        if tok in seen:
            raise DataError(f"{where}: token '{tok}' appears twice")
        seen.add(tok)
        out.append(NewToken(tok, _strings(e.get("descriptions"), where, "descriptions", True),
                            _strings(e.get("eval_descriptions"), where, "eval_descriptions", False)))
    if not out:
        raise DataError(f"{source}: no tokens")
    return out


def read_tokens(path: str | Path) -> list[NewToken]:
    """Tokens from a JSONL file (`.jsonl`: one `{"token": "<tool_search>", "descriptions": ["...",
    ...]}` per line, optional `"eval_descriptions"`), or a YAML / JSON list of the same objects
    (anything else). Unknown keys, empty descriptions and duplicate tokens are DataErrors naming
    the file and line/entry."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: tokens file not found")
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".jsonl":
        entries, lines = [], []
        for ln, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DataError(f"{p}: line {ln}: not valid JSON ({err.msg})") from None
            lines.append(f"line {ln}")
        return parse_tokens(entries, str(p), lines)
    import yaml

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise DataError(f"{p}: not valid YAML/JSON: {str(err).splitlines()[0]}") from None
    if isinstance(raw, dict) and "tokens" in raw:
        raw = raw["tokens"]
    if not isinstance(raw, list):
        raise DataError(f"{p}: expected a list of tokens (or JSON lines in a .jsonl file)")
    return parse_tokens(raw, str(p))


# --------------------------------------------------------------------------- pairs
def pair_templates(templates: dict[str, str] | None = None) -> dict[str, str]:
    """Our templates -> PairRenderer templates ({desc2sid, sid2desc}); ConfigError on a bad one."""
    templates = dict(DEFAULT_TEMPLATES if templates is None else templates)
    if not templates:
        raise ConfigError("templates: at least one of desc2token / token2desc is needed")
    out = {}
    for name, tmpl in templates.items():
        if name not in _TASK_MAP:
            raise ConfigError(f"templates: unknown task '{name}' (known: {sorted(_TASK_MAP)})")
        if not isinstance(tmpl, str):
            raise ConfigError(f"templates.{name} must be a string")
        if "{sid}" in tmpl or "{title}" in tmpl:
            raise ConfigError(f"templates.{name}: use {{description}} and {{token}} slots only")
        out[_TASK_MAP[name]] = tmpl.replace("{token}", "{sid}")
    return out


def render_pairs(tokenizer, tokens: Sequence[NewToken], token_ids: Sequence[int],
                 templates: dict[str, str] | None = None, system_prompt: str = "You are a helpful assistant.",
                 max_len: int = 128) -> dict[str, list]:
    """Columns item_id (the token string), task (desc2token / token2desc), split, input_ids,
    labels, prompt_ids, answer_ids, truncated; one row per (token, description, task): split
    "train" for `descriptions`, "val" for `eval_descriptions`."""
    from gti.lm.templates import PairRenderer

    back = {v: k for k, v in _TASK_MAP.items()}
    renderer = PairRenderer(tokenizer, pair_templates(templates), system_prompt, max_len)
    cols: dict[str, list] = {k: [] for k in ("item_id", "task", "split", "input_ids", "labels",
                                            "prompt_ids", "answer_ids", "truncated")}
    entries = [(t, tid, d, split) for t, tid in zip(tokens, token_ids)
               for split, descs in (("train", t.descriptions), ("val", t.eval_descriptions)) for d in descs]
    rendered = renderer.render_batch([""] * len(entries), [e[2] for e in entries], [[e[1]] for e in entries])
    for (t, _, _, split), rows in zip(entries, rendered):
        for row in rows:
            cols["item_id"].append(t.token)
            cols["task"].append(back[row["task"]])
            cols["split"].append(split)
            for c in ("input_ids", "labels", "prompt_ids", "answer_ids", "truncated"):
                cols[c].append(row[c])
    return cols


def description_prompts(pairs: dict[str, list], token_ids: dict[str, int], split: str) -> tuple[list, list]:
    """(prompt ids, target token id) of the desc2token rows of `split` in `render_pairs` output."""
    prompts, targets = [], []
    for tok, task, sp, p in zip(pairs["item_id"], pairs["task"], pairs["split"], pairs["prompt_ids"]):
        if task == VAL_TASK and sp == split:
            prompts.append(list(p))
            targets.append(int(token_ids[tok]))
    return prompts, targets


# --------------------------------------------------------------------------- init
def initial_rows(method: str, model, n_real: int, n_new: int, *,
                 description_ids: Sequence[Sequence[Sequence[int]]] | None = None,
                 noise_std: float = 0.02, seed: int = 0) -> dict[str, torch.Tensor]:
    """{"e_new": [n_new, d]} (+ "head_new" for an untied head) by `gti.lm.init.init_rows`, for any
    `init.method` except `codebook` (no code vectors here).

    description_ids: per new token, the token ids of each of its descriptions (`description`:
    the token-weighted mean embedding of all of a token's descriptions).
    """
    from gti.lm import init as lm_init
    from gti.lm import new_rows

    if method == "codebook":
        raise ConfigError("init.method=codebook needs SID codebooks; new vocabulary has none "
                          "(use mean, mean_noise, random or description)")
    kw: dict[str, Any] = {"noise_std": noise_std}
    if method == "description":
        if description_ids is None or len(description_ids) != n_new:
            raise ConfigError("init.method=description needs the descriptions of every new token")
        # Each description is an "item" whose one-level code is its token's row.
        kw["item_codes"] = torch.tensor([[i] for i, ds in enumerate(description_ids) for _ in ds],
                                        dtype=torch.long).reshape(-1, 1)
        kw["item_token_ids"] = [list(d) for ds in description_ids for d in ds]
        kw["codebook_sizes"] = [n_new]
    out = {"e_new": lm_init.init_rows(method, new_rows.old_rows(model, n_real), n_new,
                                      generator=torch.Generator().manual_seed(seed), **kw)}
    if model.get_output_embeddings() is not None and not new_rows.heads_tied(model):
        out["head_new"] = lm_init.init_rows(method, new_rows.old_rows(model, n_real, which="output"), n_new,
                                            generator=torch.Generator().manual_seed(seed + 1), **kw)
    return out


# --------------------------------------------------------------------------- evaluation
@torch.no_grad()
def description_ranks(model, prompts: Sequence[Sequence[int]], targets: Sequence[int], new_ids: Sequence[int],
                      pad_id: int = 0, batch: int = 16) -> torch.Tensor:
    """LongTensor[P]: rank (1 = best) of each prompt's target among `new_ids` by the model's
    next-token logit after the prompt (ties count against the target: rank = 1 + number of
    new tokens scoring at least as high, other than the target)."""
    model.eval()
    device = next(model.parameters()).device
    cand = torch.as_tensor(list(new_ids), dtype=torch.long, device=device)
    pos = {int(t): i for i, t in enumerate(cand.tolist())}
    ranks = []
    for s in range(0, len(prompts), batch):
        chunk = [list(p) for p in prompts[s: s + batch]]
        t = max(map(len, chunk))
        ids = torch.full((len(chunk), t), int(pad_id), dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, : len(p)] = torch.as_tensor(p)
            mask[i, : len(p)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits  # [B, T, V]
        last = mask.sum(1) - 1
        scores = logits[torch.arange(len(chunk), device=device), last][:, cand].float()  # [B, N]
        tgt = torch.as_tensor([pos[int(x)] for x in targets[s: s + batch]], device=device)
        mine = scores.gather(1, tgt[:, None])
        ranks.append(((scores >= mine).sum(1)).cpu())  # includes the target itself
    return torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.long)


def rank_summary(ranks: torch.Tensor, n_candidates: int) -> dict[str, float]:
    """top-1 / top-3 accuracy, mean reciprocal rank, and their chance values for N candidates."""
    r = ranks.double()
    n = max(int(n_candidates), 1)
    return {
        "n_prompts": int(r.numel()),
        "n_tokens": n,
        "top1": float((r == 1).double().mean()) if r.numel() else 0.0,
        "top3": float((r <= 3).double().mean()) if r.numel() else 0.0,
        "mrr": float((1.0 / r).mean()) if r.numel() else 0.0,
        "mean_rank": float(r.mean()) if r.numel() else 0.0,
        "chance_top1": 1.0 / n,
        "chance_top3": min(3, n) / n,
        "chance_mrr": sum(1.0 / k for k in range(1, n + 1)) / n,
        "chance_mean_rank": (n + 1) / 2,
    }
