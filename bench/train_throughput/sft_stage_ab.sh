#!/usr/bin/env bash
# The demo's SFT stage in Ray Train, two code versions A/B interleaved (A B, B A, ...).
# Usage: bench/train_throughput/sft_stage_ab.sh RUN_DIR PLATFORM_A PLATFORM_B [ROUNDS] [STEPS]
#   RUN_DIR: a finished `make demo` run (its ingest..ground are hard-linked into each trial);
#   PLATFORM_A/B: the `platform/` folders of two checkouts (put first on PYTHONPATH, so the
#   driver and the Ray workers it starts import that version of gti).
# Prints one JSON line per trial: the SFT manifest's compute seconds per step (timing.compute_s
# over the steps; the first step's lazy set-up included) and the stage's seconds.
set -euo pipefail
RUN=$(realpath "$1"); A=$(realpath "$2"); B=$(realpath "$3"); ROUNDS=${4:-2}; STEPS=${5:-30}
ROOT=$(cd "$(dirname "$0")/../.." && pwd); PY=${PY:-$ROOT/.venv/bin/python}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/sft-ab.XXXXXX")
trial() {  # trial NAME PLATFORM ROUND
    local dir=$WORK/$1-$3
    cp -al "$RUN" "$dir"
    rm -rf "$dir"/{sft,rl,evaluate,report,.sft.partial,tensorboard/sft}
    (cd "$ROOT" && PYTHONPATH=$2 "$PY" -m gti run --config jobs/configs/demo.yaml "run_dir=$dir" --from sft --to sft \
        "sft.steps=$STEPS" "sft.checkpoint_every=$STEPS" "sft.val_every=$STEPS" sft.val_users=2 sft.warmup_steps=5 \
        > "$dir.log" 2>&1)
    "$PY" -c 'import json, sys
m = json.load(open(sys.argv[1] + "/sft/_manifest.json"))
print(json.dumps({"arm": sys.argv[2], "round": int(sys.argv[3]), "stage_s": round(m["duration_s"], 1),
                  "compute_s_per_step": round(m["facts"]["timing"]["compute_s"] / int(sys.argv[4]), 3)}))' \
        "$dir" "$1" "$3" "$STEPS"
    rm -rf "$dir"
}
echo "load $(cut -d' ' -f1 /proc/loadavg) at the start; trials in $WORK" >&2
for r in $(seq 1 "$ROUNDS"); do
    if (( r % 2 )); then trial A "$A" "$r"; trial B "$B" "$r"; else trial B "$B" "$r"; trial A "$A" "$r"; fi
done
echo "load $(cut -d' ' -f1 /proc/loadavg) at the end" >&2
