"""Typed run configuration: pydantic models per stage, YAML loading, key=value overrides.

What it is for: one validated object (`RunConfig`) that every stage reads. Unknown keys are
rejected with the key and the file named; `key=value` overrides are applied to the raw mapping
and the whole config is validated again, so an override can never produce a state that a YAML
file could not. The training sections (`TrainConfig`, `GroundConfig`, `SftConfig`,
`LoraConfig`) live in `gti.config_train`, the schema-free file machinery (strict base model,
YAML reading, overrides, redaction, error lines) in `gti.config_io`; both are re-exported here,
so `gti.config` stays the one import.

What it does not know: how stages run, where outputs go (that is `pipeline`/`manifest`), or
anything about Ray. It never imports ray or torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from gti.config_io import (  # noqa: F401 - re-exported: C.redact, C.REDACTED, C.read_yaml, ...
    REDACTED,
    apply_overrides,
    read_yaml,
    redact,
)
from gti.config_io import StrictModel as _Strict
from gti.config_io import format_error as _format_error
from gti.config_io import parse_scalar as _parse_scalar  # noqa: F401 - re-exported
from gti.config_train import GroundConfig, LoraConfig, SftConfig, TrainConfig  # noqa: F401 - re-exported
from gti.config_eval import BASELINES, BASELINES_HELP, BaselineNames, SasrecConfig  # noqa: F401 - re-exported
from gti.config_serve import ServeConfig  # noqa: F401 - re-exported (the serve: section)
from gti.errors import ConfigError, GtiError  # noqa: F401 - ConfigError re-exported
from gti.names import DEFAULT_GROUNDING_TEMPLATES, INIT_METHODS

# Bounds that would otherwise fail hours into a run (a negative seed in the first Ray Data
# shuffle, a zero-width encoder layer in the sid stage, a codebook of millions of tokens in the
# vocabulary): checked when the config is validated, naming the key.
SEED_MAX = 2**32 - 1  # numpy's and Ray Data's seeds are uint32
MAX_CODEBOOK_SIZE = 65536  # codes per level: each one is a new token of the LM's vocabulary
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]
PositiveInt = Annotated[int, Field(gt=0)]


# --------------------------------------------------------------------------- data
class ItemColumns(_Strict):
    """Maps the user's column names to ours."""

    id: str = "item_id"
    title: str | None = "title"
    description: str | None = "description"
    category: str | None = "category"
    # Extra attribute columns used for pseudo-text when title and description are missing.
    attributes: list[str] = Field(default_factory=lambda: ["brand"])


class InteractionColumns(_Strict):
    user: str = "user_id"
    item: str = "item_id"
    # None means "file order is chronological order".
    ts: str | None = "ts"


class ItemsSource(_Strict):
    # A local path, glob, directory or any URI pyarrow/fsspec understands, or
    # "bundled:<name>" for a data set shipped inside the package.
    path: str = "bundled:amazon-scientific"
    format: Literal["auto", "parquet", "csv", "jsonl", "json", "amazon", "amazon2023", "movielens"] = "auto"
    columns: ItemColumns = Field(default_factory=ItemColumns)
    # fsspec/pyarrow filesystem options (e.g. credentials for s3://); redacted in manifests.
    storage_options: dict[str, str] = Field(default_factory=dict)


class InteractionsSource(_Strict):
    path: str = "bundled:amazon-scientific"
    format: Literal["auto", "parquet", "csv", "jsonl", "json", "amazon2023", "movielens"] = "auto"
    columns: InteractionColumns = Field(default_factory=InteractionColumns)
    storage_options: dict[str, str] = Field(default_factory=dict)


class DataConfig(_Strict):
    items: ItemsSource = Field(default_factory=ItemsSource)
    interactions: InteractionsSource = Field(default_factory=InteractionsSource)
    max_text_chars: int = Field(2000, gt=0)
    min_seq_len: int = Field(3, ge=1)
    max_history: int = Field(20, ge=1)
    # Use only the first N items/users (after validation); None = all. Handy for quick runs.
    max_items: int | None = Field(None, gt=0)
    max_users: int | None = Field(None, gt=0)
    # Ray Data read/processing parallelism; None lets Ray decide.
    parallelism: int | None = Field(None, gt=0)
    # An input file that cannot be read (damaged page, truncated gzip, zero bytes, ragged CSV
    # row): "error" stops the stage with one line naming it; "skip" leaves the whole file out
    # and records it with its reason in the ingest manifest (facts.skipped_files).
    on_unreadable_file: Literal["error", "skip"] = "error"


# --------------------------------------------------------------------------- embed
class EmbedConfig(_Strict):
    # "minilm" | "hash" | "lm" | a local HF encoder folder path
    encoder: str = "minilm"
    # Model folder for encoder == "lm" (None = the run's LM, model.name).
    lm_path: str | None = None
    dim: int = Field(384, gt=0, description="output size for the hash encoder")
    max_tokens: int = Field(256, gt=0)
    batch_size: int = Field(256, gt=0)
    concurrency: int = Field(1, ge=1, description="actors in the embedding pool")
    num_gpus: float = Field(0.0, ge=0)
    # Text fields joined into the text that is embedded.
    fields: list[Literal["title", "description", "category", "attributes"]] = Field(
        default_factory=lambda: ["title", "category", "attributes", "description"]
    )


# --------------------------------------------------------------------------- sid
class SidGates(_Strict):
    min_utilisation: float = Field(0.05, ge=0, le=1, description="per level, fraction of codes used")
    max_collision_rate: float = Field(0.0, ge=0, le=1, description="after de-duplication")


class SidConfig(_Strict):
    method: Literal["rqvae", "rqkmeans"] = "rqvae"
    levels: int = Field(4, ge=1, le=26)
    codebook_size: int = Field(256, ge=2, le=MAX_CODEBOOK_SIZE)
    code_dim: int = Field(32, gt=0)
    encoder_dims: list[PositiveInt] = Field(default_factory=lambda: [512, 256])
    dropout: float = Field(0.1, ge=0, lt=1)
    epochs: int = Field(50, ge=1)
    batch_size: int = Field(1024, gt=0)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    commitment_beta: float = Field(0.25, ge=0)
    rotation_trick: bool = False
    diversity_weight: float = Field(0.0, ge=0)
    kmeans_iters: int = Field(25, ge=1)
    dead_code_threshold: int = Field(
        0, ge=0, description="codes used <= this many times in an epoch are re-seeded"
    )
    balanced: bool = Field(True, description="rqkmeans: balanced cluster sizes")
    sinkhorn_last_level: bool = True
    train_sinkhorn_epsilon: float = Field(
        0.05, ge=0,
        description="rqvae: the last level trains on Sinkhorn-balanced codes at this epsilon "
        "(relative to the median distance gap; 0 = greedy codes, as at inference)",
    )
    sinkhorn_epsilon: float = Field(0.003, gt=0)
    sinkhorn_iters: int = Field(50, ge=1)
    dedup: Literal["extra_level", "reassign"] = "extra_level"
    num_workers: int = Field(1, ge=1)
    use_gpu: bool = False
    assign_batch_size: int = Field(4096, gt=0)
    assign_concurrency: int = Field(1, ge=1, description="actors in the SID assignment pool")
    assign_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="rqvae: precision of the encoder MLP at assignment; auto = bfloat16 "
        "where bf16 is native (CUDA, CPUs with AVX512-BF16/AMX), else float32",
    )
    kmeans_sample: int = Field(
        65536, gt=0, description="items sampled for codebook k-means init / rqkmeans fitting"
    )
    sinkhorn_rounds: int = Field(20, ge=0, description="rounds of last-level Sinkhorn spreading")
    sinkhorn_sample_rows: int = Field(
        65536, gt=0, description="colliders whose costs set the balancing prices in a Sinkhorn "
        "round (a seeded uniform sample when more collide; all of them otherwise)",
    )
    resolve_cache_mb: float = Field(
        1024, ge=0, description="driver memory for the colliding items' last residuals during "
        "collision resolution; items past it are re-read and re-encoded in each round",
    )
    sinkhorn_min_gain: float = Field(
        0.01, ge=0, lt=1, description="stop Sinkhorn spreading after a round that frees fewer "
        "than this share of the colliding items (de-duplication resolves the rest)",
    )
    revive_every_steps: int = Field(
        0, ge=0, description="re-seed dead codes every N optimizer steps (0: once per epoch)"
    )
    # Token string format; {level} is a letter a, b, c, ...; {code} the code index.
    token_format: str = "<{level}_{code}>"
    gates: SidGates = Field(default_factory=SidGates)

    @field_validator("token_format")
    @classmethod
    def _fmt_has_fields(cls, v: str) -> str:
        if "{level}" not in v or "{code}" not in v:
            raise ValueError("token_format must contain {level} and {code}")
        return v


# --------------------------------------------------------------------------- model / vocab
class ModelConfig(_Strict):
    # "smollm2-135m" (offline PyPI package), "tiny" (random tiny Llama built from config, for
    # tests), a local HF folder, or a hub id where a network exists.
    name: str = "smollm2-135m"
    trust_remote_code: bool = False
    dtype: Literal["float32", "bfloat16"] = "float32"
    sid_markers: bool = Field(False, description="add <sid_start>/<sid_end> tokens")
    # Only for name == "tiny".
    tiny_hidden: int = Field(64, gt=0)
    tiny_layers: int = Field(2, gt=0)
    tiny_heads: int = Field(4, gt=0)
    tiny_tied: bool = True
    tiny_pad_vocab_to: int | None = Field(None, description="pad embedding past the tokenizer")


class InitConfig(_Strict):
    method: Literal[INIT_METHODS] = "mean"  # type: ignore[valid-type]
    noise_std: float = Field(0.02, ge=0, description="mean_noise: std relative to vocab std")


# --------------------------------------------------------------------------- pairs
class PairsConfig(_Strict):
    system_prompt: str = "You are a helpful assistant."
    templates: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_GROUNDING_TEMPLATES))
    max_len: int = Field(128, gt=8, description="tokens per rendered pair; longer text is cut")
    max_desc_chars: int = Field(300, gt=0)
    # Items kept out of grounding (cold-start studies): ids, or a path to a file of ids.
    exclude_items: list[str] = Field(default_factory=list)
    val_fraction: float = Field(0.02, ge=0, lt=1)
    # Which rows of a validation item are held out: "text2sid" (its text->SID rows; its
    # SID->text rows still train, so validation measures the reverse binding) or "item" (all).
    val_holdout: Literal["text2sid", "item"] = "text2sid"

    @field_validator("templates")
    @classmethod
    def _known_templates(cls, v: dict[str, str]) -> dict[str, str]:
        unknown = set(v) - set(DEFAULT_GROUNDING_TEMPLATES)
        if unknown:
            raise ValueError(
                f"unknown template name(s) {sorted(unknown)}; known: {sorted(DEFAULT_GROUNDING_TEMPLATES)}"
            )
        return v


# --------------------------------------------------------------------------- eval
class EvalConfig(_Strict):
    beam_width: int = Field(20, ge=1)
    ks: list[PositiveInt] = Field(default_factory=lambda: [5, 10, 20], min_length=1)
    splits: list[Literal["valid", "test"]] = Field(default_factory=lambda: ["valid", "test"])
    max_users: int | None = Field(None, gt=0, description="evaluate a sample of users")
    sample_seed: Seed | None = Field(
        None, description="seed of that sample (None: the run's seed; fix it to evaluate the same "
        "users in every seed of a comparison)",
    )
    batch_users: int = Field(8, ge=1)
    concurrency: int = Field(1, ge=1)
    num_gpus: float = Field(0.0, ge=0)
    bootstrap: int = Field(1000, ge=0)
    constrained: bool = True
    # torch threads per CPU decoding actor; None keeps Ray's setting (1 by default).
    cpu_threads: int | None = Field(None, ge=1)
    # Exact rank of the true next item among ALL catalog items (MRR, mean percentile rank with
    # bootstrap CIs; gti.eval.rank), beside the beam-search top-K metrics. Costs one prefill
    # plus one token per distinct SID prefix per user.
    exact_rank: bool = False
    # Cold-item slice: every metric is also reported for the users whose target item is the
    # target of at most this many SFT training windows (counted on train items only).
    cold_max_sft_targets: int = Field(1, ge=0)
    baselines: BaselineNames = Field(default_factory=lambda: list(BASELINES), description=BASELINES_HELP)
    sasrec: SasrecConfig = Field(default_factory=SasrecConfig, description="the sasrec reference row")

    @model_validator(mode="after")
    def _k_le_beam(self) -> "EvalConfig":
        bad = [k for k in self.ks if k > self.beam_width]
        if bad:
            raise ValueError(f"ks {bad} exceed beam_width {self.beam_width}")
        return self


class ReportConfig(_Strict):
    max_heatmap_tokens: int = Field(256, gt=0)
    # Name of this run in reports (None: derived from init method / grounding / multitask).
    label: str | None = None
    text_sample: int = Field(512, ge=0, description="old vocabulary rows for SID-text cosine")
    rsa_max_codes_per_level: int = Field(1024, ge=2)
    bootstrap: int = Field(1000, ge=0, description="resamples for report CIs")
    baseline_arm: str = "mean"


class CompareConfig(_Strict):
    """`gti compare`: arms x seeds over shared SIDs (see gti/experiments/compare.py)."""

    # Arms without grounding get ground.steps added to sft.steps (equal total step budget).
    equal_budget: bool = True
    # Run arm x seed pipelines as concurrent Ray tasks (False: one after another in-process).
    parallel: bool = True
    # Concurrent arm runs; None = cluster CPUs (GPUs) / what one arm's Train workers need.
    max_parallel: int | None = Field(None, ge=1)
    # CPUs reserved by each arm's driver task; its stages request their own Ray resources.
    arm_num_cpus: float = Field(0.0, ge=0)
    # Where each finished arm run's report record is kept (None: <out>/records). A record
    # stands for its run on another machine or in a later session (run folders are large and
    # local): compare skips a run whose record matches its config and the shared SIDs/data.
    records_dir: str | None = None


# --------------------------------------------------------------------------- tune
class TuneConfig(_Strict):
    # Search space: {param: {type: loguniform|uniform|randint|choice|grid, low, high, values}}
    # (grid: every value runs, times num_samples; the others are sampled num_samples times)
    search_space: dict[str, dict[str, Any]] = Field(
        default_factory=lambda: {
            "ground.lr": {"type": "loguniform", "low": 1e-4, "high": 1e-2},
            "ground.steps": {"type": "choice", "values": [100, 200, 400]},
        }
    )
    num_samples: int = Field(4, ge=1)
    objective: Literal["grounding", "sft"] = "grounding"
    metric: str = "val_exact_match"
    mode: Literal["max", "min"] = "max"
    grace_period: int = Field(1, ge=1)
    reduction_factor: int = Field(2, ge=2)
    max_concurrent_trials: int | None = Field(None, ge=1)


# --------------------------------------------------------------------------- tracking
class TrackingConfig(_Strict):
    """Where training and evaluation metrics go (gti/tracking.py). Not part of any stage's
    fingerprint: turning a sink on or off never reruns a stage."""

    # Event files under <run_dir>/tensorboard/<stage>/ (`tensorboard --logdir <run_dir>`).
    tensorboard: bool = True
    # Also log to MLflow (needs `pip install mlflow`; not installed by default).
    mlflow: bool = False
    # None: a local file store at <run_dir>/mlruns (no network).
    mlflow_uri: str | None = None
    mlflow_experiment: str = Field("gti", min_length=1)


# --------------------------------------------------------------------------- refresh
REFRESH_LR_SCALE = 0.1  # refresh.ground_lr's default, as a share of ground.lr (see ground_lr)


class RefreshConfig(_Strict):
    """`gti refresh` (gti/refresh/): new items onto a trained run without retraining it.
    Not part of any stage's fingerprint (a refresh writes its own versions under
    <run_dir>/refresh/)."""

    # A new item whose prefix group already uses every code of the de-duplication level (or
    # whose SID is taken and no last-level code is free, without one) needs a token the
    # vocabulary lacks. Such items are always listed in needs_new_tokens.json. "error": the
    # refresh stops with one line. "add_tokens": the last level grows by as many codes as the
    # fullest group needs (gti.sid.map_edits.add_last_level_codes; old SIDs unchanged), the
    # new code tokens are appended to the tokenizer and the model (rows start at the mean of
    # their level's rows, the grounding pass trains them with the other SID rows), and the
    # new map version records the grown codebook sizes. The parent's model then refuses the
    # grown map (its vocabulary lacks the added tokens).
    on_full_group: Literal["error", "add_tokens"] = "error"
    # Old grounding pairs replayed per new-item pair in the grounding pass (0: new pairs only).
    replay_ratio: float = Field(1.0, ge=0)
    # Grounding steps on the new items' pairs (+ replay), continuing from the run's model;
    # 0 = assign SIDs only (the model is exported unchanged with the new map version).
    ground_steps: int = Field(50, ge=0)
    # None: REFRESH_LR_SCALE x ground.lr. A refresh continues from rows already trained (and
    # tuned by SFT to recommend), not from the mean: at the first grounding's lr its 100 steps
    # moved every old SID row by 35-68% of its norm and old-target Recall@10 fell .10 -> .02;
    # at a tenth of it the old targets kept .10 and the new ones gained as much (.02 -> .16)
    # (bench/RESULTS.md "New items").
    ground_lr: float | None = Field(None, gt=0, description="None: REFRESH_LR_SCALE x ground.lr")
    # Optional short SFT on the new interactions (0 = off; needs --interactions).
    sft_steps: int = Field(0, ge=0)
    sft_lr: float | None = Field(None, gt=0, description="None: sft.lr")
    # Windows of untouched users replayed per touched-user window in the refresh SFT (0: the
    # touched users' windows only).
    sft_replay_ratio: float = Field(0.0, ge=0)

    def ground_lr_from(self, ground_lr: float) -> float:
        """The refresh's grounding lr, given the run's `ground.lr`."""
        return self.ground_lr if self.ground_lr is not None else REFRESH_LR_SCALE * ground_lr


# --------------------------------------------------------------------------- run
LOCAL_RAY_ENV = "GTI_LOCAL_RAY"  # "<pid>:<gcs address>" of the local Ray this process started


class RunConfig(_Strict):
    run_dir: str = "runs/demo"
    seed: Seed = 0
    # Ray address: None starts/joins a local Ray; "auto" joins a running cluster.
    ray_address: str | None = None
    ray_num_cpus: int | None = Field(None, ge=1)
    data: DataConfig = Field(default_factory=DataConfig)
    embed: EmbedConfig = Field(default_factory=EmbedConfig)
    sid: SidConfig = Field(default_factory=SidConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    init: InitConfig = Field(default_factory=InitConfig)
    pairs: PairsConfig = Field(default_factory=PairsConfig)
    ground: GroundConfig = Field(default_factory=GroundConfig)
    sft: SftConfig = Field(default_factory=SftConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    report: ReportConfig = Field(default_factory=ReportConfig)
    tune: TuneConfig = Field(default_factory=TuneConfig)
    compare: CompareConfig = Field(default_factory=CompareConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    refresh: RefreshConfig = Field(default_factory=RefreshConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)

    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir).expanduser().resolve()

    def requested_ray_address(self, env: Any = None) -> str | None:
        """The Ray a run joins: `ray_address`, else $RAY_ADDRESS, except where $RAY_ADDRESS is
        this very process's own local Ray (pinned by gti.stages._ray.ensure_ray, marked in
        $GTI_LOCAL_RAY as "<pid>:<address>"): after a ray.shutdown() that Ray is gone, and
        the next start must make a new one. Child processes see another pid and join it."""
        env = os.environ if env is None else env
        if self.ray_address:
            return self.ray_address
        address = env.get("RAY_ADDRESS") or None
        if address and env.get(LOCAL_RAY_ENV) == f"{os.getpid()}:{address}":
            return None
        return address


# --------------------------------------------------------------------------- loading
def validate(raw: dict[str, Any], source: str = "<config>") -> RunConfig:
    """A raw mapping -> RunConfig; ConfigError naming the key and `source` otherwise."""
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None


def load(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config (or defaults when path is None), apply overrides, validate."""
    raw = read_yaml(path) if path is not None else {}
    source = str(path) if path is not None else "<defaults>"
    cfg = validate(raw, source)
    if overrides:
        cfg = validate(apply_overrides(raw, overrides), f"{source} (with overrides)")
    return cfg


def dump(cfg: RunConfig) -> str:
    """The config as YAML, secrets redacted (`gti config show`)."""
    return yaml.safe_dump(redact(cfg.model_dump(mode="json")), sort_keys=False)
