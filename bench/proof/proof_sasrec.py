"""The proof comparison's SASRec row (issue 29 item 5): SASRec trained and scored as the evaluate
stage would, on the proof configuration's data and test users, paired against the committed
arm records.

Why a script: the proof comparison (`jobs/configs/proof-smollm2.yaml`, records in
bench/proof/smollm2/records) was evaluated before the evaluate stage had a SASRec row, and
rerunning the arms costs hours. SASRec needs none of the arms' outputs, only the data and the
test users, so it is added here with the pipeline's own functions. No Ray; a few minutes.

What it does:
1. Data: `gti data dense --items 1000 --min-user-len 5` of the bundled amazon-scientific set
   (`gti.data.dense.cli_main`, what made data/dense-1000), then the ingest stage's body in
   process (`gti.stages.ingest.ingest` with `local_stream`: the same batches as its Ray
   stream). Or `--run-dir`: an ingest output the pipeline made (runs/<x>, runs/<x>/ingest or a
   compare's shared/). The content hashes of items.parquet and sequences.parquet
   (`gti.experiments.records.table_hash`) are checked against the records' "shared" hashes,
   and the evaluate stage's user sample of these sequences against the records' users.
2. Test users: the records' per_user.test.user_ids (the same list in every record, checked);
   the split frame by the evaluate stage's `split_frame` (`gti.eval.slices`; history: the last
   data.max_history items before the target, the LM's prompt; SASRec reads each user's whole
   training sequence instead, `sasrec_histories`, keeping its own last max_len); the catalog in the SID map's row order, which is
   items.parquet's (the embed stage keeps it, the sid stage keeps embed's), or the sid map
   itself beside `--run-dir`.
3. SASRec: `gti.eval.reference.fit_reference_models` with the config's eval.sasrec (the proof
   config sets none: today's defaults, i.e. tuned on the valid split by eval.sasrec.sweep) and
   seed, scored with exact ranks by `add_reference_columns` on `sasrec_histories` (as the
   evaluate stage's `reference_frames`), its rows and MostPop's and Markov's by `reference_block`
   (eval.bootstrap resamples, the config's seed). MostPop and Markov are recomputed on all
   the records' users with each record's seed and checked against that record's figures.
4. Paired differences arm - SASRec on the same users (`gti.eval.metrics.paired_bootstrap_ci`),
   per record and per arm pooled over its seeds (each user's mean over the seeds, as the
   report's `_user_means`).
5. Writes bench/proof/smollm2/sasrec.json, whose "record" block has a run record's layout
   (arm "sasrec"), so bench/proof/proof_summary.py and the report read SASRec as one more arm;
   prints a markdown table for bench/proof/RESULTS.md and the paired differences.

`--quick` (what `make bench` passes): the first 30 test users and 2 SASRec epochs (the sweep
off: one fixed setting, `sasrec_params`), written under --work (the committed sasrec.json is
left alone); under a minute.

What it does not know: the LM, SIDs, Ray. The arms' figures are read from the records, never
recomputed. SASRec is trained once (one seed), so its CIs cover users, not SASRec's seeds.

Usage: python bench/proof/proof_sasrec.py [--records DIR] [--run-dir DIR] [--work DIR] [--out FILE]
       [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared module
import common  # noqa: E402

ROOT = common.ROOT
sys.path.insert(0, str(ROOT / "platform"))
from gti import config as C  # noqa: E402
from gti.diagnostics.runs import RunRecord, _per_user, _user_means  # noqa: E402 - the report's per-user reading
from gti.eval.metrics import bootstrap_ci, paired_bootstrap_ci  # noqa: E402

CONFIG = common.CONFIGS / "proof-smollm2.yaml"
RECORDS = Path(__file__).resolve().parent / "smollm2" / "records"
OUT = RECORDS.parent / "sasrec.json"
# What made the config's data/dense-1000 (its header says so).
DENSE = dict(items_path="bundled:amazon-scientific", interactions_path=None, items=1000, min_user_len=5)
M = ["recall@5", "recall@10", "recall@20", "ndcg@5", "ndcg@10", "ndcg@20", "mrr", "mean_percentile_rank"]
HEAD = ["Recall@5", "Recall@10", "Recall@20", "NDCG@5", "NDCG@10", "NDCG@20", "MRR", "mean pct. rank (lower better)"]
REF_ROWS = {"sasrec": "SASRec", "mostpop": "MostPop", "markov": "Markov-1"}
QUICK_USERS, QUICK_EPOCHS = 30, 2
# sequences.parquet's columns when the records were made: the global time split (fb92f2e) added
# valid_items / test_items, which changes the whole table's hash but not these columns' content.
RECORDS_SEQ_COLUMNS = ["user_id", "train_items", "valid_item", "test_item"]


def log(msg: str) -> None:
    print(f"[proof_sasrec] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- inputs
def read_records(rdir: Path) -> list[tuple[dict, RunRecord]]:
    out = []
    for f in sorted(rdir.glob("*/seed*.json")):
        doc = json.loads(f.read_text())
        out.append((doc, RunRecord(**doc["record"])))
    if not out:
        sys.exit(f"proof_sasrec: no records (<arm>/seed<s>.json) under {rdir}")
    return out


def test_users(recs: list[tuple[dict, RunRecord]]) -> list[str]:
    """The records' test users; refused unless every record evaluated the same list (the
    paired differences need the same users in the same order)."""
    lists = {f"{r.arm}/seed{r.seed}": r.metrics["per_user"]["test"]["user_ids"] for _, r in recs}
    first = next(iter(lists.values()))
    differ = [k for k, v in lists.items() if v != first]
    if differ:
        sys.exit(f"proof_sasrec: records {differ} have other test users than {next(iter(lists))}")
    return list(first)


def build_ingest(cfg_path: Path, work: Path) -> Path:
    """data/dense-1000 and its ingest output, made in process under `work`; -> the ingest folder."""
    from gti.run import pipeline
    from gti.run.contract import StageContext
    from gti.data import dense
    from gti.stages import ingest
    from gti.data.batches import local_stream

    data = work / "dense-1000"
    with contextlib.redirect_stdout(sys.stderr):  # stdout is for the tables
        dense.cli_main(argparse.Namespace(**DENSE, out=str(data)))
    cfg = C.load(str(cfg_path), [f"run_dir={work / 'run'}", f"data.items.path={data / 'items.parquet'}",
                                 f"data.interactions.path={data / 'interactions.parquet'}"])
    out = work / "ingest"
    shutil.rmtree(out, ignore_errors=True)  # ingest writes its files from scratch
    out.mkdir(parents=True)
    ctx = StageContext(spec=pipeline.spec("ingest"), cfg=cfg, run_dir=work / "run", work_dir=out,
                       fingerprint="proof_sasrec")
    ingest.ingest(ctx, local_stream)
    return out


def ingest_dir(path: Path) -> Path:
    for d in (path / "ingest", path / "compare" / "shared" / "ingest", path):
        if (d / "sequences.parquet").is_file() and (d / "items.parquet").is_file():
            return d
    sys.exit(f"proof_sasrec: no ingest output (items.parquet, sequences.parquet) under {path}")


def load_data(d: Path):
    """(sequences, catalog, where the catalog order came from) of an ingest folder."""
    import polars as pl

    from gti.data.sequences import check_sequences

    seqs = pl.read_parquet(d / "sequences.parquet")
    check_sequences(seqs, str(d / "sequences.parquet"))
    sid_map = d.parent / "sid" / "sid_map.parquet"
    src = sid_map if sid_map.is_file() else d / "items.parquet"
    return seqs, pl.read_parquet(src, columns=["item_id"])["item_id"].to_list(), str(src)


def data_identity(d: Path, recs, seqs, cfg, users: list[str]) -> dict:
    """The ingest tables' hashes against the records' "shared" ones, and whether the evaluate
    stage's user sample (eval.max_users, eval.sample_seed) of these sequences is the records'."""
    from gti.experiments.records import table_hash
    from gti.eval.slices import eval_users

    out = {}
    for name in ("items", "sequences"):
        key = f"ingest/{name}"
        ours, theirs = table_hash(d / f"{name}.parquet"), {(doc.get("shared") or {}).get(key) for doc, _ in recs}
        out[key] = {"computed": ours, "records": sorted(map(str, theirs)), "match": theirs == {ours}}
        if name == "sequences" and theirs != {ours}:
            cols = table_hash(d / f"{name}.parquet", RECORDS_SEQ_COLUMNS)
            out[key] |= {"computed_on_records_columns": cols, "columns": RECORDS_SEQ_COLUMNS,
                         "match": theirs == {cols}}
    ec = cfg.eval
    sample = eval_users(seqs, ec.max_users, cfg.seed if ec.sample_seed is None else ec.sample_seed)
    out["eval_users"] = {"match": sample == users, "n": len(sample)}
    out["all_match"] = all(v["match"] for v in out.values())
    return out


# --------------------------------------------------------------------------- SASRec and baselines
def sasrec_params(params: dict, epochs: int | None) -> dict:
    """eval.sasrec's block (`params`, its model_dump) with `epochs` set when given: then the
    valid-split sweep (eval.sasrec.sweep, on by default) is turned off, or its own epochs values
    would override these; one fixed setting trains (max_len: eval.sasrec.max_len)."""
    if epochs is None:
        return params
    return {**params, "epochs": epochs, "sweep": {**params["sweep"], "enabled": False}}


def reference(seqs, catalog: list[str], users: list[str], cfg, epochs: int | None):
    """The evaluate stage's reference rows on `users` (test split): SASRec fitted and scored as
    `reference_frames` does, then `reference_block` for sasrec, mostpop and markov.
    -> (reference_block's dict, SASRec's facts)."""
    from gti.eval.reference import add_reference_columns, fit_reference_models, reference_block, sasrec_histories
    from gti.eval.slices import split_frame

    ec, ks = cfg.eval, list(cfg.eval.ks)
    frame = split_frame(seqs, "test", users, cfg.data.max_history)
    if frame["user_id"].to_list() != users:
        sys.exit("proof_sasrec: the split frame's users are not the records' (order or set)")
    params = sasrec_params(ec.sasrec.model_dump(), epochs)
    models = fit_reference_models(seqs, catalog, ["sasrec"], cfg.data.max_history, params, cfg.seed, log)
    t0 = time.time()
    # SASRec reads each user's whole training sequence (train items + valid item), keeping its own
    # last max_len, as the evaluate stage's reference_frames passes it; not the LM's history column
    frame = add_reference_columns(frame, models, max(ks), ec.exact_rank, sasrec_histories(seqs, frame, "test"))
    facts = dict(models["sasrec"].facts, score_seconds=round(time.time() - t0, 2), params=params)
    ref = reference_block(seqs, "test", frame, ks, ec.bootstrap, cfg.seed, catalog, list(REF_ROWS), ec.exact_rank)
    return ref, facts


def max_diff(a: dict, b: dict) -> float:
    """Largest |difference| between two {"value", "ci": [lo, hi]} entries, CI bounds included."""
    return max(abs(a["value"] - b["value"]), *(abs(x - y) for x, y in zip(a["ci"], b["ci"])))


def baseline_check(seqs, catalog: list[str], users: list[str], recs, cfg) -> dict:
    """MostPop and Markov on all the records' users with each record's seed and bootstrap count
    (the evaluate stage's settings for that run) against the record's own figures, value and CI."""
    from gti.eval.reference import baseline_rows
    from gti.eval.slices import split_frame

    frame = split_frame(seqs, "test", users, cfg.data.max_history)
    ks, out, cache = list(cfg.eval.ks), {}, {}
    for _, r in recs:
        seed, n_boot = r.config.get("seed", r.seed), r.metrics["config"]["bootstrap"]
        if (seed, n_boot) not in cache:
            cache[(seed, n_boot)] = baseline_rows(seqs, "test", frame, ks, n_boot, seed, catalog, ["mostpop", "markov"])
        ours, diff = cache[(seed, n_boot)], 0.0
        for b, table in ours.items():
            recorded = r.metrics["baselines"][b]["test"]
            for m, e in table.items():
                # hr@K is recall@K's cell under the field's name (one target per row); records
                # written before it existed hold recall@K only.
                diff = max(diff, max_diff(e, recorded[m if m in recorded else m.replace("hr@", "recall@")]))
        out[f"{r.arm}/seed{r.seed}"] = {"match": diff < 1e-12, "max_abs_diff": diff, "computed": ours,
                                        "record": {b: t["test"] for b, t in r.metrics["baselines"].items()}}
    return out


def sasrec_record(ref: dict, facts: dict, cfg, n_users: int) -> dict:
    """SASRec's rows in a run record's layout (arm "sasrec"), for the report's tables."""
    ec = cfg.eval
    metrics = {"splits": {"test": ref["baselines"]["sasrec"]}, "ranks": {"test": ref["ranks"].get("sasrec", {})},
               "per_user": {"test": ref["per_user"]["sasrec"]}, "n_users": {"test": n_users},
               "config": {"ks": list(ec.ks), "bootstrap": ec.bootstrap, "exact_rank": ec.exact_rank,
                          "max_users": ec.max_users}}
    return {"arm": "sasrec", "seed": cfg.seed, "metrics": metrics,
            "config": {"seed": cfg.seed, "eval": {"sasrec": facts["params"]}},
            "timing": {"sasrec_train_s": facts["train_seconds"], "sasrec_score_s": facts["score_seconds"]}}


# --------------------------------------------------------------------------- rows and pairs
def _aligned(per_user, users: list[str]) -> dict[str, np.ndarray]:
    """{metric: values in `users` order} for every metric `per_user(metric)` has ({user: value})."""
    out = {}
    for m in M:
        pu = per_user(m)
        if pu is not None:
            out[m] = np.array([pu[u] for u in users])
    return out


def values(rec: RunRecord, users: list[str]) -> dict[str, np.ndarray]:
    """{metric: per-user values in `users` order} as the report reads them (exact ranks -> 1/rank
    and (rank-1)/(N-1))."""
    return _aligned(lambda m: _per_user(rec, "test", m), users)


def pooled(recs: list[RunRecord], users: list[str]) -> dict[str, np.ndarray]:
    """The same, each user's value averaged over the runs in `recs` (seeds pooled per user)."""
    return _aligned(lambda m: _user_means(recs, "test", m), users)


def cell(v: np.ndarray, n_boot: int, seed: int) -> dict:
    lo, hi = bootstrap_ci(v, n_boot=n_boot, seed=seed)
    return {"value": float(v.mean()), "ci": [lo, hi]}


def rows_and_pairs(recs, sas: RunRecord, users: list[str], n_boot: int, seed: int):
    """Table rows {label: {metric: {value, ci}}} of every record, every arm pooled over its seeds
    and SASRec (each record bootstrapped with its own seed, as its evaluate stage did), and the
    paired differences {label: {metric: {diff, ci}}} of each against SASRec."""
    base = values(sas, users)
    series: dict[str, tuple[dict, int]] = {}
    for arm in sorted({r.arm for _, r in recs}, key=lambda a: (a != "gti", a)):  # gti first
        group = sorted((r for _, r in recs if r.arm == arm), key=lambda r: r.seed)
        for r in group:
            series[f"{arm} seed {r.seed}"] = (values(r, users), r.config.get("seed", r.seed))
        if len(group) > 1:
            series[f"{arm} ({len(group)} seeds pooled)"] = (pooled(group, users), seed)
    rows = {k: {m: cell(v, n_boot, s) for m, v in vals.items()} for k, (vals, s) in series.items()}
    rows["SASRec"] = {m: cell(v, n_boot, seed) for m, v in base.items()}
    pairs = {}
    for k, (vals, _) in series.items():
        pairs[f"{k} - SASRec"] = {}
        for m in M:
            if m in vals and m in base:
                lo, hi = paired_bootstrap_ci(vals[m], base[m], n_boot=n_boot, seed=seed)
                pairs[f"{k} - SASRec"][m] = {"diff": float(np.mean(vals[m] - base[m])), "ci": [lo, hi]}
    return rows, pairs


def rows_check(rows: dict, recs) -> dict:
    """Whether each record's row, recomputed from its per-user values, equals the figures the
    record stores (splits.test, ranks.test), CIs included: the table reads the records right."""
    diff = 0.0
    for _, r in recs:
        for m, e in rows[f"{r.arm} seed {r.seed}"].items():
            block = "ranks" if m in ("mrr", "mean_percentile_rank") else "splits"
            diff = max(diff, max_diff(e, r.metrics[block]["test"][m]))
    return {"match": diff < 1e-12, "max_abs_diff": diff}


# --------------------------------------------------------------------------- printing
def f3(x: float, sign: bool = False) -> str:
    x = round(x, 3) + 0.0  # no "-.000"
    s = f"{x:+.3f}" if sign else f"{x:.3f}"
    return s.replace("0.", ".", 1)


def markdown(rows: dict, baselines: dict, pairs: dict, n_users: int) -> str:
    head = "| | " + " | ".join(HEAD) + " |\n|---|" + "---|" * len(HEAD)
    lines = [f"**Test, the same {n_users} users for every row; 95% user-bootstrap CI:**", "", head]
    for label, r in rows.items():
        name = f"**{label}**" if label == "SASRec" else label
        lines.append(f"| {name} | " + " | ".join(
            f"{f3(r[m]['value'])} [{f3(r[m]['ci'][0])}, {f3(r[m]['ci'][1])}]" if m in r else "" for m in M) + " |")
    for b in ("mostpop", "markov"):
        r = baselines[b]
        lines.append(f"| {REF_ROWS[b]} | " + " | ".join(
            f"{f3(r[m]['value'])} [{f3(r[m]['ci'][0])}, {f3(r[m]['ci'][1])}]" if m in r else "" for m in M) + " |")
    lines += ["", "**Paired differences, arm - SASRec on the same users (paired user bootstrap, 95% CI; "
              "for mean pct. rank a negative difference is the better arm):**", "", head]
    for label, p in pairs.items():
        lines.append(f"| {label} | " + " | ".join(
            f"{f3(p[m]['diff'], True)} [{f3(p[m]['ci'][0], True)}, {f3(p[m]['ci'][1], True)}]" if m in p else ""
            for m in M) + " |")
    return "\n".join(lines)


def print_checks(identity: dict, check: dict) -> None:
    for k, v in identity.items():
        if isinstance(v, dict) and "computed" in v:
            on = (f" (whole table); on the records' columns {', '.join(v['columns'])}: "
                  f"{v['computed_on_records_columns']}" if "columns" in v else "")
            print(f"data hash {k}: computed {v['computed']}{on}, records {', '.join(v['records'])}: "
                  f"{'MATCH' if v['match'] else 'DIFFERENT'}")
    eu = identity["eval_users"]
    print(f"evaluate stage's user sample of these sequences ({eu['n']} users) = the records' users: "
          f"{'MATCH' if eu['match'] else 'DIFFERENT'}")
    for run, c in check.items():
        print(f"MostPop/Markov vs record {run}: {'MATCH' if c['match'] else 'DIFFERENT'} "
              f"(max |diff| {c['max_abs_diff']:.2e} over values and CI bounds)")
    first = next(iter(check.values()))
    for b in ("mostpop", "markov"):
        for m in ("recall@5", "recall@10", "recall@20", "ndcg@10"):
            ours, rec = first["computed"][b][m], first["record"][b][m]
            print(f"  {REF_ROWS[b]:8s} {m:9s} computed {ours['value']:.4f} [{ours['ci'][0]:.4f}, {ours['ci'][1]:.4f}]"
                  f"  record {rec['value']:.4f} [{rec['ci'][0]:.4f}, {rec['ci'][1]:.4f}]")


# --------------------------------------------------------------------------- entry point
def run(args) -> dict:
    t0 = time.time()
    recs = read_records(Path(args.records))
    cfg = C.load(str(args.config), [])
    all_users = test_users(recs)
    users = all_users[:QUICK_USERS] if args.quick else all_users
    d = ingest_dir(Path(args.run_dir)) if args.run_dir else build_ingest(Path(args.config), Path(args.work))
    seqs, catalog, catalog_from = load_data(d)
    identity = data_identity(d, recs, seqs, cfg, all_users)
    check = baseline_check(seqs, catalog, all_users, recs, cfg)
    ref, facts = reference(seqs, catalog, users, cfg, QUICK_EPOCHS if args.quick else None)
    record = sasrec_record(ref, facts, cfg, len(users))
    n_boot = cfg.eval.bootstrap
    rows, pairs = rows_and_pairs(recs, RunRecord(**record), users, n_boot, cfg.seed)
    return {
        "bench": "proof_sasrec", "mode": "quick" if args.quick else "full",
        "config": str(args.config), "records": str(args.records),
        "data": {"ingest": str(d), "made": "--run-dir" if args.run_dir else "in process (gti data dense + ingest)",
                 "catalog_order": catalog_from, "n_items": len(catalog), "n_sequences": seqs.height,
                 "identity": identity},
        "n_users": len(users), "user_ids": users, "bootstrap": n_boot, "bootstrap_seed": cfg.seed,
        "sasrec": {"facts": facts, "metrics": {**ref["baselines"]["sasrec"], **ref["ranks"].get("sasrec", {})}},
        "baselines": {b: ref["baselines"][b] for b in ("mostpop", "markov")},
        "baseline_check": {k: {"match": v["match"], "max_abs_diff": v["max_abs_diff"]} for k, v in check.items()},
        "rows": rows, "rows_check": None if args.quick else rows_check(rows, recs), "paired": pairs, "record": record,
        "wall_s": round(time.time() - t0, 1), "_check": check,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", default=str(RECORDS))
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--run-dir", default=None, help="an ingest output the pipeline made (instead of building it)")
    ap.add_argument("--work", default=None, help="where the data is built (default runs/proof-sasrec[-quick])")
    ap.add_argument("--out", default=None, help=f"default {OUT.relative_to(ROOT)} (--quick: <work>/sasrec.json)")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_USERS} users, {QUICK_EPOCHS} SASRec epochs")
    args = ap.parse_args(argv)
    args.work = args.work or str(ROOT / "runs" / ("proof-sasrec-quick" if args.quick else "proof-sasrec"))
    out = Path(args.out) if args.out else (Path(args.work) / "sasrec.json" if args.quick else OUT)
    doc = run(args)
    check = doc.pop("_check")
    print_checks(doc["data"]["identity"], check)
    if doc["rows_check"]:
        rc = doc["rows_check"]
        print(f"arm rows recomputed from per-user values = the records' figures: "
              f"{'MATCH' if rc['match'] else 'DIFFERENT'} (max |diff| {rc['max_abs_diff']:.2e})")
    f = doc["sasrec"]["facts"]
    print(f"\nSASRec: trained {f['train_seconds']:.1f} s ({f['epochs']} epochs, {f['n_windows']:,} windows, "
          f"{f['selection']}), scored {doc['n_users']} users in {f['score_seconds']:.1f} s; script wall "
          f"{doc['wall_s']:.1f} s\n")
    print(markdown(doc["rows"], doc["baselines"], doc["paired"], doc["n_users"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {out}")
    ok = doc["data"]["identity"]["all_match"] and all(c["match"] for c in check.values())
    return 0 if ok and (doc["rows_check"] or {"match": True})["match"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
