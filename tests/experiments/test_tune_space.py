"""gti.experiments.tune_space: search-space parsing against the config schema (the bad key
named), Ray Tune's param_space, and which stages a sweep's trials share (no Ray run)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gti import config as C
from gti.config.commands import TuneConfig
from gti.config.io import apply_overrides
from gti.common.errors import ConfigError, GtiError
from gti.experiments import tune_space as T

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "jobs" / "configs" / "tiny.yaml"


@pytest.fixture
def base():
    return C.load(TINY)


# --------------------------------------------------------------------------- search space
def test_default_search_space_parses(base):
    params = {p.key: p for p in T.parse_search_space(TuneConfig().search_space, base)}
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
        ({"sft.batch_size,sft.steps": {"type": "loguniform", "low": 1, "high": 2}}, "tied keys.*grid or choice"),
        ({"sft.batch_size,sft.steps": {"type": "grid", "values": [[8, 250], [16]]}}, r"list 2 values.*\[16\]"),
        ({"sft.batch_size,sft.steps": {"type": "grid", "values": [[8, -1]]}}, r"sft\.batch_size,sft\.steps"),
        ({"sft.lr": {"type": "grid", "values": [1e-3]},
          "sft.steps,sft.lr": {"type": "grid", "values": [[10, 1e-3]]}}, r"\['sft.lr'\] set by more than one"),
    ],
)
def test_bad_search_space_names_the_key(space, match, base):
    with pytest.raises(ConfigError, match=match):
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


def test_trial_count_multiplies_grids_by_num_samples(base):
    params = T.parse_search_space({
        "sft.lr": {"type": "grid", "values": [2e-4, 5e-4, 1.5e-3]},
        "sft.warmup_steps": {"type": "grid", "values": [0, 20]},
        "ground.lr": {"type": "loguniform", "low": 1e-4, "high": 1e-2},
    }, base)
    assert T.trial_count(params, 1) == 6
    assert T.trial_count(params, 2) == 12
    assert T.trial_count(params[2:], 4) == 4  # sampled dimensions only: num_samples draws


# --------------------------------------------------------------------------- shared stages
def test_trials_share_every_stage_before_the_first_searched_one():
    assert T.stage_of("ground.lr") == "ground" and T.stage_of("init.method") == "ground"
    assert T.stage_of("sft.lr") == "sft" and T.stage_of("eval.beam_width") == "evaluate"
    assert T.stage_of("seed") == "ingest"
    shared = T.trial_shared_stages
    # A ground key: each trial grounds (as before); an sft-only sweep grounds once.
    assert shared(["ground.lr", "sft.lr"], "sft") == ("ingest", "embed", "sid", "pairs")
    assert shared(["sft.lr", "sft.steps"], "sft") == ("ingest", "embed", "sid", "pairs", "ground")
    assert shared(["eval.beam_width"], "sft") == ("ingest", "embed", "sid", "pairs", "ground", "sft", "rl")
    # An rl sweep: ground and SFT once in the base run, each trial runs rl -> evaluate.
    assert T.stage_of("rl.kl_coef") == "rl"
    assert shared(["rl.kl_coef", "rl.lr"], "sft") == ("ingest", "embed", "sid", "pairs", "ground", "sft")
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
    with pytest.raises(GtiError, match=match):
        T.trial_shared_stages(keys, objective)


def test_sft_objective_needs_an_eval_metric_on_the_valid_split(base):
    def cfg(*ov):
        return C.validate(apply_overrides(base.model_dump(mode="json"), ["tune.objective=sft", *ov]), "t")

    T.check_sft_objective(cfg("tune.metric=recall@10"))
    T.check_sft_objective(cfg("tune.metric=mrr", "eval.exact_rank=true"))
    with pytest.raises(ConfigError, match="'val_exact_match' is not an evaluation metric"):
        T.check_sft_objective(cfg())
    with pytest.raises(ConfigError, match="mrr.*eval.exact_rank: true"):
        T.check_sft_objective(cfg("tune.metric=mrr", "eval.exact_rank=false"))
    with pytest.raises(ConfigError, match=r"eval.splits: .*\['test'\]; add valid"):
        T.check_sft_objective(cfg("tune.metric=recall@10", "eval.splits=[test]"))


def test_tied_keys_take_one_listed_tuple_per_trial(base):
    """`sft.batch_size,sft.steps` over [[8, 250], [16, 125]]: 2 trials of 2,000 examples each
    (a cross product of two grids would be 4 trials, two of them with other budgets)."""
    (p,) = T.parse_search_space({"sft.batch_size,sft.steps": {"type": "grid", "values": [[8, 250], [16, 125]]}}, base)
    assert p.keys == ("sft.batch_size", "sft.steps") and T.config_keys([p]) == list(p.keys)
    assert T.trial_count([p], 1) == 2
    assert T.to_tune_space([p]) == {"sft.batch_size,sft.steps": {"grid_search": [[8, 250], [16, 125]]}}
    assert T.expand_params({"sft.batch_size,sft.steps": [16, 125], "sft.lr": 1e-3}) == {
        "sft.batch_size": 16, "sft.steps": 125, "sft.lr": 1e-3}
    cfg = T.apply_params(base.model_dump(mode="json"), {"sft.batch_size,sft.steps": [16, 125]}, "t")
    assert (cfg.sft.batch_size, cfg.sft.steps) == (16, 125)
    # The shared stages come from every tied key: a ground key tied to an sft one regrounds.
    assert T.trial_shared_stages(T.config_keys([p]), "sft")[-1] == "ground"
    (q,) = T.parse_search_space({"sft.steps,ground.steps": {"type": "grid", "values": [[10, 4]]}}, base)
    assert T.trial_shared_stages(T.config_keys([q]), "sft")[-1] == "pairs"


def test_apply_params_gives_a_valid_config(base):
    cfg = T.apply_params(base.model_dump(mode="json"), {"ground.lr": 3.3e-4, "ground.steps": 4}, "t")
    assert cfg.ground.lr == pytest.approx(3.3e-4) and cfg.ground.steps == 4
    assert cfg.sft == base.sft  # nothing else moved


