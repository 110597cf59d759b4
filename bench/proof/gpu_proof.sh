#!/usr/bin/env bash
# Run: bash bench/proof/gpu_proof.sh [OUT]
# The issue-14 comparison (mean vs gti, SmolLM2-135M, the dense amazon-scientific subset of
# jobs/configs/proof-smollm2.yaml) at a larger budget on ONE GPU, meant to finish within ~10
# minutes: bf16 autocast (precision auto), batch 64, 4x the SFT examples of the CPU run, 1 seed;
# plus the gti+rl arm (issue 32): the gti arm's SFT model, then 100 GRPO steps of 16 prompts x 8
# beam rollouts (rewards hit + 0.5 prefix), the best validation MRR exported.
# Prepared for a session that is lent a GPU; it has NOT been run yet (no GPU in the session that
# wrote it), so its timing is an estimate. Figures go to OUT/report.{html,json,csv}.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/proof-gpu}
GTI=${GTI:-.venv/bin/gti}
# The venv's python (the system python3 may have no torch, or a CPU-only one).
"${PY:-.venv/bin/python}" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this script needs a GPU build of torch and a GPU')"
[ -f data/dense-1000/interactions.parquet ] || "$GTI" data dense --items 1000 --min-user-len 5 --out data/dense-1000
"$GTI" compare --config jobs/configs/proof-smollm2.yaml --arms mean,gti,gti+rl --seeds 1 --out "$OUT" \
  run_dir="$OUT/base" ray_num_cpus=8 compare.records_dir="$OUT/records" \
  embed.num_gpus=0.5 sid.use_gpu=true \
  ground.use_gpu=true ground.steps=200 ground.batch_size=64 ground.checkpoint_every=200 \
  sft.use_gpu=true sft.steps=500 sft.batch_size=64 sft.lr=1e-3 sft.checkpoint_every=500 \
  sft.val_every=100 sft.val_users=128 \
  rl.use_gpu=true rl.steps=100 rl.batch_size=16 rl.group_size=8 rl.val_every=20 rl.checkpoint_every=100 \
  "rl.reward={hit: 1.0, prefix: 0.5}" \
  eval.num_gpus=1 eval.max_users=null eval.batch_users=32
