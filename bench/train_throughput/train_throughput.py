"""Benchmark: gti's training step vs the plain path, for SFT and grounding, on SmolLM2-135M.

The plain path is what a first implementation does: HF forward with `labels=` (full-vocabulary
logits at every position), fp32, random micro-batches right-padded to their longest row.
gti's step: loss only at labelled positions (`gti.train.loss.labelled_loss`), the resolved
`precision: auto` (bf16 autocast where bf16 is native, else fp32), length-grouped micro-batches
(`gti.train.batching`), torch's fused AdamW (as gti's DeepSpeed config), eager attention on
CPU (`attn_implementation: auto`). Both run the same rows, the same number of them, with AdamW on the
same trainable set, interleaved round by round in one process (so load hits both alike).

Rows (bundled amazon-scientific, 4,385 items with deterministic random unique 3 x 64 SIDs):
- SFT: training windows (history <= 10) rendered with the paper's chat prompt (the same rows
  for both paths), plus the compact prompt form for `sft_compact_speedup` (gti's step on
  compact rows vs the plain path on chat rows: the same examples, fewer tokens each);
- grounding: the six grounding tasks of the items (`gti.lm.templates.PairRenderer`, max 128
  tokens), new SID rows in their own split parameter (backbone frozen).

Also printed: `loss_match` (step-1 losses of the two loss paths on one fp32 batch, within
--loss-tol relative) and, with --stage-manifest, `stage_overhead_share` = 1 - (forward/
backward/optimizer seconds) / (stage wall seconds) of a finished SFT stage (its manifest's
`timing.compute_s` and `duration_s`; run e.g. `gti run --config jobs/configs/demo.yaml`).

Usage: python bench/train_throughput/train_throughput.py [--quick] [--rounds 3] [--steps 3] [--batch 8]
          [--stage-manifest runs/demo/sft/_manifest.json]
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared module
import common  # noqa: E402

common.hf_offline()

import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
import torch  # noqa: E402

from gti.common.devices import resolve_precision  # noqa: E402
from gti.lm import new_rows, templates  # noqa: E402
from gti.train import sft_data  # noqa: E402
from gti.train.batching import length_grouped_batches, padded_tokens  # noqa: E402
from gti.train.shards import PadCollate  # noqa: E402
from gti.train.loss import labelled_loss  # noqa: E402

LEVELS, CODEBOOK = 3, 64


def load(seed: int):
    path = common.smollm2_path()
    tok, codec, first, end = common.sid_tokenizer(path, LEVELS, CODEBOOK)
    model = common.load_lm(path)
    items = common.bundled_items()
    rng = np.random.default_rng(seed)
    flat = rng.choice(CODEBOOK ** LEVELS, items.height, replace=False)
    codes = np.stack([(flat // CODEBOOK ** (LEVELS - 1 - j)) % CODEBOOK for j in range(LEVELS)], 1)
    sid = codec.token_ids_from_offset(torch.from_numpy(codes), first).numpy()
    return path, model, tok, first, end, items, sid


def fresh_model(path, first: int, end: int, task: str, seed: int):
    """SmolLM2 + noise-initialised SID rows: all parameters trainable (sft) or split new rows
    only (ground)."""
    model = common.load_lm(path)
    rows = common.noise_rows(model.get_input_embeddings().weight.detach()[:first], end - first, seed)
    new_rows.attach_new_rows(model, first, end - first, rows)
    if task == "ground":
        new_rows.freeze_backbone(model)
    else:
        new_rows.merge_new_rows(model)
        for p in model.parameters():
            p.requires_grad_(True)
    model.train()
    return model


def sft_rows(tok, items, sid, style: str, n: int, seed: int) -> list[dict]:
    seqs = common.bundled_sequences()
    seqs = seqs.select("user_id", train_items=pl.col("item_id").list.slice(0, pl.col("item_id").list.len() - 2),
                       valid_item=pl.col("item_id").list.get(-2), test_item=pl.col("item_id").list.get(-1))
    w = sft_data.training_windows(seqs, 10, seed=seed)
    w = w[np.random.default_rng(seed).permutation(w.height)[:n]]
    sid_ids = dict(zip(items["item_id"].to_list(), sid))
    r = templates.make_renderer(tok, sid_ids, common.SYSTEM, 256, prompt_style=style)
    out = r.render_windows(w.select("history", "target", "template").to_dict(as_series=False))
    return [{"input_ids": a, "labels": b} for a, b in zip(out["input_ids"], out["labels"])]


def ground_rows(tok, items, sid, n: int, seed: int) -> list[dict]:
    from gti.common.arms import DEFAULT_GROUNDING_TEMPLATES

    pr = templates.PairRenderer(tok, dict(DEFAULT_GROUNDING_TEMPLATES), common.SYSTEM, 128)
    idx = np.random.default_rng(seed).permutation(items.height)[: max(1, n // 6 + 1)]
    sub = items[idx]
    desc = [(d or "")[:300] for d in sub["description"].to_list()]
    rows = [r for per in pr.render_batch(sub["title"].to_list(), desc, list(sid[idx])) for r in per]
    return [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows[:n]]


def batches(rows: list[dict], micro: int, grouped: bool, seed: int) -> list[list[dict]]:
    if grouped:
        lengths = [len(r["input_ids"]) for r in rows]
        idx = length_grouped_batches(lengths, micro, seed, window=32)
    else:
        perm = np.random.default_rng(seed).permutation(len(rows))
        idx = [perm[i: i + micro] for i in range(0, len(rows), micro)]
    return [[rows[i] for i in b] for b in idx]


class Path_:
    """One training path: a model, its optimizer and how it computes the loss."""

    def __init__(self, model, gti: bool, precision: str, lr: float) -> None:
        if gti:  # attn_implementation: auto = eager on CPU (gti.train.loss.set_training_attention)
            from gti.train.loss import set_training_attention

            set_training_attention(model, "auto", torch.cuda.is_available())
        self.model, self.gti = model, gti
        self.autocast = gti and precision == "bf16"
        # gti's DeepSpeed config runs torch's fused AdamW (gti.train.deepspeed_config).
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, fused=gti)

    def step(self, b: dict[str, torch.Tensor]) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            if self.gti:
                loss = labelled_loss(self.model, b["input_ids"], b["attention_mask"], b["labels"])
            else:
                loss = self.model(**b).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


def run_task(name, path, first, end, rows_plain, rows_gti, micro, rounds, steps, precision, pad_id, seed, log):
    collate = PadCollate(pad_id)
    plain_b = batches(rows_plain, micro, grouped=False, seed=seed)
    gti_b = batches(rows_gti, micro, grouped=True, seed=seed)
    n = min(len(plain_b), len(gti_b), rounds * steps)
    task = "ground" if name == "ground" else "sft"
    paths = {
        "plain": Path_(fresh_model(path, first, end, task, seed), gti=False, precision="fp32", lr=1e-4),
        "gti": Path_(fresh_model(path, first, end, task, seed), gti=True, precision=precision, lr=1e-4),
    }
    bs = {"plain": plain_b, "gti": gti_b}
    # One warm-up step each (allocator, oneDNN kernels), not timed.
    for k in paths:
        paths[k].step(collate(_cols(bs[k][-1])))
    secs = {"plain": 0.0, "gti": 0.0}
    ex = {"plain": 0, "gti": 0}
    tok = {"plain": 0, "gti": 0}
    for r in range(rounds):
        order = ["plain", "gti"] if r % 2 == 0 else ["gti", "plain"]
        for k in order:
            for i in range(r * steps, min((r + 1) * steps, n)):
                b = collate(_cols(bs[k][i]))
                t0 = time.perf_counter()
                paths[k].step(b)
                secs[k] += time.perf_counter() - t0
                ex[k] += b["input_ids"].shape[0]
                tok[k] += int(b["input_ids"].numel())
        log(f"{name} round {r + 1}/{rounds}: plain {ex['plain'] / secs['plain']:.2f} ex/s, "
            f"gti {ex['gti'] / secs['gti']:.2f} ex/s")
    return {k: ex[k] / secs[k] for k in paths}, {k: tok[k] / max(ex[k], 1) for k in paths}


def _cols(rows: list[dict]) -> dict[str, list]:
    return {"input_ids": [r["input_ids"] for r in rows], "labels": [r["labels"] for r in rows]}


def loss_match(path, first, end, rows, pad_id, tol: float) -> tuple[bool, float, float]:
    model = fresh_model(path, first, end, "sft", 0)
    b = PadCollate(pad_id)(_cols(rows[:8]))
    with torch.no_grad():
        hf = float(model(**b).loss)
        ours = float(labelled_loss(model, b["input_ids"], b["attention_mask"], b["labels"]))
    return abs(hf - ours) <= tol * abs(hf), hf, ours


def scaffold_share(tok, rows_chat: list[dict], rows_compact: list[dict], sid_lo: int, sid_hi: int) -> dict:
    """Share of each chat SFT row that is neither a SID token nor the answer's end of turn."""
    def stats(rows):
        lens = np.array([len(r["input_ids"]) for r in rows])
        sid = np.array([sum(sid_lo <= t < sid_hi for t in r["input_ids"]) for r in rows])
        return lens, sid
    lc, sc = stats(rows_chat)
    lk, _ = stats(rows_compact)
    return {"chat_mean_tokens": float(lc.mean()), "compact_mean_tokens": float(lk.mean()),
            "chat_scaffold_share": float(1 - (sc.sum() / lc.sum())),
            "chat_max_tokens": int(lc.max()), "compact_max_tokens": int(lk.max())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 1 step each (about a minute)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="steps per path per round")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--loss-tol", type=float, default=1e-5)
    ap.add_argument("--stage-manifest", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 1, 1
    torch.manual_seed(args.seed)
    torch.set_num_threads(os.cpu_count() or 1)

    def log(m):
        print(m, file=sys.stderr, flush=True)

    precision = resolve_precision(args.precision)
    path, _, tok, first, end, items, sid = load(args.seed)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    n = args.rounds * args.steps * args.batch
    chat = sft_rows(tok, items, sid, "chat", n, args.seed)
    compact = sft_rows(tok, items, sid, "compact", n, args.seed)
    pairs = ground_rows(tok, items, sid, n, args.seed)
    shares = scaffold_share(tok, chat, compact, first, end)
    log(f"rows: {shares}")
    match, hf_loss, our_loss = loss_match(path, first, end, chat, pad_id, args.loss_tol)
    log(f"loss match: hf {hf_loss:.7f} labelled {our_loss:.7f} -> {match}")

    same = dict(micro=args.batch, rounds=args.rounds, steps=args.steps, precision=precision,
                  pad_id=pad_id, seed=args.seed, log=log)
    sft, sft_tok = run_task("sft", path, first, end, chat, chat, **same)
    comp, comp_tok = run_task("sft-compact", path, first, end, chat, compact, **same)
    gr, gr_tok = run_task("ground", path, first, end, pairs, pairs, **same)
    lengths = [len(r["input_ids"]) for r in chat]
    out = {
        "sft_speedup": round(sft["gti"] / sft["plain"], 2),
        "ground_speedup": round(gr["gti"] / gr["plain"], 2),
        "sft_compact_speedup": round(comp["gti"] / comp["plain"], 2),
        "loss_match": bool(match),
        "loss_hf": hf_loss, "loss_labelled": our_loss,
        "sft_examples_per_s": {k: round(v, 3) for k, v in sft.items()},
        "sft_compact_examples_per_s": {k: round(v, 3) for k, v in comp.items()},
        "ground_examples_per_s": {k: round(v, 3) for k, v in gr.items()},
        "padded_tokens_per_example": {"sft": {k: round(v, 1) for k, v in sft_tok.items()},
                                      "sft_compact": {k: round(v, 1) for k, v in comp_tok.items()},
                                      "ground": {k: round(v, 1) for k, v in gr_tok.items()}},
        "grouping_padding_ratio": round(
            padded_tokens(lengths, length_grouped_batches(lengths, args.batch, args.seed, window=32))
            / padded_tokens(lengths, [np.arange(i, min(i + args.batch, len(lengths))) for i in range(0, len(lengths), args.batch)]), 3),
        **shares,
        "precision": precision,
        "batch": args.batch, "rounds": args.rounds, "steps_per_round": args.steps,
        "load_avg": os.getloadavg()[0], "cpus": os.cpu_count(), "machine": platform.machine(),
    }
    if args.stage_manifest:
        m = json.loads(Path(args.stage_manifest).read_text())
        timing = m["facts"].get("timing") or {}
        wall = float(m["duration_s"])
        out["stage_overhead_share"] = round(1 - float(timing["compute_s"]) / wall, 3)
        out["stage_wall_s"] = round(wall, 1)
        out["stage_compute_s"] = round(float(timing["compute_s"]), 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
