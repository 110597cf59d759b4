"""What a Ray Train run costs before its first step on a local Ray, per start-up setting
(issue 27, item 4), measured side by side: each trial is a fresh process that starts a local
Ray (4 logical CPUs, as the test session does) and runs `--runs` tiny Train runs in a row
through `gti.train.ray_train.run_trainer`. The worker does what gti's training workers do before
step 1 (import torch, transformers and deepspeed, build a 1-layer Llama, iterate its Ray Data
shard) and reports one checkpoint, so each run's wall time is start-up, not training.

Variants (interleaved: A B C D E, A B C D E, ... `--rounds` times):
- `runtime_env`: today's `fit`: a per-worker runtime_env (TOKENIZERS_PARALLELISM,
  DS_ACCELERATOR) on 2 workers;
- `no_runtime_env`: the same variables inherited from the driver's environment instead;
- `preload`: no_runtime_env + `RAY_preload_python_modules=torch,transformers,deepspeed`
  (pooled workers import them before they are needed);
- `no_prestart`: no_runtime_env + `RAY_prestart_worker_first_driver=0`;
- `one_worker`: no_runtime_env with 1 Train worker instead of 2;
- `fast_poll`: no_runtime_env with the Train controller polling its workers every 0.25 s
  (`RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`; Ray's default is 2 s, and every state change of a run
  waits for the next poll).

    python bench/train_startup/train_startup.py            # 2 rounds x 2 runs per trial
    python bench/train_startup/train_startup.py --quick    # 1 round x 2 runs

Prints one line per trial and a last JSON line: per variant the median seconds of the first
run and of the later runs in a trial, and each variant's ratio to `runtime_env`
(`<variant>_over_runtime_env`, below 1 = faster). Record figures in bench/train_startup/RESULTS.md with the
machine's load (`uptime`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {
    "runtime_env": {"env_in_spec": True, "workers": 2, "ray_env": {}},
    "no_runtime_env": {"env_in_spec": False, "workers": 2, "ray_env": {}},
    "preload": {"env_in_spec": False, "workers": 2,
                "ray_env": {"RAY_preload_python_modules": "torch,transformers,deepspeed"}},
    "no_prestart": {"env_in_spec": False, "workers": 2, "ray_env": {"RAY_prestart_worker_first_driver": "0"}},
    "one_worker": {"env_in_spec": False, "workers": 1, "ray_env": {}},
    "fast_poll": {"env_in_spec": False, "workers": 2, "ray_env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25"}},
}
WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": "cpu"}


def _worker(config: dict) -> None:
    import deepspeed  # noqa: F401 - what a gti training worker imports before step 1
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from gti.train import ray_train

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2))
    for _ in ray_train.dataset_shard().iter_batches(batch_size=4):
        pass
    with tempfile.TemporaryDirectory() as d:
        Path(d, "state.json").write_text(json.dumps({"step": 1}))
        ray_train.report({"step": 1}, checkpoint_dir=d)


def trial(variant: str, runs: int) -> list[float]:
    """In this process: a local Ray, then `runs` Train runs; their wall seconds."""
    import ray

    from gti.train.ray_train import TrainerSpec, run_trainer

    v = VARIANTS[variant]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    out = []
    with tempfile.TemporaryDirectory() as storage:
        for i in range(runs):
            spec = TrainerSpec(name=f"startup-{i}", storage_path=Path(storage), num_workers=v["workers"],
                               env=dict(WORKER_ENV) if v["env_in_spec"] else {})
            t0 = time.perf_counter()
            run_trainer(_worker, {}, {"train": ray.data.range(64)}, spec, lambda d: None)
            out.append(round(time.perf_counter() - t0, 2))
    ray.shutdown()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runs", type=int, default=2, help="Train runs per trial (one Ray)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--quick", action="store_true", help="1 round")
    ap.add_argument("--trial", default=None, help=argparse.SUPPRESS)  # internal: run one trial here
    a = ap.parse_args(argv)
    if a.trial:
        print("TRIAL " + json.dumps(trial(a.trial, a.runs)), flush=True)
        return {}
    rounds = 1 if a.quick else a.rounds
    names = a.variants.split(",")
    got: dict[str, list[list[float]]] = {n: [] for n in names}
    load0 = os.getloadavg()[0]
    for r in range(rounds):
        for n in names:
            env = {**os.environ, **VARIANTS[n]["ray_env"]}
            if not VARIANTS[n]["env_in_spec"]:
                env.update(WORKER_ENV)  # inherited by the local Ray's workers
            env.pop("RAY_ADDRESS", None)
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, __file__, "--trial", n, "--runs", str(a.runs)],
                               env=env, capture_output=True, text=True, timeout=900)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("TRIAL ")]
            if p.returncode != 0 or not line:
                raise SystemExit(f"{n}: trial failed\n{(p.stdout + p.stderr)[-3000:]}")
            secs = json.loads(line[-1][6:])
            got[n].append(secs)
            print(f"round {r + 1} {n}: runs {secs} s (process {time.perf_counter() - t0:.1f} s)", flush=True)
    out: dict = {"bench": "train_startup", "rounds": rounds, "runs_per_trial": a.runs,
                 "load_avg_1m_start": round(load0, 2), "load_avg_1m_end": round(os.getloadavg()[0], 2)}
    for n in names:
        out[f"{n}_first_s"] = statistics.median(t[0] for t in got[n])
        later = [x for t in got[n] for x in t[1:]]
        out[f"{n}_later_s"] = statistics.median(later) if later else None
    base = "runtime_env"
    if base in names:
        for n in names:
            if n != base:
                out[f"{n}_over_{base}_first"] = round(out[f"{n}_first_s"] / out[f"{base}_first_s"], 3)
                if out[f"{n}_later_s"] and out[f"{base}_later_s"]:
                    out[f"{n}_over_{base}_later"] = round(out[f"{n}_later_s"] / out[f"{base}_later_s"], 3)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
