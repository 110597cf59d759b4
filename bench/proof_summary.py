"""The proof comparison's figures from its committed records, whatever runs have finished
(bench/RESULTS.md, "All seven runs"): per-seed test metrics, the report's own metrics table with
`mean` and then `random` as the reference arm (2,000 user-bootstrap resamples, lifts paired over
users), the geometry after grounding and SFT, and how much of the histories the proof config's
`data.max_history` keeps (when its dense subset, `gti data dense --items 1000 --min-user-len 5
--out data/dense-1000`, is on disk). No run, no Ray; seconds.

Usage: python bench/proof_summary.py [RECORDS_DIR] [--data DIR]   (default
bench/proof-smollm2/records and data/dense-1000; `--quick` is accepted and changes nothing:
`make bench` passes it to every bench script)
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
from gti.diagnostics.report import RunRecord  # noqa: E402
from gti.diagnostics.tables import diagnostics_table, metrics_table  # noqa: E402

M = ["recall@5", "recall@10", "recall@20", "ndcg@5", "ndcg@10", "ndcg@20", "mrr", "mean_percentile_rank"]


def f3(v):
    return "" if v is None else f"{v:.3f}"


def pc(v):
    return "" if v is None else f"{100 * v:+.0f}%"


def read_records(rdir: Path):
    recs, facts = [], {}
    for f in sorted(rdir.glob("*/seed*.json")):
        doc = json.loads(f.read_text())
        recs.append(RunRecord(**doc["record"]))
        facts[(doc["arm"], doc["seed"])] = doc["facts"]
    if not recs:
        sys.exit(f"proof_summary: no records (<arm>/seed<s>.json) under {rdir}")
    return recs, facts


def print_metrics(recs, facts) -> None:
    print("per seed (test):")
    for r in recs:
        t = r.metrics["splits"]["test"]
        rk = r.metrics.get("ranks", {}).get("test", {})
        vals = [t[m]["value"] if m in t else rk.get(m, {}).get("value") for m in M]
        print(f"  {r.arm} s{r.seed}: " + " ".join(f"{m}={v:.3f}" for m, v in zip(M, vals) if v is not None),
              facts[(r.arm, r.seed)])
    for base in sorted({r.arm for r in recs} & {"mean", "random"}):
        print(f"\nvs {base}:")
        for row in metrics_table(recs, "test", baseline_arm=base, n_boot=2000, seed=0):
            if row["name"] in M:
                print(f"  {row['arm']:7s} {row['name']:22s} n={row['n']} {f3(row['mean'])} ±{f3(row['std'])} "
                      f"[{f3(row['ci_lo'])}, {f3(row['ci_hi'])}] lift {pc(row['lift'])} "
                      f"[{pc(row['lift_ci_lo'])}, {pc(row['lift_ci_hi'])}] {row['verdict'] or ''}")
    print("\ndiagnostics:")
    for row in diagnostics_table(recs, n_boot=2000):
        if row["name"] in ("effective_rank", "rsa_pearson", "rsa_spearman", "block_contrast"):
            print(f"  {row['arm']:7s} {row['group']:6s} {row['name']:15s} n={row['n']} {f3(row['mean'])} "
                  f"±{f3(row['std'])} [{f3(row['ci_lo'])}, {f3(row['ci_hi'])}] {row['ci_method']}")


def print_history_coverage(data: Path, lengths=(5, 10, 20)) -> None:
    """Share of SFT windows, of history items and of test users that a history cap cuts, from
    the pipeline's own leave-one-out split and windows (gti.data.sequences,
    gti.train.sft_data) taken uncapped."""
    import numpy as np
    import polars as pl

    from gti.data.sequences import build_sequences
    from gti.train.sft_data import eval_windows, training_windows

    path = data / "interactions.parquet"
    if not path.is_file():
        print(f"\nhistory coverage: {path} missing (gti data dense --items 1000 --min-user-len 5 --out {data})")
        return
    df = pl.read_parquet(path).with_row_index("order").with_columns(pl.col("order").cast(pl.Int64))
    seqs = build_sequences(df, min_seq_len=3).sequences
    uncapped = 10**9
    hist = training_windows(seqs, uncapped)["history"].list.len().to_numpy().astype(np.int64)
    test = eval_windows(seqs, "test", uncapped)["history"].list.len().to_numpy().astype(np.int64)
    print(f"\nhistory coverage ({path}): {seqs.height} users, median test history {np.median(test):.0f} "
          f"items, {hist.size} SFT windows")
    for h in lengths:
        print(f"  max_history={h:2d}: windows cut {np.mean(hist > h):.3f}, history items dropped "
              f"{np.maximum(hist - h, 0).sum() / hist.sum():.3f}, test users cut {np.mean(test > h):.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="?", default=str(ROOT / "bench" / "proof-smollm2" / "records"))
    ap.add_argument("--data", default=str(ROOT / "data" / "dense-1000"))
    ap.add_argument("--quick", action="store_true", help="accepted for `make bench`; changes nothing")
    args = ap.parse_args(argv)
    print_metrics(*read_records(Path(args.records)))
    print_history_coverage(Path(args.data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
