"""The proof comparison's figures from its committed records, whatever runs have finished
(bench/RESULTS.md, "Seed-level reading"): per-seed test metrics, the report's own metrics
table with `mean` and then `random` as the reference arm (2,000 user-bootstrap resamples,
lifts paired over users), and the geometry after grounding and SFT. No run, no Ray.

Usage: python bench/proof_summary.py [RECORDS_DIR]   (default bench/proof-smollm2/records)
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))
from gti.diagnostics.report import RunRecord
from gti.diagnostics.tables import metrics_table, diagnostics_table

rdir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "proof-smollm2" / "records"
recs, facts = [], {}
for f in sorted(rdir.glob("*/seed*.json")):
    doc = json.loads(f.read_text())
    recs.append(RunRecord(**doc["record"])); facts[(doc["arm"], doc["seed"])] = doc["facts"]
M = ["recall@5", "recall@10", "recall@20", "ndcg@5", "ndcg@10", "ndcg@20", "mrr", "mean_percentile_rank"]
print("per seed (test):")
for r in recs:
    t = r.metrics["splits"]["test"]; rk = r.metrics.get("ranks", {}).get("test", {})
    vals = [t[m]["value"] if m in t else rk.get(m, {}).get("value") for m in M]
    print(f"  {r.arm} s{r.seed}: " + " ".join(f"{m}={v:.3f}" for m, v in zip(M, vals) if v is not None), facts[(r.arm, r.seed)])
f3 = lambda v: "" if v is None else f"{v:.3f}"
pc = lambda v: "" if v is None else f"{100*v:+.0f}%"
for base in ("mean", "random"):
    print(f"\nvs {base}:")
    rows = metrics_table(recs, "test", baseline_arm=base, n_boot=2000, seed=0)
    for row in rows:
        if row["name"] in M:
            print(f"  {row['arm']:7s} {row['name']:22s} n={row['n']} {f3(row['mean'])} ±{f3(row['std'])} "
                  f"[{f3(row['ci_lo'])}, {f3(row['ci_hi'])}] lift {pc(row['lift'])} [{pc(row['lift_ci_lo'])}, {pc(row['lift_ci_hi'])}] {row['verdict'] or ''}")
print("\ndiagnostics:")
for row in diagnostics_table(recs, n_boot=2000):
    if row["name"] in ("effective_rank", "rsa_pearson", "rsa_spearman", "block_contrast"):
        print(f"  {row['arm']:7s} {row['group']:6s} {row['name']:15s} n={row['n']} {f3(row['mean'])} ±{f3(row['std'])} [{f3(row['ci_lo'])}, {f3(row['ci_hi'])}] {row['ci_method']}")
