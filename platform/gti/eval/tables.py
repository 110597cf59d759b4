"""Plain-text tables of evaluation metrics, for the evaluate stage's log and the end-of-run
summary: one row per (split, model) with bootstrap CIs, the cold-item slice's rows, and one
line of rank metrics. Pure formatting: it does not compute any metric."""

from __future__ import annotations

from typing import Any


def format_table(metrics: dict[str, Any], ks: list[int]) -> str:
    """A plain-text table: one row per (split, model), one column per metric@k; then the same
    rows on the cold-item slice (`{split}/sft[cold]`, ...) when metrics has one."""
    from gti.eval import metrics as M

    rows: dict[str, dict] = {}
    for split, vals in metrics["splits"].items():
        rows[f"{split}/sft"] = vals
        for b in metrics["baselines"]:
            rows[f"{split}/{b}"] = metrics["baselines"][b][split]
    cold = metrics.get("slices", {}).get("cold", {})
    for split in metrics["splits"]:
        block = cold.get(split)
        if not block or not block.get("n_users"):
            continue
        rows[f"{split}/sft[cold]"] = block["model"]
        for b, vals in block["baselines"].items():
            rows[f"{split}/{b}[cold]"] = vals
    # HR@K (one target per row, = Recall@K) under the field's name; older metrics have recall only.
    first = next(iter(rows.values()), {})
    names = [("hr" if f"hr@{ks[0]}" in first else "recall"), *M.METRICS[1:]]
    cols = [f"{m}@{k}" for m in names for k in ks]
    n_rows = metrics.get("n_rows") or {}
    text = M.format_table(rows, cols) + (
        f"\ninvalid SID rate: {metrics['invalid_sid_rate']:.4f}   users: "
        + ", ".join(f"{s}={n}" + (f" ({n_rows[s]} rows)" if n_rows.get(s, n) != n else "")
                    for s, n in metrics["n_users"].items())
    )
    if cold:
        d = cold.get("definition", {})
        text += (
            f"\ncold users (target of <= {d.get('max_sft_targets')} SFT windows, "
            f"{d.get('n_cold_items')} cold items): "
            + ", ".join(f"{s}={cold[s]['n_users']}" for s in metrics["splits"] if s in cold)
        )
    return text


def format_ranks(split: str, ranks: dict[str, Any], label: str = "") -> str:
    """One log line of rank metrics (`gti.eval.rank.rank_metrics`)."""
    mrr, pct = ranks["mrr"], ranks["mean_percentile_rank"]
    return (
        f"{split}{label}: MRR {mrr['value']:.4f} [{mrr['ci'][0]:.4f}, {mrr['ci'][1]:.4f}], "
        f"mean percentile rank {pct['value']:.4f} [{pct['ci'][0]:.4f}, {pct['ci'][1]:.4f}], "
        f"median rank {ranks['median_rank']:g} of {ranks['n_items']} items ({ranks['n_users']} users)"
    )
