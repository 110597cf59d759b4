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
        ({"sft.lr": {"type": "grid", "values": 0.1}}, "non-empty"),
        ({"sft.lr": {"type": "grid", "values": [1e-3], "low": 1}}, "low"),
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


def test_grid_runs_every_value(base):
    (p,) = T.parse_search_space({"sft.lr": {"type": "grid", "values": [2e-4, 5e-4, 1.5e-3]}}, base)
    assert p.type == "grid" and p.contains(5e-4) and not p.contains(1e-3)
    assert T.to_tune_space([p]) == {"sft.lr": {"grid_search": [2e-4, 5e-4, 1.5e-3]}}


# --------------------------------------------------------------------------- shared stages
def test_trials_share_every_stage_before_the_first_searched_one():
    assert T.stage_of("ground.lr") == "ground" and T.stage_of("init.method") == "ground"
    assert T.stage_of("sft.lr") == "sft" and T.stage_of("eval.beam_width") == "evaluate"
    assert T.stage_of("seed") == "ingest"
    shared = T.trial_shared_stages
    # A ground key: each trial grounds (as before); an sft-only sweep grounds once.
    assert shared(["ground.lr", "sft.lr"], "sft") == ("ingest", "embed", "sid", "pairs")
    assert shared(["sft.lr", "sft.steps"], "sft") == ("ingest", "embed", "sid", "pairs", "ground")
    assert shared(["eval.beam_width"], "sft") == ("ingest", "embed", "sid", "pairs", "ground", "sft")
    assert shared(["ground.lr"], "grounding") == ("ingest", "embed", "sid", "pairs")
    assert T.first_searched_stage(["sft.lr", "eval.beam_width"]) == "sft"


@pytest.mark.parametrize("keys, objective, match", [
    (["sid.levels"], "sft", r"tune\.search_space\.sid\.levels: .*sid stage"),
    (["model.name"], "sft", r"model\.name.*pairs stage"),
    (["seed"], "sft", r"seed.*ingest stage"),
    (["sft.lr"], "grounding", r"sft\.lr.*only the sft stage.*tune\.objective: sft"),
    (["tune.num_samples"], "sft", r"tune\.search_space\.tune\.num_samples: 'tune' is part of no stage"),
])
def test_keys_the_trials_cannot_vary_are_refused(keys, objective, match):
    with pytest.raises(C.GtiError, match=match):
        T.trial_shared_stages(keys, objective)


def test_sft_objective_needs_an_eval_metric_on_the_valid_split(base):
    def cfg(*ov):
        return C.validate(C.apply_overrides(base.model_dump(mode="json"), ["tune.objective=sft", *ov]), "t")

    T.check_sft_objective(cfg("tune.metric=recall@10"))
    T.check_sft_objective(cfg("tune.metric=mrr", "eval.exact_rank=true"))
    with pytest.raises(C.ConfigError, match="'val_exact_match' is not an evaluation metric"):
        T.check_sft_objective(cfg())
    with pytest.raises(C.ConfigError, match="mrr.*eval.exact_rank: true"):
        T.check_sft_objective(cfg("tune.metric=mrr", "eval.exact_rank=false"))
    with pytest.raises(C.ConfigError, match=r"eval.splits: .*\['test'\]; add valid"):
        T.check_sft_objective(cfg("tune.metric=recall@10", "eval.splits=[test]"))


def test_trial_metric_is_read_from_the_valid_split():
    facts = {"metrics": {"test": {"recall@10": {"value": 0.9}}, "valid": {"recall@10": {"value": 0.2}}},
             "ranks": {"valid": {"mrr": {"value": 0.05, "ci": [0.01, 0.1]}, "mean_percentile_rank": {"value": 0.3}}}}
    assert T._eval_metric(facts, "recall@10") == 0.2
    assert T._eval_metric(facts, "mrr") == 0.05
    assert T._eval_metric(facts, "mean_percentile_rank") == 0.3
    with pytest.raises(T.TuneError, match="ndcg@10"):
        T._eval_metric(facts, "ndcg@10")
    with pytest.raises(T.TuneError, match="no valid split"):
        T._eval_metric({"metrics": {"test": {"recall@10": {"value": 0.9}}}}, "recall@10")


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
def test_sft_objective_over_an_sft_key_grounds_once_and_scores_each_trial(tmp_path, ray_start_4_cpus):
    """tune.objective=sft over sft.lr (a 2-value grid: 2 trials): the base run grounds once;
    each trial links that ground stage, runs SFT with its own lr and the evaluation, and is
    scored by an evaluation metric on the valid split. (A sweep over ground keys runs ground in
    every trial: the same call from the first searched stage, unit-tested above.)"""
    run_dir = tmp_path / "run"
    raw = C.apply_overrides(C.read_yaml(TINY), [
        f"run_dir={run_dir}", "tune.num_samples=1", "tune.objective=sft", "tune.metric=recall@5",
        "ground.steps=2", "ground.checkpoint_every=2", "ground.val_every=2",
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
    best_path = run_dir / "tune" / "best.yaml"
    best = C.load(best_path)
    assert best.sft.lr == pytest.approx(summary["best"]["params"]["sft.lr"])
    assert best.ground == cfg.ground
    assert best_path.read_text().startswith(f"# Run: gti run --config {best_path} --from sft")
