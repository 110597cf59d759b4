"""Does a grounded model map a description to its token? Rank of the right token among the new
tokens, by the next-token logit after the description -> token prompt.

    python jobs/examples/tool_tokens/evaluate.py --model runs/tool_tokens/model \
        --tokens jobs/examples/tool_tokens/tools.jsonl

Prints, for the training descriptions and the held-out `eval_descriptions`, top-1 / top-3
accuracy and MRR of the grounded model, of the same model with the new rows put back to their
initial values (`e_new_init.safetensors`, i.e. before grounding), and chance (1/N for top-1
among N new tokens). Ties count against the right token, so identical initial rows (init
`mean`) score 0 rather than chance. The prompt is the one grounding trained on (the
`desc2token` template and system prompt recorded in the model's gti_meta.json). A few seconds
on a CPU for SmolLM2-135M.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _swap_in_init(model, init_path: Path, first: int, end: int) -> bool:
    """Put the rows before grounding into the model's new rows (in place); False if absent."""
    import torch
    from safetensors.torch import load_file

    if not init_path.is_file():
        return False
    init = load_file(str(init_path))
    with torch.no_grad():
        model.get_input_embeddings().weight[first:end] = init["e_new"].to(model.dtype)
        head = model.get_output_embeddings()
        if head is not None and head.weight is not model.get_input_embeddings().weight:
            head.weight[first:end] = init.get("head_new", init["e_new"]).to(model.dtype)
    return True


def evaluate(model_dir: str | Path, tokens_path: str | Path) -> dict:
    """{"grounded"|"init": {"train"|"eval": rank_summary}} for the model folder and tokens file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gti.lm import described_tokens

    model_dir = Path(model_dir)
    meta = json.loads((model_dir / "gti_meta.json").read_text())
    ids: dict[str, int] = meta["tokens"]
    first, end = meta["new_token_ids"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True, dtype=torch.float32)
    tokens = [t for t in described_tokens.read_tokens(tokens_path) if t.token in ids]
    templates = {"desc2token": (meta.get("templates") or described_tokens.DEFAULT_TEMPLATES)["desc2token"]}
    pairs = described_tokens.render_pairs(tok, tokens, [ids[t.token] for t in tokens], templates,
                                          meta.get("system_prompt", "You are a helpful assistant."), max_len=512)
    new_ids = sorted(ids.values())
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out: dict = {}
    for which in ("grounded", "init"):
        if which == "init" and not _swap_in_init(model, model_dir / "e_new_init.safetensors", first, end):
            continue
        out[which] = {}
        for split, name in (("train", "train"), ("val", "eval")):
            prompts, targets = described_tokens.description_prompts(pairs, ids, split)
            ranks = described_tokens.description_ranks(model, prompts, targets, new_ids, pad_id=pad)
            out[which][name] = described_tokens.rank_summary(ranks, len(new_ids))
    return out


def format_figures(fig: dict) -> str:
    lines = [f"{'model':<10} {'descriptions':<13} {'n':>3} {'top-1':>6} {'chance':>7} {'top-3':>6} {'MRR':>6} "
             f"{'chance MRR':>10}"]
    for which, per in fig.items():
        for split, f in per.items():
            if not f["n_prompts"]:
                continue
            lines.append(f"{which:<10} {split:<13} {f['n_prompts']:>3} {f['top1']:>6.3f} {f['chance_top1']:>7.3f} "
                         f"{f['top3']:>6.3f} {f['mrr']:>6.3f} {f['chance_mrr']:>10.3f}")
    n = next(iter(next(iter(fig.values())).values()))["n_tokens"]
    lines.append(f"({n} new tokens; top-1 chance = 1/{n}; ties count against the right token)")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="folder written by `gti vocab ground`")
    ap.add_argument("--tokens", required=True, help="the tokens file it was grounded from")
    ap.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = ap.parse_args(argv)
    fig = evaluate(args.model, args.tokens)
    print(format_figures(fig))
    if args.json:
        print(json.dumps(fig, indent=1))
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])
