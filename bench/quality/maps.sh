#!/usr/bin/env bash
# The figure over several SID maps (issue 50): the same config on sid.seed = 0, 1, ... N-1, each
# a whole pipeline run into OUT/sid<k> (ingest and embed do not depend on the SID seed, so map
# k > 0 hard-links them from map 0), then one line per map in OUT/maps.jsonl: the
# model's and every baseline's figures and the paired differences, per split.
#
#   bench/quality/maps.sh CONFIG OUT N [key=value ...]
#
# For a headline figure pass `eval.max_users=null` (every test user): the demo's seeded sample of
# 300 leaves paired CIs of about +-.035 in Recall@10, every user (2,559 on the demo's data) about +-.012
# (bench/quality/RESULTS.md, "Every test user").
#
# Resumable: a map whose metrics exist is skipped; an interrupted run continues where it stopped.
# `gti compare --arms gti --sid-seeds N` does the same through Ray (docs/commands.md); this script
# runs one map at a time, in the foreground of a 2-core machine.
set -euo pipefail
config=$1; out=$2; n=$3; shift 3
gti=${GTI:-.venv/bin/gti}
py=${PY:-.venv/bin/python}
mkdir -p "$out"
for k in $(seq 0 $((n - 1))); do
  dir=$out/sid$k
  if [ -f "$dir/evaluate/metrics.json" ]; then echo "skip map $k (done)"; continue; fi
  mkdir -p "$dir"
  if [ "$k" -gt 0 ] && [ -f "$out/sid0/embed/_manifest.json" ]; then
    for st in ingest embed; do [ -e "$dir/$st" ] || cp -al "$out/sid0/$st" "$dir/$st"; done
  fi
  echo "== map $k ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg), $(grep -c avx512f /proc/cpuinfo | sed 's/^0$/no AVX-512/;s/^[1-9][0-9]*$/AVX-512/'))"
  # shellcheck disable=SC2086
  $gti run --config "$config" run_dir="$dir" sid.seed=$k "$@" --to evaluate
done
# One line per finished map (rewritten each time, so a resumed run lists every map once).
python3 - "$out" > "$out/maps.jsonl" <<'PY'
import glob, json, re, sys
short = lambda row: {key: v["value"] for key, v in row.items() if isinstance(v, dict) and "value" in v}
for f in sorted(glob.glob(f"{sys.argv[1]}/sid*/evaluate/metrics.json")):
    m = json.load(open(f))
    splits = list(m["splits"])
    print(json.dumps({"sid_seed": int(re.search(r"/sid(\d+)/", f).group(1)), "run_dir": f.rsplit("/evaluate/", 1)[0],
                      "model": {s: short(m["splits"][s]) for s in splits},
                      "ci": {s: {key: v.get("ci") for key, v in m["splits"][s].items() if isinstance(v, dict)}
                             for s in splits},
                      "baselines": {b: {s: short(r.get(s, {})) for s in splits} for b, r in m.get("baselines", {}).items()},
                      "paired": m.get("paired", {})}, default=str))
PY
# The table: per map and the mean over maps, the model beside each baseline, and the paired
# differences (user-bootstrap CIs from evaluate's metrics.json).
$py - "$out/maps.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for split in rows[0]["model"] if rows else []:
    print(f"split {split}: {len(rows)} SID maps")
    for r in rows:
        ci = r["ci"][split]
        lo, hi = ci["recall@10"]
        line = f"  sid.seed={r['sid_seed']}: model R@10 {r['model'][split]['recall@10']:.3f} [{lo:.3f}, {hi:.3f}]"
        line += f" NDCG@10 {r['model'][split]['ndcg@10']:.3f}"
        for b, v in r["baselines"].items():
            line += f" | {b} {v[split].get('recall@10', float('nan')):.3f} / {v[split].get('ndcg@10', float('nan')):.3f}"
        print(line)
        for b, p in r["paired"].get(split, {}).items():
            print("     model - " + b + ": " + ", ".join(
                f"{k} {p[k]['value']:+.3f} [{p[k]['ci'][0]:+.3f}, {p[k]['ci'][1]:+.3f}]"
                for k in ("recall@10", "ndcg@10", "mrr@10") if k in p))
    mean = lambda xs: statistics.fmean(xs)
    for k in ("recall@10", "ndcg@10"):
        xs = [r["model"][split][k] for r in rows]
        print(f"  mean over maps: model {k} {mean(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f})", end="")
        for b in rows[0]["baselines"]:
            print(f"; {b} {mean([r['baselines'][b][split][k] for r in rows]):.3f}", end="")
        print()
        for b in rows[0]["paired"].get(split, {}):
            ds = [r["paired"][split][b][k]["value"] for r in rows]
            print(f"    model - {b} {k}: mean {mean(ds):+.3f} over maps ({', '.join(f'{d:+.3f}' for d in ds)}); "
                  f"maps with the paired CI above 0: {sum(r['paired'][split][b][k]['ci'][0] > 0 for r in rows)} of {len(rows)}")
PY
# The mean over maps with one CI: each row's figure averaged over the maps, minus the
# baseline's, resampled by user (bench/quality/pooled.py).
$py "$(dirname "$0")/pooled.py" "$out"
