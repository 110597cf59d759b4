"""Why the learnability gate learned slowly: a pure-torch replica of its SFT, setting by setting.

No Ray, no DeepSpeed, no pipeline: the tiny random Llama (`gti.lm.models.build_tiny`) extended
with 2 x 16 SID tokens, `n` items with random unique SIDs on one permutation cycle, and training
batches of (history of 1-5 consecutive items -> next item) rendered either with the chat prompt
(`gti.lm.templates.make_renderer`, the paper's templates) or the compact one. Each setting
trains with AdamW (clip 1.0) and reports the first step (checked every 25) at which teacher-
forced exact-answer accuracy on a fresh batch reaches 0.9 (`null` if never within `steps`).
Settings vary one factor at a time: SID-row init (mean / random), prompt form (chat /
compact), depth, batch, lr. The gate's settings (jobs/configs/learnability.yaml) come from here.

Usage: python bench/learnability/learnability_replica.py [--quick] [--steps 600] [--seeds 0]
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared module
import common  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from gti.config import ModelConfig  # noqa: E402
from gti.lm import models, new_rows, templates  # noqa: E402
from gti.lm.init import init_rows  # noqa: E402
from gti.sid.codec import SidCodec  # noqa: E402
from gti.train import sft_data  # noqa: E402

SETTINGS = {
    # name: overrides of BASE
    "mean-chat-2L-b32": dict(init="mean", style="chat", layers=2, batch=32, lr=1e-3),
    "random-chat-2L-b32": dict(init="random", style="chat", layers=2, batch=32, lr=1e-3),
    "mean-compact-4L-b64": dict(init="mean", style="compact"),
    "random-chat-4L-b64": dict(init="random", style="chat"),
    "random-compact-2L-b32": dict(init="random", style="compact", layers=2, batch=32),
    "random-compact-4L-b64 (gate)": dict(init="random", style="compact"),
}
BASE = dict(n=60, init="random", style="compact", lr=3e-3, batch=64, hidden=64, layers=4, heads=4, hist=5)


def run(n, init, style, lr, batch, hidden, layers, heads, hist, steps, seed, levels=(16, 16)) -> dict:
    torch.manual_seed(seed)
    model, tok = models.build_tiny(ModelConfig(name="tiny", tiny_hidden=hidden, tiny_layers=layers,
                                               tiny_heads=heads), seed=seed)
    n_old = len(tok)
    codec = SidCodec(len(levels), list(levels))
    first, end = new_rows.extend_tokenizer(tok, codec.tokens())
    rng = np.random.default_rng(seed)
    combos = list(itertools.product(*[range(k) for k in levels]))
    codes = torch.tensor([combos[i] for i in rng.choice(len(combos), n, replace=False)])
    sid = codec.token_ids_from_offset(codes, first)
    old = model.get_input_embeddings().weight.detach()[:n_old]
    rows = init_rows(init, old, end - first, codebook_sizes=list(levels))
    model.resize_token_embeddings(end, mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[first:end] = rows
    perm = rng.permutation(n)
    succ = np.empty(n, int)
    succ[perm] = np.roll(perm, -1)
    rend = templates.make_renderer(tok, {str(i): sid[i].numpy() for i in range(n)},
                                  common.SYSTEM, 400, prompt_style=style)

    def make_batch(bs):
        ids, labs = [], []
        for _ in range(bs):
            h = [int(rng.integers(n))]
            for _ in range(int(rng.integers(1, hist + 1)) - 1):
                h.append(int(succ[h[-1]]))
            r = rend.example([str(x) for x in h], str(succ[h[-1]]), int(rng.integers(3)))
            ids.append(r["input_ids"])
            labs.append(r["labels"])
        t = max(map(len, ids))
        inp = torch.full((bs, t), tok.pad_token_id)
        lab = torch.full((bs, t), -100)
        mask = torch.zeros(bs, t, dtype=torch.long)
        for i, (x, y) in enumerate(zip(ids, labs)):
            inp[i, : len(x)], lab[i, : len(y)], mask[i, : len(x)] = torch.tensor(x), torch.tensor(y), 1
        return inp, lab, mask

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    t0, hit, acc, tokens = time.time(), None, 0.0, []
    for step in range(1, steps + 1):
        inp, lab, mask = make_batch(batch)
        tokens.append(inp.shape[1])
        loss = model(input_ids=inp, attention_mask=mask, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step % 25 == 0:
            with torch.no_grad():
                inp, lab, mask = make_batch(128)
                pred = model(input_ids=inp, attention_mask=mask).logits[:, :-1].argmax(-1)
                tgt = lab[:, 1:]
                acc = float(((pred == tgt) | (tgt == -100)).all(1).float().mean())
            if acc >= 0.9:
                hit = step
                break
    return {"steps_to_0.9": hit, "final_acc": round(acc, 3), "seconds": round(time.time() - t0, 1),
            "mean_row_tokens": round(float(np.mean(tokens)), 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the gate's setting only, 200 steps")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--items", type=int, default=60)
    args = ap.parse_args(argv)
    settings = {k: v for k, v in SETTINGS.items() if "gate" in k} if args.quick else SETTINGS
    steps = 200 if args.quick else args.steps
    out = {}
    for name, over in settings.items():
        for seed in [int(s) for s in args.seeds.split(",")]:
            r = run(**{**BASE, "n": args.items, **over}, steps=steps, seed=seed)
            print(f"{name} seed {seed}: {r}", file=sys.stderr, flush=True)
            out[f"{name} seed {seed}"] = r
    print(json.dumps({"items": args.items, "max_steps": steps, "results": out,
                      "load_avg": os.getloadavg()[0], "cpus": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
