"""Benchmark: a 4-trial Ray Tune sweep over the grounding stage (ASHA early stopping, trials side
by side) against running the same 4 settings one after another without Tune.

    python bench/tune/tune.py --quick      # tiny model, tiny step counts (< 60 s on 2 cores goal)
    python bench/tune/tune.py              # the demo grounding (SmolLM2-135M), small step counts

Both arms run exactly the same grounding code (`gti.stages.ground.run`) on the same upstream
stages (built once, timed separately and excluded) with the same sampled settings: the Tune arm
through `gti.experiments.tune.sweep`, the sequential arm by calling the stage once per setting with
its full step count. Reported: wall time of each arm, their ratio, how many trials ASHA stopped
early, and the best setting.

The sweep optimises the training loss (mode min) here: on a few steps of the tiny random model
the validation exact match is 0 for every trial, and with all values tied ASHA has nothing to
cut. The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared module
import common  # noqa: E402

ROOT = common.ROOT
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
common.hf_offline()


def overrides(quick: bool, out: Path) -> tuple[Path, list[str]]:
    steps = [4, 8] if quick else [8, 16]
    shared = [
        f"run_dir={out / 'run'}",
        "ray_num_cpus=4",
        "tune.num_samples=4",
        "tune.metric=loss",
        "tune.mode=min",
        f"tune.grace_period={steps[0] // 2}",
        "tune.reduction_factor=2",
        f"tune.search_space={{ground.lr: {{type: loguniform, low: 1.0e-4, high: 1.0e-1}}, "
        f"ground.steps: {{type: choice, values: {steps}}}}}",
        f"ground.val_every={steps[0]}",
        f"ground.checkpoint_every={steps[-1]}",
        "ground.num_workers=1",
    ]
    if quick:
        return common.CONFIGS / "tiny.yaml", shared + ["data.max_items=120", "ground.batch_size=2"]
    return common.CONFIGS / "demo.yaml", shared + ["ground.batch_size=4", "data.max_items=500"]


def run_sequential(cfg, base_raw: dict, trials: list[dict], out: Path) -> float:
    """The same settings, one after another, full step counts, no Tune."""
    from gti.run import pipeline
    from gti.run.contract import StageContext
    from gti.stages import ground
    from gti.experiments.tune_space import apply_params

    t0 = time.time()
    for i, t in enumerate(trials):
        tcfg = apply_params(base_raw, t["params"], "<sequential>")
        run_dir = tcfg.resolved_run_dir()
        spec = pipeline.spec("ground")
        fp, _ = pipeline.fingerprint(spec, tcfg, run_dir)
        work = out / "sequential" / f"trial{i}" / "ground"
        work.mkdir(parents=True, exist_ok=True)
        ctx = StageContext(spec=spec, cfg=tcfg, run_dir=run_dir, work_dir=work, fingerprint=fp)
        ground.run(ctx, run_name=f"seq-{i}")
    return time.time() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "tune"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    from gti import config as C
    from gti.config.io import apply_overrides, read_yaml
    from gti.run import pipeline
    from gti.experiments import tune as T
    from gti.ray_start import ensure_ray

    path, ov = overrides(args.quick, out)
    raw = apply_overrides(read_yaml(path), ov)
    cfg = C.validate(raw, f"{path} (bench overrides)")
    t0 = time.time()
    pipeline.run(cfg, to_stage=T._upstream_of_ground())
    ensure_ray(cfg)
    prep = time.time() - t0

    summary = T.sweep(cfg, raw=raw)
    tune_wall = summary["wall_s"]
    base_raw = dict(raw, run_dir=str(cfg.resolved_run_dir()))
    seq_wall = run_sequential(cfg, base_raw, summary["trials"], out)

    import ray

    concurrent = T.derive_max_concurrent(cfg, ray.cluster_resources())
    print(f"{'trial':>6} {'lr':>10} {'steps':>6} {'done':>5} {'loss':>8}  stopped_early", file=sys.stderr)
    for i, t in enumerate(summary["trials"]):
        m = t["metric"]
        print(f"{i:>6} {t['params']['ground.lr']:>10.2e} {t['steps_target']:>6} {t['steps_done']:>5} "
              f"{(m if m is not None else float('nan')):>8.4f}  {t['stopped_early']}", file=sys.stderr)
    ratio = tune_wall / seq_wall if seq_wall > 0 else float("nan")
    print(f"upstream stages {prep:.1f}s (excluded); tune {tune_wall:.1f}s (up to {concurrent} trials "
          f"at once) vs sequential {seq_wall:.1f}s: ratio {ratio:.2f}", file=sys.stderr)
    print(json.dumps({
        "bench": "tune",
        "quick": args.quick,
        "model": cfg.model.name,
        "trials": len(summary["trials"]),
        "stopped_early": summary["stopped_early"],
        "errored": summary["errored"],
        "max_concurrent_trials": concurrent,
        "tune_wall_s": round(tune_wall, 2),
        "sequential_wall_s": round(seq_wall, 2),
        "wall_ratio_vs_sequential": round(ratio, 3),
        "upstream_s": round(prep, 2),
        "best_params": summary["best"]["params"],
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
