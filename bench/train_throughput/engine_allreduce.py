"""Benchmark: a one-rank SFT step through DeepSpeed with and without its gradient all-reduce.

At ZeRO stage 0 DeepSpeed all-reduces every gradient after backward even when the group has one
rank; `gti.train.engine.make_engine` switches that off for one rank (the gradients are the
same bit for bit: tests/train/test_engine.py). This measures what it saves on the demo's SFT
step: SmolLM2-135M with 3 x 64 SID rows merged (every parameter trainable), compact prompts of
the last 3 items, batch 16, ZeRO 0, the resolved precision, fused AdamW and clipping as gti's DeepSpeed config.
One engine; rounds alternate the switch (on, off, on, off, ...) so load hits both alike; the
first steps of each round are warm-up and not timed.

Usage: python bench/train_throughput/engine_allreduce.py [--quick] [--rounds 4] [--steps 4]
The last line printed is one JSON object: seconds per step each way and `skip_over_allreduce`
(steps/s without the all-reduce over steps/s with it).
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

from gti.config.train import SftConfig  # noqa: E402
from gti.common.devices import resolve_precision  # noqa: E402
from gti.lm import templates  # noqa: E402
from gti.train import sft_data  # noqa: E402
from gti.train.batching import length_grouped_batches  # noqa: E402
from gti.train.engine import make_engine  # noqa: E402
from gti.train.loss import make_forward, set_training_attention  # noqa: E402
from gti.train.shards import PadCollate  # noqa: E402

LEVELS, CODEBOOK = 3, 64


def sft_batches(tok, first: int, n_rows: int, batch: int, history: int, seed: int) -> list[dict]:
    """Compact SFT rows of the bundled data's training windows (deterministic random unique
    SIDs), length-grouped into `batch`-row micro-batches, collated ({input_ids, labels,
    attention_mask}: [B, T])."""
    items = common.bundled_items()
    sid, _ = common.catalog_sids(items.height, LEVELS, CODEBOOK, first, seed)
    seqs = common.bundled_sequences().select(
        "user_id", train_items=pl.col("item_id").list.slice(0, pl.col("item_id").list.len() - 2),
        valid_item=pl.col("item_id").list.get(-2), test_item=pl.col("item_id").list.get(-1))
    w = sft_data.training_windows(seqs, history, seed=seed)
    w = w[np.random.default_rng(seed).permutation(w.height)[:n_rows]]
    r = templates.make_renderer(tok, dict(zip(items["item_id"].to_list(), sid.numpy())), common.SYSTEM, 256,
                                prompt_style="compact")
    rows = r.render_windows(w.select("history", "target", "template").to_dict(as_series=False))
    collate = PadCollate(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    lengths = [len(x) for x in rows["input_ids"]]
    return [collate({k: [rows[k][i] for i in b] for k in ("input_ids", "labels")})
            for b in length_grouped_batches(lengths, batch, seed, window=32)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds of 2 timed steps")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per setting, alternating")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each round")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--history", type=int, default=3, help="items per SFT prompt (the demo's max_history)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 2
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if not torch.distributed.is_initialized():  # gloo, as Ray Train sets it up on CPU workers
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(args.seed)
    torch.set_num_threads(os.cpu_count() or 1)
    precision = resolve_precision("auto")

    model, tok, _, first, end = common.smollm2_with_sid_rows(LEVELS, CODEBOOK, args.seed)
    model.train()  # every parameter trainable, as in SFT
    per_round = args.steps + args.warmup
    batches = sft_batches(tok, first, 2 * args.rounds * per_round * args.batch, args.batch, args.history, args.seed)
    set_training_attention(model, "auto", False)
    tc = SftConfig(zero_stage=0, batch_size=args.batch, steps=len(batches), lr=5e-4, warmup_steps=0)
    engine, _ = make_engine(model, list(model.parameters()), tc, 1, use_gpu=False, bf16_weights=False)
    forward = make_forward(model, precision, "cpu")

    seconds: dict[str, list[float]] = {"allreduce": [], "skip": []}
    backward: dict[str, list[float]] = {"allreduce": [], "skip": []}
    it = iter(batches)
    for r in range(2 * args.rounds):
        mode = "allreduce" if r % 2 == 0 else "skip"
        engine.enable_backward_allreduce = mode == "allreduce"
        for s in range(per_round):
            b = next(it)
            t0 = time.perf_counter()
            loss = forward(engine, b)
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()
            t3 = time.perf_counter()
            if s >= args.warmup:
                seconds[mode].append(t3 - t0)
                backward[mode].append(t2 - t1)
        common.log(f"round {r + 1}/{2 * args.rounds} ({mode}): {np.mean(seconds[mode][-args.steps:]):.3f} s/step")
    mean = {k: float(np.mean(v)) for k, v in seconds.items()}
    out = {
        "bench": "engine_allreduce",
        "s_per_step": {k: round(v, 3) for k, v in mean.items()},
        "backward_s": {k: round(float(np.mean(v)), 3) for k, v in backward.items()},
        "skip_over_allreduce": round(mean["allreduce"] / mean["skip"], 3),
        "trainable_params": sum(p.numel() for p in model.parameters()),
        "batch": args.batch, "history": args.history, "rounds": args.rounds, "steps_per_round": args.steps,
        "mean_tokens_per_row": round(float(np.mean([int(b["attention_mask"].sum()) / len(b["attention_mask"])
                                                    for b in batches])), 1),
        "precision": precision, "torch_threads": torch.get_num_threads(),
        "load_avg": os.getloadavg()[0], "cpus": os.cpu_count(), "machine": platform.machine(),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
