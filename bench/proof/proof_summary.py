"""The proof comparison's figures from its committed records, whatever runs have finished
(bench/proof/RESULTS.md, "All seven runs"): per-seed test metrics, the report's own metrics table with
`mean`, then `random`, then `sasrec` as the reference arm (2,000 user-bootstrap resamples, lifts
paired over users, an arm's seeds pooled per user), the geometry after grounding and SFT, and how
much of the histories the proof config's `data.max_history` keeps (when its dense subset, `gti
data dense --items 1000 --min-user-len 5 --out data/dense-1000`, is on disk). No run, no Ray;
seconds.

SASRec: when bench/proof/smollm2/sasrec.json exists (bench/proof/proof_sasrec.py: SASRec on the same
data and test users), its "record" joins the records as the arm `sasrec`: the metrics tables
get its row (the records' own rows stay as without it) and a "vs sasrec" table the paired lifts
of each arm against it; its absolute paired differences (arm - SASRec) are printed as that
script computed them.

`--report DIR` rebuilds the committed report (report.html/json/csv, what `gti compare
--report-only` writes) in DIR with SASRec as its last arm, through the report's own
`build_report`. `gti compare --report-only` itself needs the comparison's shared and arm run
folders, which are not kept; so the runs, their order and the configs the report shows come
from the committed report.json and the records, and every plot from the committed
report.html (the per-arm SID heat maps were drawn from the run folders). The report draws all
its resamples from one stream, so with SASRec added the other arms' CIs move by bootstrap noise
(at most .0044 on this report); values and lifts do not move.

Usage: python bench/proof/proof_summary.py [RECORDS_DIR] [--data DIR] [--sasrec FILE] [--report DIR]
(default bench/proof/smollm2/records, data/dense-1000 and <RECORDS_DIR>/../sasrec.json;
`--quick` is accepted and changes nothing: `make bench` passes it to every bench script)
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared module
import common  # noqa: E402

ROOT = common.ROOT
RECORDS = Path(__file__).resolve().parent / "smollm2" / "records"
sys.path.insert(0, str(ROOT / "platform"))
from gti.diagnostics.runs import RunRecord
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


def read_sasrec(path: Path):
    """(SASRec's run record, its facts) from bench/proof/proof_sasrec.py's output; None when absent.
    Its train time stays out of the record's timing: the wall-time table is for ground + SFT."""
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    r = doc["record"]
    f = doc["sasrec"]["facts"]
    facts = {"sasrec_train_s": f["train_seconds"], "epochs": f["epochs"], "windows": f["n_windows"],
             "selection": f["selection"], "mode": doc["mode"], "users": doc["n_users"]}
    return RunRecord(arm=r["arm"], seed=r["seed"], metrics=r["metrics"], config=r["config"]), facts, doc


def print_sasrec_pairs(doc) -> None:
    print(f"\npaired differences vs SASRec (arm - SASRec, {doc['n_users']} users, paired user bootstrap, "
          f"{doc['bootstrap']} resamples; bench/proof/proof_sasrec.py):")
    for label, p in doc["paired"].items():
        print(f"  {label:32s} " + " ".join(f"{m}={p[m]['diff']:+.3f} [{p[m]['ci'][0]:+.3f}, {p[m]['ci'][1]:+.3f}]"
                                          for m in M if m in p))


def write_report(rdir: Path, sas, out: Path) -> dict:
    """report.{html,json,csv} in `out` from the records (the committed report's runs, order and
    configs) plus SASRec as the last arm, by `build_report` with the proof config's report
    settings; the plots are the committed report.html's."""
    import base64
    import html
    import re
    import tempfile

    from gti import config as C
    from gti.diagnostics.report_files import build_report

    src = rdir.parent
    old = json.loads((src / "report.json").read_text())
    recs, facts = [], []
    for run in old["runs"]:
        if run["arm"] == "sasrec":  # a report rebuilt before: SASRec comes from sasrec.json
            continue
        doc = json.loads((rdir / run["arm"] / f"seed{run['seed']}.json").read_text())
        rec = RunRecord(**doc["record"])
        rec.config = old["configs"].get(rec.arm, rec.config)  # as the report showed them (from the run folders)
        recs.append(rec)
        facts.append(doc["facts"])
    if sas is not None:
        recs.append(sas[0])
        facts.append(sas[1])
    page = (src / "report.html").read_text()
    imgs = {html.unescape(a): b for a, b in re.findall(r'<img alt="([^"]*)" src="data:image/png;base64,([^"]*)"', page)}
    cfg = C.load(str(common.CONFIGS / "proof-smollm2.yaml"), [])
    title = old["title"].split(" + SASRec")[0] + (" + SASRec reference (bench/proof/proof_sasrec.py)" if sas else "")
    with tempfile.TemporaryDirectory() as tmp:
        plots = {}
        for cap, name in old["plots"].items():
            plots[cap] = Path(tmp) / name
            plots[cap].write_bytes(base64.b64decode(imgs[cap]))
        return build_report(recs, out, plots=plots, title=title, baseline_arm=cfg.report.baseline_arm,
                            n_boot=cfg.report.bootstrap, seed=cfg.seed, run_facts=facts)


def lift_rows(recs, sas, base: str) -> list[dict]:
    """metrics_table's rows against `base`. The records' own rows are computed without SASRec:
    the table draws every row's resamples from one stream, so adding an arm would move the
    other arms' CIs (bootstrap noise) away from the figures bench/RESULTS.md quotes; SASRec's
    row, from a table with it, follows each metric's rows."""
    if base == "sasrec":
        return metrics_table(recs + [sas], "test", baseline_arm=base, n_boot=2000, seed=0)
    rows = metrics_table(recs, "test", baseline_arm=base, n_boot=2000, seed=0)
    if sas is None:
        return rows
    extra = {r["name"]: r for r in metrics_table(recs + [sas], "test", baseline_arm=base, n_boot=2000, seed=0)
             if r["arm"] == "sasrec"}
    out = []
    for i, row in enumerate(rows):
        out.append(row)
        if row["name"] in extra and (i + 1 == len(rows) or rows[i + 1]["name"] != row["name"]):
            out.append(extra[row["name"]])
    return out


def print_metrics(recs, facts, sas=None) -> None:
    print("per seed (test):")
    for r in recs + ([sas] if sas is not None else []):
        t = r.metrics["splits"]["test"]
        rk = r.metrics.get("ranks", {}).get("test", {})
        vals = [t[m]["value"] if m in t else rk.get(m, {}).get("value") for m in M]
        print(f"  {r.arm} s{r.seed}: " + " ".join(f"{m}={v:.3f}" for m, v in zip(M, vals) if v is not None),
              facts[(r.arm, r.seed)])
    arms = {r.arm for r in recs} | ({"sasrec"} if sas is not None else set())
    for base in [a for a in ("mean", "random", "sasrec") if a in arms]:
        print(f"\nvs {base}:")
        for row in lift_rows(recs, sas, base):
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
    gti.train.sft_data, gti.eval.slices) taken uncapped."""
    import numpy as np
    import polars as pl

    from gti.data.sequences import build_sequences
    from gti.eval.slices import eval_windows
    from gti.train.sft_data import training_windows

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
    ap.add_argument("records", nargs="?", default=str(RECORDS))
    ap.add_argument("--data", default=str(ROOT / "data" / "dense-1000"))
    ap.add_argument("--sasrec", default=None,
                    help="bench/proof/proof_sasrec.py's output (default <RECORDS>/../sasrec.json)")
    ap.add_argument("--report", default=None, help="rebuild the report (html/json/csv) with SASRec in this folder")
    ap.add_argument("--quick", action="store_true", help="accepted for `make bench`; changes nothing")
    args = ap.parse_args(argv)
    rdir = Path(args.records)
    recs, facts = read_records(rdir)
    sas = read_sasrec(Path(args.sasrec) if args.sasrec else rdir.parent / "sasrec.json")
    if sas is not None:
        facts[("sasrec", sas[0].seed)] = sas[1]
    print_metrics(recs, facts, sas[0] if sas is not None else None)
    if sas is not None:
        print_sasrec_pairs(sas[2])
    print_history_coverage(Path(args.data))
    if args.report:
        paths = write_report(rdir, sas, Path(args.report))
        print(f"\nreport: {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
