#!/usr/bin/env bash
# Recipe search for the model (issue 50): one SFT recipe at a time on top of shared upstream
# stages, scored on the VALID split only. Resumable: a recipe whose metrics exist is skipped.
#
#   bench/quality/recipe_runs.sh BASE_RUN_DIR CONFIG NAME 'key=value ...' [NAME 'overrides' ...]
#
# BASE_RUN_DIR holds ingest..ground of CONFIG (gti run --config CONFIG run_dir=BASE --to ground
# with the same upstream overrides, e.g. sid.seed=1); each recipe runs `--from sft --to evaluate`
# in BASE_RUN_DIR/r_NAME with the upstream stage folders hard-linked in, and appends one line
# (recipe, overrides, valid metrics, SFT facts) to BASE_RUN_DIR/recipes.jsonl.
set -euo pipefail
base=$1; config=$2; shift 2
gti=${GTI:-.venv/bin/gti}
while [ $# -ge 2 ]; do
  name=$1; overrides=$2; shift 2
  dir=$base/r_$name
  if [ -f "$dir/evaluate/metrics.json" ]; then echo "skip $name (done)"; continue; fi
  mkdir -p "$dir"
  for st in ingest embed sid pairs ground; do
    [ -e "$dir/$st" ] || cp -al "$base/$st" "$dir/$st"
  done
  echo "== $name: $overrides ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"
  # shellcheck disable=SC2086
  from=sft; [ -f "$dir/sft/_manifest.json" ] && from=evaluate  # resume: SFT already done
  $gti run --config "$config" run_dir="$dir" $overrides 'eval.splits=[valid]' --from $from --to evaluate
  python3 - "$dir" "$name" "$overrides" >> "$base/recipes.jsonl" <<'PY'
import json, sys
d, name, ov = sys.argv[1:4]
m = json.load(open(f"{d}/evaluate/metrics.json"))
sft = json.load(open(f"{d}/sft/_manifest.json"))["facts"]
keep = ("objective", "steps_done", "steps_resolved", "n_train_rows", "n_targets", "final_loss", "timing")
short = lambda row: {k: v["value"] for k, v in row.items() if isinstance(v, dict) and "value" in v}
print(json.dumps({"recipe": name, "overrides": ov, "valid": short(m["splits"]["valid"]),
                  "baselines": {b: short(r.get("valid", {})) for b, r in m.get("baselines", {}).items()},
                  "paired": m.get("paired", {}).get("valid"), "sft": {k: sft.get(k) for k in keep}}, default=str))
PY
done
