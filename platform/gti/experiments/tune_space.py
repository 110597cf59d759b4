"""What a `gti tune` sweep may vary: the search space (validated against the config schema)
and which pipeline stages its trials share.

What it is for: `parse_search_space` (tune.search_space -> Params, the bad key named),
`to_tune_space` (Params -> Ray Tune's param_space), `expand_params` / `apply_params` (tied keys
such as `sft.batch_size,sft.steps` take one listed tuple per trial, so a sweep can hold the
number of examples fixed), `first_searched_stage` /
`trial_shared_stages` (every stage before the first one a searched key changes is run once and
shared; keys of upstream stages are refused) and `check_sft_objective`.

What it does not know: how trials run (`gti.experiments.tune`), what the stages compute.
Ray Tune is imported only inside `to_tune_space`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gti import config as C
from gti.run import pipeline
from gti.config.io import apply_overrides
from gti.common.errors import ConfigError, GtiError
from gti.experiments.shared_stages import SHARED_STAGES

SPACE_TYPES = ("loguniform", "uniform", "choice", "randint", "grid")
# Evaluation facts that are not "@K" metrics (facts["ranks"][split], with eval.exact_rank).
RANK_METRICS = ("mrr", "mean_percentile_rank")


class TuneError(GtiError):
    """A user mistake in the sweep (bad search space, no trial finished); one line."""


# --------------------------------------------------------------------------- search space
@dataclass(frozen=True)
class Param:
    """One dimension of the search space: `key` is a dotted config path (`ground.lr`)."""

    key: str
    type: str
    low: float | None = None
    high: float | None = None
    values: tuple[Any, ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        """The config keys this dimension sets: one, or several tied ones (`a,b`: each value
        is a list giving a and b together)."""
        return tuple(self.key.split(","))

    def bounds_or_values(self) -> list[Any]:
        """The values a sample can take at the extremes (ranges) or all of them (choice, grid)."""
        return list(self.values) if self.type in ("choice", "grid") else [self.low, self.high]

    def contains(self, value: Any) -> bool:
        if self.type in ("choice", "grid"):
            return value in self.values
        if self.type == "randint":  # Ray's randint excludes the upper bound
            return float(value).is_integer() and self.low <= value < self.high
        return self.low <= value <= self.high


def parse_search_space(space: dict[str, dict[str, Any]], base: C.RunConfig) -> list[Param]:
    """Validate `tune.search_space` against the config schema; ConfigError names the bad key.

    Every key must be a config path that accepts the space's values (the extremes of a range,
    every value of a choice): each is applied to `base` and the whole config validated again.
    """
    if not space:
        raise ConfigError("tune.search_space is empty: give at least one parameter to search")
    params: list[Param] = []
    raw = base.model_dump(mode="json")
    for key, spec in space.items():
        where = f"tune.search_space.{key}"
        if not isinstance(spec, dict):
            raise ConfigError(f"{where}: expected a mapping like {{type: loguniform, low: .., high: ..}}")
        kind = spec.get("type")
        if kind not in SPACE_TYPES:
            raise ConfigError(f"{where}.type: '{kind}' is not one of {list(SPACE_TYPES)}")
        listed = kind in ("choice", "grid")
        tied = len(Param(key, kind).keys) > 1
        if tied and not listed:
            raise ConfigError(f"{where}: tied keys ({key}) need type grid or choice, got {kind}")
        allowed = {"type", "values"} if listed else {"type", "low", "high"}
        extra = set(spec) - allowed
        if extra:
            raise ConfigError(f"{where}: unknown key(s) {sorted(extra)} for type {kind}")
        if listed:
            values = spec.get("values")
            if not isinstance(values, list) or not values:
                raise ConfigError(f"{where}.values: give a non-empty list")
            if tied:
                n = len(Param(key, kind).keys)
                bad = [v for v in values if not isinstance(v, list) or len(v) != n]
                if bad:
                    raise ConfigError(f"{where}.values: each value must list {n} values, one for each "
                                      f"of {key}; got {bad[0]!r}")
            p = Param(key, kind, values=tuple(values))
        else:
            try:
                low, high = float(spec["low"]), float(spec["high"])
            except (KeyError, TypeError, ValueError):
                raise ConfigError(f"{where}: type {kind} needs numeric 'low' and 'high'") from None
            if not low < high:
                raise ConfigError(f"{where}: low ({low:g}) must be below high ({high:g})")
            if kind == "loguniform" and low <= 0:
                raise ConfigError(f"{where}.low: loguniform needs low > 0, got {low:g}")
            if kind == "randint":
                if not (low.is_integer() and high.is_integer()):
                    raise ConfigError(f"{where}: randint needs integer low and high")
                low, high = int(low), int(high)
            p = Param(key, kind, low=low, high=high)
        for v in p.bounds_or_values():
            probe = v - 1 if (kind == "randint" and v == p.high) else v
            try:
                C.validate(apply_overrides(raw, [f"{k}={_fmt(x)}" for k, x in
                                                 expand_params({key: probe}).items()]), where)
            except ConfigError as err:
                raise ConfigError(f"{where}: value {probe!r} is not valid for config key '{key}' ({err})") from None
        params.append(p)
    keys = config_keys(params)
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ConfigError(f"tune.search_space: {twice} set by more than one entry")
    return params


def _fmt(v: Any) -> str:
    """A value as override text that `gti.config.io.parse_scalar` reads back to the same value."""
    return json.dumps(v) if not isinstance(v, str) else v


def trial_count(params: list[Param], num_samples: int) -> int:
    """Trials a sweep runs: Ray Tune repeats every grid combination `num_samples` times."""
    n = num_samples
    for p in params:
        if p.type == "grid":
            n *= len(p.values)
    return n


def to_tune_space(params: list[Param]) -> dict[str, Any]:
    """The Ray Tune param_space for `params` (keys stay dotted config paths)."""
    from ray import tune

    out: dict[str, Any] = {}
    for p in params:
        if p.type == "loguniform":
            out[p.key] = tune.loguniform(p.low, p.high)
        elif p.type == "uniform":
            out[p.key] = tune.uniform(p.low, p.high)
        elif p.type == "randint":
            out[p.key] = tune.randint(int(p.low), int(p.high))
        elif p.type == "grid":
            out[p.key] = tune.grid_search(list(p.values))
        else:
            out[p.key] = tune.choice(list(p.values))
    return out


def expand_params(params: dict[str, Any]) -> dict[str, Any]:
    """{dotted key: value} of a trial, tied keys (`a,b`: [va, vb]) split into their own keys."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        keys = key.split(",")
        out.update(zip(keys, value) if len(keys) > 1 else [(key, value)])
    return out


def config_keys(params: list[Param]) -> list[str]:
    """Every config key the search space sets (tied keys one by one)."""
    return [k for p in params for k in p.keys]


def apply_params(raw: dict[str, Any], params: dict[str, Any], source: str) -> C.RunConfig:
    """The run config with sampled `params` ({dotted key: value}, tied keys allowed) applied
    and validated."""
    flat = expand_params(params)
    return C.validate(apply_overrides(raw, [f"{k}={_fmt(v)}" for k, v in sorted(flat.items())]), source)


# --------------------------------------------------------------------------- stages
def stage_of(key: str) -> str:
    """The first pipeline stage whose fingerprint config key `key` (dotted) is part of:
    `seed` is in every stage's; a key of no stage's sections changes nothing (TuneError)."""
    section = key.split(".", 1)[0]
    if section == "seed":
        return pipeline.STAGE_NAMES[0]
    for s in pipeline.STAGES:
        if section in s.sections:
            return s.name
    raise TuneError(f"tune.search_space.{key}: '{section}' is part of no stage's settings, so a "
                    "sampled value would change nothing")


def first_searched_stage(keys: list[str], objective: str = "sft") -> str:
    """The first stage a trial must run: the earliest stage any searched key changes. Every
    stage before it runs once in the base run and is shared by the trials. ConfigError, naming
    the key, for a key of a stage upstream of ground (the trials share those) and, with
    objective `grounding` (trials run the ground stage alone), for a key of a later stage."""
    order = pipeline.STAGE_NAMES.index
    first = "evaluate"
    for key in keys:
        stage = stage_of(key)
        if order(stage) < order("ground"):
            raise ConfigError(
                f"tune.search_space.{key}: '{key}' changes the {stage} stage, which every trial shares "
                "with the base run (tune searches ground, sft and eval settings)")
        if objective == "grounding" and stage != "ground":
            raise ConfigError(
                f"tune.search_space.{key}: '{key}' changes only the {stage} stage, but tune.objective "
                "grounding runs the ground stage alone (use tune.objective: sft)")
        first = min(first, stage, key=order)
    return first


def trial_shared_stages(keys: list[str], objective: str) -> tuple[str, ...]:
    """Stages a trial takes hard-linked from the base run (never fewer than SHARED_STAGES)."""
    first = first_searched_stage(keys, objective)
    return tuple(pipeline.STAGE_NAMES[: max(pipeline.STAGE_NAMES.index(first), len(SHARED_STAGES))])


def check_sft_objective(cfg: C.RunConfig) -> None:
    """tune.objective sft scores trials by an evaluation metric on the valid split."""
    metric = cfg.tune.metric
    if "@" not in metric and metric not in RANK_METRICS:
        raise ConfigError(
            f"tune.metric '{metric}' is not an evaluation metric; with tune.objective sft use one such "
            f"as recall@10 or ndcg@10 (or, with eval.exact_rank: true, one of {list(RANK_METRICS)}), "
            "on the valid split")
    if metric in RANK_METRICS and not cfg.eval.exact_rank:
        raise ConfigError(f"tune.metric '{metric}' needs eval.exact_rank: true (it ranks the whole catalog)")
    if "valid" not in cfg.eval.splits:
        raise ConfigError(
            f"eval.splits: tune.objective sft scores trials on the valid split, but eval.splits is "
            f"{list(cfg.eval.splits)}; add valid (a sweep must not pick by the test split)")
