"""gti.experiments.tune: reading a trial's metric, resource arithmetic, trial naming (fast, no
Ray), and real sweeps on the tiny config (its ingest..pairs shared with the session,
tests/conftest.py::tiny_upstream): a 2-trial grounding sweep whose best.yaml is a valid
config inside the space, and an sft-objective grid over sft.lr that grounds once (the search
space itself: test_tune_space.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gti import config as C
from gti.config.io import apply_overrides, read_yaml
from gti.experiments import tune as T
from gti.experiments.tune_space import TuneError, parse_search_space
from gti.common.tracking import read_scalars

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "jobs" / "configs" / "tiny.yaml"


@pytest.fixture
def base():
    return C.load(TINY)


def test_trial_metric_is_read_from_the_valid_split():
    facts = {"metrics": {"test": {"recall@10": {"value": 0.9}}, "valid": {"recall@10": {"value": 0.2}}},
             "ranks": {"valid": {"mrr": {"value": 0.05, "ci": [0.01, 0.1]}, "mean_percentile_rank": {"value": 0.3}}}}
    assert T._eval_metric(facts, "recall@10") == 0.2
    assert T._eval_metric(facts, "mrr") == 0.05
    assert T._eval_metric(facts, "mean_percentile_rank") == 0.3
    with pytest.raises(TuneError, match="ndcg@10"):
        T._eval_metric(facts, "ndcg@10")
    with pytest.raises(TuneError, match="no valid split"):
        T._eval_metric({"metrics": {"test": {"recall@10": {"value": 0.9}}}}, "recall@10")


def test_trial_run_name_is_deterministic():
    a = T.trial_run_name("5f2c1_00003", {"ground.lr": 1e-3, "ground.steps": 4})
    assert a == T.trial_run_name("99999_00003", {"ground.steps": 4, "ground.lr": 1e-3})
    assert a.startswith("ground-t003-")
    assert a != T.trial_run_name("5f2c1_00003", {"ground.lr": 2e-3, "ground.steps": 4})
    assert a != T.trial_run_name("5f2c1_00004", {"ground.lr": 1e-3, "ground.steps": 4})


# --------------------------------------------------------------------------- resources
def test_max_concurrent_from_cluster_resources(base):
    cfg = base.model_copy(deep=True)
    cfg.tune.num_samples = 8
    cfg.ground.num_workers = 2
    # 2 workers + 1 CPU of headroom for the trial's Ray Data tasks = 3 CPUs a trial.
    assert T.derive_max_concurrent(cfg, {"CPU": 4.0}) == 1
    assert T.derive_max_concurrent(cfg, {"CPU": 9.0}) == 3
    # The headroom sizes concurrency but never refuses a cluster that holds the workers.
    assert T.derive_max_concurrent(cfg, {"CPU": 2.0}) == 1
    with pytest.raises(TuneError, match="needs 2 CPU"):
        T.derive_max_concurrent(cfg, {"CPU": 1.0})
    cfg.ground.resources_per_worker = {"CPU": 2, "gti_worker": 1}
    assert T.trial_need(cfg) == {"CPU": 5.0, "gti_worker": 2.0}
    assert T.derive_max_concurrent(cfg, {"CPU": 16.0, "gti_worker": 4.0}) == 2
    cfg.ground.resources_per_worker = None
    cfg.ground.use_gpu = True
    assert T.derive_max_concurrent(cfg, {"CPU": 64.0, "GPU": 8.0}) == 4
    cfg.tune.max_concurrent_trials = 3
    assert T.derive_max_concurrent(cfg, {"CPU": 64.0, "GPU": 8.0}) == 3
    with pytest.raises(TuneError, match="GPU"):
        T.derive_max_concurrent(cfg, {"CPU": 64.0})


def test_max_concurrent_counts_every_grid_trial_and_reaches_the_search_alg(base):
    cfg = base.model_copy(deep=True)
    cfg.tune.num_samples = 1
    cfg.tune.search_space = {"ground.lr": {"type": "grid", "values": [1e-3, 2e-3, 3e-3]}}
    # One sample of a 3-value grid is 3 trials: all fit at once on a big cluster.
    assert T.derive_max_concurrent(cfg, {"CPU": 64.0}) == 3
    assert T.derive_max_concurrent(cfg, {"CPU": 64.0}, n_trials=2) == 2  # the count sweep() passes
    cfg.tune.max_concurrent_trials = 1
    assert T.derive_max_concurrent(cfg, {"CPU": 64.0}) == 1
    # Tune ignores TuneConfig.max_concurrent_trials for a BasicVariantGenerator: the limit
    # must sit on the generator (the sft-objective sweep below checks trials do not overlap).
    alg = T.search_alg(cfg, 1)
    assert alg.max_concurrent == 1


# --------------------------------------------------------------------------- a real sweep
def test_trial_curves_are_rewritten_from_the_progress_file(base, tmp_path):
    """A trial ended before its tracker read the last progress lines (ASHA stop) left a short
    live curve; after the sweep the driver rewrites it from the progress file, every step once."""
    from types import SimpleNamespace

    from gti.common.tracking import Tracker

    run_dir = tmp_path / "run"
    cfg = base.model_copy(update={"run_dir": str(run_dir)})
    params = {"ground.lr": 1e-3}
    name = T.trial_run_name("trial_00001", params)
    with Tracker(cfg, run_dir, f"tune/{name}") as live:  # the live curve stopped after step 2
        for step in (1, 2):
            live.report({"step": step, "loss": 3.0 - step, "lr": 1e-3, "tokens_per_s": 10.0})
    progress = tmp_path / "run" / "tune" / "trials" / name / "ground" / "ray_train" / f"{name}.progress.jsonl"
    progress.parent.mkdir(parents=True)
    progress.write_text("".join(json.dumps({"step": s, "loss": 3.0 - s, "lr": 1e-3, "tokens_per_s": 10.0}) + "\n"
                                for s in (1, 2, 3, 4)))
    grid = [SimpleNamespace(metrics={"trial_id": "trial_00001", "step": 3}, config=params)]
    T.rewrite_trial_curves(cfg, run_dir, grid, ["ground.lr"])
    curve = read_scalars(run_dir / "tensorboard" / "tune" / name)["train/loss"]
    assert curve == [(1, 2.0), (2, 1.0), (3, 0.0), (4, -1.0)]


@pytest.mark.slow
@pytest.mark.ray
def test_two_trial_sweep_writes_valid_best_yaml(tiny_run_dir, ray_start_4_cpus):
    import ray

    run_dir = tiny_run_dir  # the session's tiny ingest..pairs, up to date
    raw = apply_overrides(read_yaml(TINY), [
        f"run_dir={run_dir}", "tune.num_samples=2", "ground.steps=4", "ground.val_every=2",
        "ground.checkpoint_every=2",
        "tune.search_space={ground.lr: {type: loguniform, low: 1.0e-4, high: 1.0e-2}, "
        "ground.steps: {type: choice, values: [2, 4]}}",
    ])
    cfg = C.validate(raw, "test")
    summary = T.sweep(cfg, raw=raw)

    assert len(summary["trials"]) == 2 and summary["errored"] == 0
    params = {p.key: p for p in parse_search_space(cfg.tune.search_space, cfg)}
    best_path = run_dir / "tune" / "best.yaml"
    best = C.load(best_path)  # a full, valid RunConfig
    assert best.run_dir == str(run_dir)
    assert params["ground.lr"].contains(best.ground.lr)
    assert params["ground.steps"].contains(best.ground.steps)
    assert (best.ground.lr, best.ground.steps) == (
        summary["best"]["params"]["ground.lr"], summary["best"]["params"]["ground.steps"])
    assert best.sft == cfg.sft and best.sid == cfg.sid  # only searched keys differ
    assert best_path.read_text().startswith(f"# Run: gti run --config {best_path} --from ground")
    for t in summary["trials"]:
        assert t["metric"] is not None and 0.0 <= t["metric"] <= 1.0
        assert 0 < t["steps_done"] <= t["steps_target"]
        # Each trial's Train run lives under its deterministic name.
        name = T.trial_run_name(t["trial_id"], t["params"])
        assert (run_dir / "tune" / "trials" / name / "params.json").is_file()
        # ... and its curve under tensorboard/tune/<name>/: one point per step it ran, also for
        # a trial ASHA stopped (ended before its tracker's last read of the progress file).
        curve = read_scalars(run_dir / "tensorboard" / "tune" / name)["train/loss"]
        # (A stopped trial's workers may run a step past the one Tune acted on, so the curve
        # may hold more steps than steps_done; never fewer, never a gap or a repeat.)
        steps = [s for s, _ in curve]
        assert steps == list(range(1, len(steps) + 1)) and len(steps) >= t["steps_done"], (name, curve)
    assert json.loads((run_dir / "tune" / "results.json").read_text())["best"] == summary["best"]
    assert ray.is_initialized()


def _stage_span(trial_run: Path) -> tuple[float, float]:
    """(start of its sft stage, end of its evaluate stage) from the manifests' end times and
    durations."""
    sft = json.loads((trial_run / "sft" / "_manifest.json").read_text())
    ev = json.loads((trial_run / "evaluate" / "_manifest.json").read_text())
    return sft["created"] - sft["duration_s"], ev["created"]


@pytest.mark.slow
@pytest.mark.ray
def test_sft_objective_over_an_sft_key_grounds_once_and_scores_each_trial(tiny_run_dir, ray_start_4_cpus):
    """tune.objective=sft over sft.lr (a 2-value grid: 2 trials): the base run grounds once;
    each trial links that ground stage, runs SFT with its own lr and the evaluation, and is
    scored by an evaluation metric on the valid split. (A sweep over ground keys runs ground in
    every trial: the same call from the first searched stage, unit-tested above.)"""
    run_dir = tiny_run_dir  # the session's tiny ingest..pairs, up to date
    raw = apply_overrides(read_yaml(TINY), [
        f"run_dir={run_dir}", "tune.num_samples=1", "tune.objective=sft", "tune.metric=recall@5",
        "tune.max_concurrent_trials=1",
        # The base run's ground stage exports its initial rows without training (what is
        # checked is that trials link it, not what it learned): no Train run for it.
        "ground.steps=0",
        "sft.steps=2", "sft.checkpoint_every=2", "sft.val_every=2", "eval.max_users=8",
        "tune.search_space={sft.lr: {type: grid, values: [1.0e-4, 1.0e-3]}}",
    ])
    cfg = C.validate(raw, "test")
    summary = T.sweep(cfg, raw=raw)

    assert len(summary["trials"]) == 2 and summary["errored"] == 0
    assert sorted(t["params"]["sft.lr"] for t in summary["trials"]) == [1e-4, 1e-3]
    base_ground = run_dir / "ground" / "_manifest.json"
    for t in summary["trials"]:
        trial_run = run_dir / "tune" / "trials" / T.trial_run_name(t["trial_id"], t["params"]) / "run"
        # Grounded once: the trial's ground stage is the base run's own files (hard links).
        assert (trial_run / "ground" / "_manifest.json").samefile(base_ground)
        sft = json.loads((trial_run / "sft" / "_manifest.json").read_text())
        assert sft["config"]["sft"]["lr"] == pytest.approx(t["params"]["sft.lr"])
        assert t["steps_done"] == t["steps_target"] == 2
        metrics = json.loads((trial_run / "evaluate" / "metrics.json").read_text())
        assert t["metric"] == pytest.approx(metrics["splits"]["valid"]["recall@5"]["value"])
    # tune.max_concurrent_trials=1 holds: one trial's sft..evaluate ends before the other's
    # SFT starts (4 CPUs would fit both at once).
    spans = sorted(_stage_span(run_dir / "tune" / "trials" / T.trial_run_name(t["trial_id"], t["params"]) / "run")
                   for t in summary["trials"])
    assert spans[0][1] <= spans[1][0], spans
    best_path = run_dir / "tune" / "best.yaml"
    best = C.load(best_path)
    assert best.sft.lr == pytest.approx(summary["best"]["params"]["sft.lr"])
    assert best.ground == cfg.ground
    assert best_path.read_text().startswith(f"# Run: gti run --config {best_path} --from sft")
