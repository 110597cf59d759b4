"""`gti tune`: a Ray Tune sweep over the grounding stage, or (objective sft) over grounding, SFT
and evaluation settings scored by the evaluation (Ray Train V2 + Tune interop).

What it is for: one trial per sampled setting (`tune.search_space`, parsed by
`gti.experiments.tune_space`), the best written as a complete run config to
`run_dir/tune/best.yaml`. A trial runs the stage's own code (`gti.run.pipeline.run_detached`),
so it trains exactly what `gti run` trains, and its Train run's name follows from its index and
setting (`trial_run_name`), so an interrupted sweep resumes every trial from its checkpoints.
Search types, ASHA and concurrency: docs/tuning.md.

What it does NOT know: how grounding trains (that is `gti.stages.ground` and
`gti.train`), or how stages are fingerprinted (that is `gti.run.pipeline`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from gti import config as C
from gti.run import pipeline
from gti.config.io import apply_overrides, read_yaml
from gti.common.errors import ConfigError
from gti.experiments.shared_stages import adopt_shared
from gti.experiments.tune_space import (
    RANK_METRICS,
    TuneError,
    apply_params,
    check_sft_objective,
    config_keys,
    expand_params,
    first_searched_stage,
    parse_search_space,
    to_tune_space,
    trial_count,
    trial_shared_stages,
)
from gti.train import resources

TUNE_DIR = "tune"
SWEEP_NAME = "sweep"
BEST_FILE = "best.yaml"
RESULTS_FILE = "results.json"
# A trial's driver only waits on its Train run; it must still ask Tune for some resource.
DRIVER_CPU = 0.05


def trial_run_name(trial_id: str, params: dict[str, Any]) -> str:
    """Deterministic Train run name of a trial: its index in the sweep (the numeric suffix of
    Tune's trial id) and a hash of its parameters; the same seeded sweep gives the same names."""
    index = trial_id.rsplit("_", 1)[-1]
    index = f"t{int(index):03d}" if index.isdigit() else trial_id
    digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"ground-{index}-{digest}"


# --------------------------------------------------------------------------- resources
def _trial_stages(cfg: C.RunConfig) -> tuple[str, ...]:
    return ("ground",) if cfg.tune.objective == "grounding" else ("ground", "sft", "rl", "evaluate")


def trial_need(cfg: C.RunConfig) -> dict[str, float]:
    """Resources one trial holds at once: its Train workers (the larger of ground and SFT, or
    the evaluate actors, for the sft objective) plus CPU headroom for its Ray Data tasks
    (gti.train.resources)."""
    return resources.run_need(cfg, _trial_stages(cfg))


def derive_max_concurrent(cfg: C.RunConfig, cluster: dict[str, float], n_trials: int | None = None) -> int:
    """Trials that fit side by side: min over needed resources of cluster total // need, capped
    by the sweep's trial count (num_samples x every grid's size) and tune.max_concurrent_trials;
    at least 1 (trials then queue). Fails when the cluster cannot hold even one trial's workers.
    `n_trials`: the trial count when the caller has parsed the search space already."""
    short = resources.shortfall(resources.run_need(cfg, _trial_stages(cfg), headroom=False), cluster)
    for res, (amount, have) in short.items():
        raise TuneError(
            f"one trial needs {amount:g} {res} (ground.num_workers x resources_per_worker) "
            f"but the cluster has {have:g}"
        )
    cap = n_trials or trial_count(parse_search_space(cfg.tune.search_space, cfg), cfg.tune.num_samples)
    if cfg.tune.max_concurrent_trials is not None:
        cap = min(cap, cfg.tune.max_concurrent_trials)
    return resources.runs_that_fit(trial_need(cfg), cluster, cap)


def search_alg(cfg: C.RunConfig, concurrent: int):
    """Tune's search algorithm: seeded sampling (the same sweep samples the same settings, so
    the same trial run names), at most `concurrent` trials at once. The limit must be given to
    the generator itself: Tune ignores `TuneConfig.max_concurrent_trials` (with only a
    warning) when the search algorithm passed is a BasicVariantGenerator."""
    from ray import tune

    return tune.search.BasicVariantGenerator(random_state=cfg.seed, max_concurrent=concurrent)


# --------------------------------------------------------------------------- trials
def _echo(msg: str) -> None:
    print(f"[tune] {msg}", file=sys.stderr, flush=True)


def _trial_dir(run_dir: Path, name: str) -> Path:
    return run_dir / TUNE_DIR / "trials" / name


def ground_trial(params: dict[str, Any], base_raw: dict[str, Any], keys: list[str]) -> None:
    """Tune trial driver (runs in the trial's actor): build and fit the grounding TorchTrainer
    through the grounding stage, reporting to Tune via `TuneReportCallback`."""
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    chosen = expand_params({k: params[k] for k in keys})
    cfg = apply_params(base_raw, chosen, "<tune trial>")
    run_dir = cfg.resolved_run_dir()
    name = trial_run_name(ray.tune.get_context().get_trial_id(), chosen)
    trial = _trial_dir(run_dir, name)
    trial.mkdir(parents=True, exist_ok=True)
    (trial / "params.json").write_text(json.dumps(chosen, sort_keys=True, indent=1))

    if cfg.tune.objective == "grounding":
        result = pipeline.run_detached("ground", cfg, trial / "ground", run_name=name,
                                       callbacks=[TuneReportCallback()])
        (trial / "facts.json").write_text(json.dumps(result.facts, indent=1, default=str))
        return

    # objective == "sft": [ground ->] sft -> evaluate in the trial's own run folder, from the
    # first stage a searched key changes (the stages before it are the base run's, linked).
    trial_run = trial / "run"
    shared = trial_shared_stages(list(chosen), cfg.tune.objective)
    adopt_shared(run_dir, trial_run, stages=shared)
    tcfg = cfg.model_copy(update={"run_dir": str(trial_run)})
    first = pipeline.STAGE_NAMES[len(shared)]
    done = pipeline.run(tcfg, from_stage=first, to_stage="evaluate", echo=_echo)
    metrics = _eval_metric(done["evaluate"].facts, cfg.tune.metric)
    ray.tune.report({cfg.tune.metric: metrics, "step": tcfg.sft.steps})


def _eval_metric(facts: dict[str, Any], metric: str) -> float:
    """`metric` (e.g. `recall@10`) on the validation split from the evaluate stage's facts."""
    table = facts.get("ranks" if metric in RANK_METRICS else "metrics", {})
    split = table.get("valid")
    if split is None:
        raise TuneError(f"the evaluation has no valid split to read tune.metric '{metric}' from "
                        f"(splits: {sorted(table)})")
    value = split.get(metric)
    if isinstance(value, dict):
        value = value.get("value", value.get("mean"))
    if value is None:
        raise TuneError(f"tune.metric '{metric}' is not among the evaluation metrics {sorted(split)}")
    return float(value)


# --------------------------------------------------------------------------- the sweep
def sweep(cfg: C.RunConfig, raw: dict[str, Any] | None = None, echo=_echo) -> dict[str, Any]:
    """Run the sweep; returns the summary also written to run_dir/tune/results.json.

    `raw` is the config mapping the trials start from (default: `cfg` dumped), so best.yaml keeps
    the user's own settings. Upstream stages are run (or found up to date) first. Holds the run
    folder's writer lock (`gti.run.runlock`) for the whole sweep. Stages before the first
    searched one run once and are hard-linked into every trial. ASHA stops weak grounding
    trials early; objective `sft` reports the valid split's metric once at the end.
    """
    from gti.run.runlock import RunLock

    with RunLock(cfg.resolved_run_dir()):
        return _sweep_locked(cfg, raw, echo)


def _sweep_locked(cfg: C.RunConfig, raw: dict[str, Any] | None, echo) -> dict[str, Any]:
    import ray
    from ray import tune

    from gti.ray_start import ensure_ray

    run_dir = cfg.resolved_run_dir()
    base_raw = dict(raw if raw is not None else cfg.model_dump(mode="json"))
    # Trials may run in another cwd or on another node: pin run_dir to an absolute path.
    base_raw["run_dir"] = str(run_dir)
    params = parse_search_space(cfg.tune.search_space, cfg)
    keys = [p.key for p in params]
    if not cfg.ground.enabled:
        raise ConfigError("gti tune searches the grounding stage: it needs ground.enabled: true")
    if cfg.tune.objective == "sft":
        check_sft_objective(cfg)
    shared = trial_shared_stages(config_keys(params), cfg.tune.objective)

    # The stages every trial shares run once here (or are found up to date).
    echo(f"shared stages up to '{shared[-1]}'")
    pipeline.run(cfg, to_stage=shared[-1])

    # Read by Tune in this process (and propagated to trial actors): trials keep the job's cwd
    # so relative data paths still resolve; reports before the first validation carry no metric.
    os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = "0"
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
    ensure_ray(cfg)
    n_trials = trial_count(params, cfg.tune.num_samples)
    concurrent = derive_max_concurrent(cfg, ray.cluster_resources(), n_trials)
    max_steps = max([cfg.ground.steps] + [int(expand_params({p.key: v})["ground.steps"]) for p in params
                                          if "ground.steps" in p.keys
                                          for v in p.bounds_or_values()])
    echo(f"{n_trials} trials over {keys}, up to {concurrent} at a time, "
         f"ASHA on {cfg.tune.metric} ({cfg.tune.mode})")

    scheduler = None
    if cfg.tune.objective == "grounding":
        scheduler = tune.schedulers.ASHAScheduler(
            time_attr="step", max_t=max(1, max_steps),
            grace_period=cfg.tune.grace_period, reduction_factor=cfg.tune.reduction_factor,
        )
    storage = run_dir / TUNE_DIR
    shutil.rmtree(storage / SWEEP_NAME, ignore_errors=True)  # Tune's own bookkeeping only
    t0 = time.time()
    tuner = tune.Tuner(
        tune.with_resources(
            tune.with_parameters(ground_trial, base_raw=base_raw, keys=keys), {"cpu": DRIVER_CPU}
        ),
        param_space=to_tune_space(params),
        tune_config=tune.TuneConfig(
            metric=cfg.tune.metric, mode=cfg.tune.mode, num_samples=cfg.tune.num_samples,
            scheduler=scheduler, search_alg=search_alg(cfg, concurrent),
        ),
        run_config=tune.RunConfig(
            name=SWEEP_NAME, storage_path=str(storage), verbose=0,
            failure_config=tune.FailureConfig(max_failures=0),
        ),
    )
    grid = tuner.fit()
    wall = time.time() - t0
    if cfg.tune.objective == "grounding":
        rewrite_trial_curves(cfg, run_dir, grid, keys)
    return summarise(cfg, base_raw, params, grid, wall, echo)


def rewrite_trial_curves(cfg: C.RunConfig, run_dir: Path, grid, keys: list[str]) -> None:
    """Each grounding trial's TensorBoard curve, rewritten from its rank-0 progress file.

    The trial's own tracker draws the curve live, but it reads the progress file every 2 s
    from the trial's actor, and a trial that ASHA stops (or that ends between two polls) is
    ended without its last drain: its curve lost steps, or was empty, when trials ran at once.
    The progress file on disk holds every reported step, so the driver replays it once the
    sweep is over (TensorBoard only: an MLflow run of a stopped trial keeps its live points).
    """
    from gti.common.progress import JsonlFollower
    from gti.common.tracking import Tracker
    from gti.train.ray_train import STORAGE_DIR, progress_path

    tb_only = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"mlflow": False})})
    for r in grid:
        trial_id = (r.metrics or {}).get("trial_id")
        if trial_id is None:
            continue
        name = trial_run_name(trial_id, {k: r.config[k] for k in keys})
        progress = progress_path(_trial_dir(run_dir, name) / "ground" / STORAGE_DIR, name)
        if progress.is_file() and cfg.tracking.tensorboard:
            with Tracker(tb_only, run_dir, f"tune/{name}", fresh=True) as tracker:
                JsonlFollower(progress, tracker.report).drain()


def summarise(cfg, base_raw, params, grid, wall: float, echo=_echo) -> dict[str, Any]:
    """Write results.json and best.yaml from a finished ResultGrid."""
    run_dir = cfg.resolved_run_dir()
    keys = [p.key for p in params]
    trials = []
    for r in grid:
        chosen = expand_params({k: r.config[k] for k in keys})
        m = r.metrics or {}
        # The step count a trial reports up to: grounding's, or (objective sft) SFT's.
        target = (int(chosen.get("ground.steps", cfg.ground.steps)) if cfg.tune.objective == "grounding"
                  else int(chosen.get("sft.steps", cfg.sft.steps)))
        steps_done = int(m.get("step", 0) or 0)
        trials.append({
            "trial_id": m.get("trial_id"),
            "params": chosen,
            "metric": m.get(cfg.tune.metric),
            "steps_done": steps_done,
            "steps_target": target,
            "stopped_early": r.error is None and cfg.tune.objective == "grounding" and steps_done < target,
            "error": None if r.error is None else str(r.error).splitlines()[0][:300],
        })
    ok = [t for t in trials if t["error"] is None and t["metric"] is not None]
    if not ok:
        first = next((t["error"] for t in trials if t["error"]), "no trial reported the metric")
        raise TuneError(f"no trial finished with tune.metric '{cfg.tune.metric}': {first}")
    # Prefer trials that ran to their target (an early-stopped trial's metric is an earlier one).
    sign = 1 if cfg.tune.mode == "max" else -1
    best = max(ok, key=lambda t: (not t["stopped_early"], sign * float(t["metric"])))
    best_cfg = apply_params(base_raw, best["params"], "<tune best>")
    out = run_dir / TUNE_DIR
    out.mkdir(parents=True, exist_ok=True)
    best_path = out / BEST_FILE
    header = (
        f"# Run: gti run --config {best_path} --from {first_searched_stage(keys, cfg.tune.objective)}\n"
        f"# Best of {len(trials)} tune trials ({cfg.tune.metric} {cfg.tune.mode}: {best['metric']}); "
        f"params {json.dumps(best['params'], sort_keys=True)}\n"
    )
    tmp = best_path.with_suffix(".yaml.tmp")
    tmp.write_text(header + C.dump(best_cfg))
    tmp.replace(best_path)
    summary = {
        "metric": cfg.tune.metric, "mode": cfg.tune.mode, "objective": cfg.tune.objective,
        "wall_s": round(wall, 2), "trials": trials, "best": best, "best_config": str(best_path),
        "stopped_early": sum(t["stopped_early"] for t in trials),
        "errored": sum(t["error"] is not None for t in trials),
    }
    (out / RESULTS_FILE).write_text(json.dumps(summary, indent=1, default=str))
    echo(f"{len(trials)} trials in {wall:.0f}s, {summary['stopped_early']} stopped early by ASHA, "
         f"{summary['errored']} failed; best {best['params']} -> {best_path}")
    return summary


def cli_main(args) -> int:
    """`gti tune --config X [key=value ...]`."""
    raw = apply_overrides(read_yaml(args.config), list(args.overrides or []))
    cfg = C.validate(raw, f"{args.config} (with overrides)" if args.overrides else str(args.config))
    summary = sweep(cfg, raw=raw)
    print(yaml.safe_dump({"best": summary["best"]["params"], "metric": summary["best"]["metric"],
                          "best_config": summary["best_config"]}, sort_keys=False), end="")
    return 0
