"""The sections of the commands beside the pipeline: `compare:`, `tune:`, `refresh:`, and
`tracking:` (where metrics go).

What it is for: `CompareConfig` (`gti compare`: arms x seeds over shared SIDs), `TuneConfig`
(`gti tune`: a Ray Tune sweep), `RefreshConfig` (`gti refresh`: new items onto a trained run)
and `TrackingConfig` (the TensorBoard / MLflow sinks of every stage). `gti.config.RunConfig`
holds them; tracking and refresh enter no stage's fingerprint.

What it does NOT know: how those commands run (`gti.experiments`, `gti.refresh`,
`gti.common.tracking`) or YAML loading (`gti.config.io`). It never imports ray or torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gti.config.io import StrictModel as _Strict

REFRESH_LR_SCALE = 0.1  # refresh.ground_lr's default, as a share of ground.lr (see ground_lr)


class CompareConfig(_Strict):
    """`gti compare`: arms x seeds over shared SIDs (see gti/experiments/compare.py)."""

    equal_budget: bool = Field(
        True, description="arms without grounding get ground.steps added to sft.steps (equal total step budget)")
    parallel: bool = Field(
        True, description="run arm x seed pipelines as concurrent Ray tasks (false: one after another in-process)")
    max_parallel: int | None = Field(
        None, ge=1, description="concurrent arm runs (None: what the cluster's CPUs/GPUs hold, given what one "
        "arm's Train workers need)")
    arm_num_cpus: float = Field(
        0.0, ge=0, description="CPUs reserved by each arm's driver task (its stages request their own resources)")
    arm_timeout_s: float = Field(
        7 * 86400.0, gt=0, le=365 * 86400.0,
        description="seconds an arm run (a Ray task) may take from submission before it is cancelled and counted "
        "as failed, so a hung or never-scheduled arm cannot hold the comparison for ever")
    records_dir: str | None = Field(
        None, description="where each finished arm run's report record is kept (None: <out>/records); compare "
        "skips a run whose record matches its config and the shared SIDs/data")


class TuneConfig(_Strict):
    """`gti tune`: a Ray Tune sweep over grounding, or over grounding + SFT + evaluation
    (see gti/experiments/tune.py)."""

    search_space: dict[str, dict[str, Any]] = Field(
        default_factory=lambda: {
            "ground.lr": {"type": "loguniform", "low": 1e-4, "high": 1e-2},
            "ground.steps": {"type": "choice", "values": [100, 200, 400]},
        },
        description="{dotted key: {type: loguniform|uniform|randint|choice|grid, low, high, values}}; grid runs "
        "every value (times num_samples), the other types are sampled num_samples times",
    )
    num_samples: int = Field(4, ge=1, description="trials drawn from the search space (per grid value)")
    objective: Literal["grounding", "sft"] = Field(
        "grounding", description="grounding: trials run the ground stage; sft: ground, a short SFT and evaluate")
    metric: str = Field(
        "val_exact_match", description="reported metric that ranks trials and drives ASHA (e.g. val_exact_match; "
        "with objective sft: recall@10, ndcg@10, mrr, ...)")
    mode: Literal["max", "min"] = Field("max", description="whether a larger or a smaller metric is better")
    grace_period: int = Field(1, ge=1, description="ASHA: training steps a trial runs before it may be stopped")
    reduction_factor: int = Field(2, ge=2, description="ASHA: 1/this share of trials goes on at each rung")
    max_concurrent_trials: int | None = Field(
        None, ge=1, description="cap on trials running at once (None: what the cluster holds, up to num_samples)")


class TrackingConfig(_Strict):
    """Where training and evaluation metrics go (gti/common/tracking.py). Not part of any stage's
    fingerprint: turning a sink on or off never reruns a stage."""

    tensorboard: bool = Field(
        True, description="event files under <run_dir>/tensorboard/<stage>/ (tensorboard --logdir <run_dir>)")
    mlflow: bool = Field(False, description="also log to MLflow (needs `pip install mlflow`; not installed by default)")
    mlflow_uri: str | None = Field(
        None, description="MLflow tracking URI (None: a local file store at <run_dir>/mlruns)")
    mlflow_experiment: str = Field("gti", min_length=1, description="MLflow experiment name")


class RefreshConfig(_Strict):
    """`gti refresh` (gti/refresh/): new items onto a trained run without retraining it.
    Not part of any stage's fingerprint (a refresh writes its own versions under
    <run_dir>/refresh/)."""

    on_full_group: Literal["error", "add_tokens"] = Field(
        "add_tokens",
        description="a new item whose prefix group has no free code needs a token the vocabulary lacks (always "
        "listed in needs_new_tokens.json): add_tokens (the default) grows the last level by as many codes as the "
        "fullest group needs (old SIDs unchanged), appends the tokens to the tokenizer and model (rows start at "
        "their level's mean; the refresh's grounding trains them with the other SID rows), and the parent's "
        "model then refuses the grown map (the refresh's own model serves it); error stops the refresh with one "
        "line. Chosen over moving such items to the nearest group with a free code by "
        "bench/refresh/full_group.py (docs/refresh.md#full-prefix-groups)",
    )
    replay_ratio: float = Field(
        1.0, ge=0, description="old grounding pairs replayed per new-item pair in the grounding pass (0: new only)")
    ground_steps: int = Field(
        50, ge=0, description="grounding steps on the new items' pairs (+ replay), from the run's model; 0 = "
        "assign SIDs only (the model is exported unchanged with the new map version)")
    ground_lr: float | None = Field(
        None, gt=0, description="grounding lr (None: REFRESH_LR_SCALE = 0.1 x ground.lr: a refresh continues from "
        "trained rows, and at the full lr old items lost recall; bench/refresh/RESULTS.md \"New items\")")
    sft_steps: int = Field(0, ge=0, description="short SFT on the new interactions (0 = off; needs --interactions)")
    sft_lr: float | None = Field(None, gt=0, description="lr of that SFT (None: sft.lr)")
    sft_replay_ratio: float = Field(
        0.0, ge=0, description="windows of untouched users replayed per touched-user window in the refresh SFT "
        "(0: the touched users' windows only)")

    def ground_lr_from(self, ground_lr: float) -> float:
        """The refresh's grounding lr, given the run's `ground.lr`."""
        return self.ground_lr if self.ground_lr is not None else REFRESH_LR_SCALE * ground_lr
