"""gti.experiments.tune: search-space parsing (fast, no Ray), resource arithmetic, trial naming, and a
real 2-trial sweep on the tiny config whose best.yaml is a valid config inside the space."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gti import config as C
from gti.experiments import tune as T
from gti.tracking import read_scalars

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "jobs" / "configs" / "tiny.yaml"


@pytest.fixture
def base():
    return C.load(TINY)


# --------------------------------------------------------------------------- search space
def test_default_search_space_parses(base):
    params = {p.key: p for p in T.parse_search_space(C.TuneConfig().search_space, base)}
    lr, steps = params["ground.lr"], params["ground.steps"]
    assert (lr.type, lr.low, lr.high) == ("loguniform", 1e-4, 1e-2)
    assert steps.type == "choice" and steps.values == (100, 200, 400)
    assert lr.contains(1e-3) and not lr.contains(0.1)
    assert steps.contains(200) and not steps.contains(300)


@pytest.mark.parametrize(
    "space, match",
    [
        ({}, "empty"),
        ({"ground.lr": {"type": "gaussian", "low": 1, "high": 2}}, r"ground\.lr\.type"),
        ({"ground.lr": {"type": "loguniform", "low": 0.0, "high": 1e-2}}, "low > 0"),
        ({"ground.lr": {"type": "uniform", "low": 0.1, "high": 0.01}}, "below high"),
        ({"ground.lr": {"type": "uniform", "low": "a", "high": 1}}, "numeric"),
        ({"ground.steps": {"type": "choice", "values": []}}, "non-empty"),
        ({"ground.steps": {"type": "choice", "values": [10, -5]}}, r"-5.*ground\.steps"),
        ({"ground.lrr": {"type": "loguniform", "low": 1e-4, "high": 1e-2}}, "lrr"),
        ({"ground.lr": {"type": "loguniform", "low": 1e-4, "high": 1e-2, "step": 2}}, "step"),
        ({"ground.steps": {"type": "randint", "low": 1.5, "high": 4}}, "integer"),
        ({"ground.lr": [1, 2]}, "mapping"),
    ],
)
def test_bad_search_space_names_the_key(space, match, base):
    with pytest.raises(C.ConfigError, match=match):
        T.parse_search_space(space, base)


def test_search_space_from_yaml_with_every_type(base, tmp_path):
    f = tmp_path / "c.yaml"
    raw = yaml.safe_load(TINY.read_text())
    raw["tune"] = {"search_space": {
        "ground.lr": {"type": "loguniform", "low": 1e-4, "high": 1e-2},
        "ground.warmup_steps": {"type": "randint", "low": 0, "high": 3},
        "ground.weight_decay": {"type": "uniform", "low": 0.0, "high": 0.1},
        "init.method": {"type": "choice", "values": ["mean", "random"]},
    }}
    f.write_text(yaml.safe_dump(raw))
    cfg = C.load(f)
    params = T.parse_search_space(cfg.tune.search_space, cfg)
    assert [p.type for p in params] == ["loguniform", "randint", "uniform", "choice"]
    space = T.to_tune_space(params)
    assert set(space) == set(cfg.tune.search_space)
    # Ray's samplers draw inside the declared space.
    for p in params:
        for _ in range(20):
            assert p.contains(space[p.key].sample())


def test_apply_params_gives_a_valid_config(base):
    cfg = T.apply_params(base.model_dump(mode="json"), {"ground.lr": 3.3e-4, "ground.steps": 4}, "t")
    assert cfg.ground.lr == pytest.approx(3.3e-4) and cfg.ground.steps == 4
    assert cfg.sft == base.sft  # nothing else moved


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
    with pytest.raises(T.TuneError, match="needs 2 CPU"):
        T.derive_max_concurrent(cfg, {"CPU": 1.0})
    cfg.ground.resources_per_worker = {"CPU": 2, "gti_worker": 1}
    assert T.trial_need(cfg) == {"CPU": 5.0, "gti_worker": 2.0}
    assert T.derive_max_concurrent(cfg, {"CPU": 16.0, "gti_worker": 4.0}) == 2
    cfg.ground.resources_per_worker = None
    cfg.ground.use_gpu = True
    assert T.derive_max_concurrent(cfg, {"CPU": 64.0, "GPU": 8.0}) == 4
    cfg.tune.max_concurrent_trials = 3
    assert T.derive_max_concurrent(cfg, {"CPU": 64.0, "GPU": 8.0}) == 3
    with pytest.raises(T.TuneError, match="GPU"):
        T.derive_max_concurrent(cfg, {"CPU": 64.0})


# --------------------------------------------------------------------------- a real sweep
def test_trial_curves_are_rewritten_from_the_progress_file(base, tmp_path):
    """A trial ended before its tracker read the last progress lines (ASHA stop) left a short
    live curve; after the sweep the driver rewrites it from the progress file, every step once."""
    from types import SimpleNamespace

    from gti.tracking import Tracker

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
def test_two_trial_sweep_writes_valid_best_yaml(tmp_path, ray_start_4_cpus):
    import ray

    run_dir = tmp_path / "run"
    raw = C.apply_overrides(C.read_yaml(TINY), [
        f"run_dir={run_dir}", "tune.num_samples=2", "ground.steps=4", "ground.val_every=2",
        "ground.checkpoint_every=2",
        "tune.search_space={ground.lr: {type: loguniform, low: 1.0e-4, high: 1.0e-2}, "
        "ground.steps: {type: choice, values: [2, 4]}}",
    ])
    cfg = C.validate(raw, "test")
    summary = T.sweep(cfg, raw=raw)

    assert len(summary["trials"]) == 2 and summary["errored"] == 0
    params = {p.key: p for p in T.parse_search_space(cfg.tune.search_space, cfg)}
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


@pytest.mark.slow
@pytest.mark.ray
def test_sft_objective_runs_ground_sft_evaluate_per_trial(tmp_path, ray_start_4_cpus):
    """tune.objective=sft: a trial runs ground -> sft -> evaluate in its own folder with its
    sampled grounding setting, and is scored by an evaluation metric on the valid split. One
    trial (the two-trial sweep above covers picking the best of several; each trial here costs
    a whole ground + SFT + evaluate)."""
    run_dir = tmp_path / "run"
    raw = C.apply_overrides(C.read_yaml(TINY), [
        f"run_dir={run_dir}", "tune.num_samples=1", "tune.objective=sft", "tune.metric=recall@5",
        "sft.steps=2", "sft.checkpoint_every=2", "sft.val_every=2", "eval.max_users=8",
        "tune.search_space={ground.lr: {type: loguniform, low: 1.0e-4, high: 1.0e-2}, "
        "ground.steps: {type: choice, values: [2, 4]}}",
    ])
    cfg = C.validate(raw, "test")
    summary = T.sweep(cfg, raw=raw)

    assert len(summary["trials"]) == 1 and summary["errored"] == 0
    for t in summary["trials"]:
        trial_run = run_dir / "tune" / "trials" / T.trial_run_name(t["trial_id"], t["params"]) / "run"
        ground = json.loads((trial_run / "ground" / "_manifest.json").read_text())
        assert ground["facts"]["steps_done"] == t["params"]["ground.steps"]
        assert ground["config"]["ground"]["lr"] == pytest.approx(t["params"]["ground.lr"])
        metrics = json.loads((trial_run / "evaluate" / "metrics.json").read_text())
        assert t["metric"] == pytest.approx(metrics["splits"]["valid"]["recall@5"]["value"])
    best = C.load(run_dir / "tune" / "best.yaml")
    assert best.ground.lr == pytest.approx(summary["best"]["params"]["ground.lr"])
