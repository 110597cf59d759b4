"""RL after SFT against the SFT model alone, on the same test users (issue 32 item 4).

What it is for: reading two finished runs of one configuration, A (rl off: the SFT model is the
run's model) and B (the same run with `rl.enabled`, usually a hard-link copy of A rerun
`--from rl`), and printing the comparison the issue asks for: Recall@5/10/20, NDCG@10, MRR and
mean percentile rank of each, their paired difference B - A with a paired user bootstrap CI
(`gti.eval.metrics.paired_bootstrap_ci`), the cold slice of each, MostPop / Markov-1 / SASRec
on the same users (from A's evaluate), and what the rl stage recorded (the kept step, the
validation curve, reward statistics, where the time went).

What it does not know: how the runs were trained. It refuses runs whose test users differ, or
whose catalogs or SID maps differ (the comparison would not be paired).

Usage: python bench/proof/rl_vs_sft.py --sft RUN_A --rl RUN_B [--boot 2000] [--out FILE]
The last line is one JSON object: per metric {"sft", "rl", "diff", "ci"}, "cold", "baselines",
"rl_facts".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

METRICS = ("recall@5", "recall@10", "recall@20", "ndcg@10")
RANK_METRICS = ("mrr", "mean_percentile_rank")


def evaluate_output(run_dir: Path) -> dict:
    """The evaluate stage's metrics.json of a finished run."""
    from gti.run.manifest import Manifest

    stage = run_dir / "evaluate"
    return json.loads(Path(Manifest.read(stage).output(stage, "metrics")).read_text())


def per_user(metrics: dict, split: str = "test") -> dict[str, np.ndarray]:
    """Per-user values of every compared metric on `split`: the metric@k lists, and MRR and
    percentile rank from the exact ranks (as `gti.eval.rank.rank_metrics` computes them)."""
    pu = metrics["per_user"][split]
    out = {m: np.asarray(pu[m], dtype=np.float64) for m in METRICS}
    ranks = np.asarray(pu["exact_rank"], dtype=np.float64)
    n_items = int(metrics["ranks"][split]["n_items"])
    out["mrr"] = 1.0 / ranks
    out["mean_percentile_rank"] = (ranks - 1.0) / max(n_items - 1, 1)
    return out


def paired(a: dict, b: dict, boot: int, seed: int = 0) -> dict[str, dict]:
    """{metric: {"sft", "rl", "diff", "ci"}}: means of A and B, and B - A with its paired CI."""
    from gti.eval.metrics import paired_bootstrap_ci

    pa, pb = per_user(a), per_user(b)
    if a["per_user"]["test"]["user_ids"] != b["per_user"]["test"]["user_ids"]:
        raise SystemExit("the two runs were evaluated on different test users: not a paired comparison")
    out = {}
    for m in (*METRICS, *RANK_METRICS):
        lo, hi = paired_bootstrap_ci(pb[m], pa[m], n_boot=boot, seed=seed)
        out[m] = {"sft": float(pa[m].mean()), "rl": float(pb[m].mean()), "diff": float((pb[m] - pa[m]).mean()),
                  "ci": [lo, hi]}
    return out


def cold(metrics: dict) -> dict:
    """The cold slice's users, Recall@10 and exact-rank figures (value and CI) of one run."""
    block = metrics["slices"]["cold"]["test"]
    ranks = block.get("ranks") or {}
    return {"n_users": block["n_users"], "recall@10": block["model"].get("recall@10"),
            **{m: ranks.get(m) for m in RANK_METRICS}}


def baselines(metrics: dict) -> dict:
    """MostPop / Markov-1 / SASRec Recall@10 and NDCG@10 (value and CI) on the same users, and
    their exact-rank MRR where the evaluate stage computed it."""
    out = {}
    for name, block in metrics.get("baselines", {}).items():
        t = block.get("test", {})
        out[name] = {m: t.get(m) for m in ("recall@10", "ndcg@10")}
        ranks = metrics.get("baseline_ranks", {}).get(name, {}).get("test") or {}
        if ranks:
            out[name]["mrr"] = ranks.get("mrr")
    return out


def rl_facts(run_dir: Path) -> dict:
    from gti.run.manifest import Manifest

    facts = Manifest.read(run_dir / "rl").facts
    keep = ("best", "stopped_at", "steps_done", "val_history", "step_stats", "time_shares", "n_prompts",
            "reward", "rollout", "group_size", "kl_coef", "precision", "timing")
    return {k: facts[k] for k in keep if k in facts}


def fmt(v) -> str:
    if isinstance(v, dict):
        lo, hi = v.get("ci", [float("nan")] * 2)
        return f"{v['value']:.3f} [{lo:.3f}, {hi:.3f}]"
    return "-" if v is None else f"{v:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft", required=True, help="run A: rl off")
    ap.add_argument("--rl", required=True, help="run B: the same run with rl.enabled")
    ap.add_argument("--boot", type=int, default=2000, help="paired bootstrap resamples")
    ap.add_argument("--out", help="also write the JSON object here")
    args = ap.parse_args(argv)
    a_dir, b_dir = Path(args.sft).resolve(), Path(args.rl).resolve()
    a, b = evaluate_output(a_dir), evaluate_output(b_dir)
    figures = {"paired": paired(a, b, args.boot), "cold": {"sft": cold(a), "rl": cold(b)},
               "baselines": baselines(a), "rl_facts": rl_facts(b_dir),
               "n_users": len(a["per_user"]["test"]["user_ids"])}
    print(f"| metric (test, {figures['n_users']} users) | SFT alone | after RL | RL - SFT (paired) |")
    print("|---|---|---|---|")
    for m, v in figures["paired"].items():
        print(f"| {m} | {v['sft']:.3f} | {v['rl']:.3f} | {v['diff']:+.3f} [{v['ci'][0]:+.3f}, {v['ci'][1]:+.3f}] |")
    for arm in ("sft", "rl"):
        c = figures["cold"][arm]
        print(f"cold slice ({c['n_users']} users), {arm}: Recall@10 {fmt(c['recall@10'])}, MRR {fmt(c['mrr'])}, "
              f"mean pct. rank {fmt(c['mean_percentile_rank'])}")
    for name, v in figures["baselines"].items():
        print(f"{name}: " + ", ".join(f"{m} {fmt(x)}" for m, x in v.items()))
    line = json.dumps(figures, default=float)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
