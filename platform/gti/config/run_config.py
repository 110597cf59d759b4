"""The run's configuration: `RunConfig`, the sections that have no module of their own (embed,
sid, model, init, pairs), and `load` / `validate` / `dump`.

What it is for: one validated object that every stage reads. Unknown keys are rejected with the
key and the file named; `key=value` overrides are applied to the raw mapping and the whole
config is validated again, so an override can never produce a state a YAML file could not.
Every field says what it means where it is declared (`Field(description=...)`, printed by
`gti config show --explain`). The other sections live beside it in `gti.config`.

What it does not know: how stages run, where outputs go (`gti.run`), or Ray; no torch either.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator

from gti.config.io import apply_overrides, read_yaml, redact
from gti.config.io import PositiveInt, Seed
from gti.config.io import StrictModel as _Strict
from gti.config.io import format_error as _format_error
from gti.config.train import GroundConfig, RlConfig, SftConfig
from gti.config.eval import EvalConfig, ReportConfig
from gti.config.data import DataConfig
from gti.config.commands import CompareConfig, RefreshConfig, TrackingConfig, TuneConfig
from gti.config.serve import ServeConfig
from gti.common.errors import ConfigError
from gti.common.arms import DEFAULT_GROUNDING_TEMPLATES, INIT_METHODS

# A codebook of millions of tokens would fail hours into a run, in the vocabulary: checked when
# the config is validated, naming the key (the shared bounds, Seed and PositiveInt: gti.config.io).
MAX_CODEBOOK_SIZE = 65536  # codes per level: each one is a new token of the LM's vocabulary


# --------------------------------------------------------------------------- embed
class EmbedConfig(_Strict):
    """The embed stage: item text -> content embedding, in a Ray Data actor pool."""

    encoder: str = Field(
        "minilm", description="minilm (all-MiniLM-L6-v2, bundled), hash (model-free feature hashing of words), "
        "lm (mean-pooled causal LM) or a local HF encoder folder")
    lm_path: str | None = Field(None, description="model folder for encoder lm (None: the run's LM, model.name)")
    dim: int = Field(384, gt=0, description="output size for the hash encoder")
    max_tokens: int = Field(256, gt=0, description="tokens of item text the encoder sees; longer text is cut")
    batch_size: int = Field(256, gt=0, description="items per encoder call")
    concurrency: int = Field(1, ge=1, description="actors in the embedding pool")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per embedding actor (0: encode on CPU)")
    fields: list[Literal["title", "description", "category", "attributes"]] = Field(
        default_factory=lambda: ["title", "category", "attributes", "description"],
        description="text fields joined, in this order, into the text that is embedded",
    )


# --------------------------------------------------------------------------- sid
class SidGates(_Strict):
    """Quality gates: the sid stage fails (GateError, one line) when its codes miss one."""

    min_utilisation: float = Field(
        0.05, ge=0, le=1, description="per quantiser level, the least fraction of codes used")
    max_collision_rate: float = Field(
        0.0, ge=0, le=1, description="the most items sharing a SID after de-duplication (a fraction)")


class SidConfig(_Strict):
    """The sid stage: item embeddings -> semantic IDs (L codes per item, one token each)."""

    method: Literal["rqvae", "rqkmeans", "file"] = Field("rqvae", description="rqvae (residual-quantisation VAE, "
        "trained on Ray Train), rqkmeans (residual k-means) or file (read from sid.path, docs/data.md)")
    path: str | None = Field(None, exclude_if=lambda v: v is None, validate_default=True, description="method "
        "file: the map, JSON {item: [codes or tokens]} (MiniOneRec/LC-Rec index.json) or parquet (item_id, codes)")
    item_json: str | None = Field(None, exclude_if=lambda v: v is None, description="method file: item.json (or "
        "LC-Rec .item2id) naming the items sid.path's keys index (None: its keys are item ids)")
    token_pattern: str | None = Field(None, exclude_if=lambda v: v is None, description="method file: regex of one "
        "token, groups code and level (a letter or a number; none: the position); None: token_format")
    file_codebook_size: PositiveInt | list[PositiveInt] | None = Field(None, exclude_if=lambda v: v is None,
        description="method file: codes per level (one, or one per level); None: each level's largest code + 1")
    missing: Literal["error", "quarantine"] | None = Field(None, exclude_if=lambda v: v is None, description="method "
        "file: catalog items sid.path lacks: error (None) or quarantine (left out, in sid/quarantine.parquet)")
    duplicates: Literal["append_level", "error"] | None = Field(None, exclude_if=lambda v: v is None, description=(
        "method file: items sharing a SID: append_level (None: a level more numbers them by item id) or error"))
    # Left out of dumps while None, so the sid section (and with it the stage fingerprint of
    # every map made before this key) is unchanged; a set value enters the fingerprint.
    seed: Seed | None = Field(
        None, exclude_if=lambda v: v is None,
        description="seed of every random draw that makes the SID map (k-means sample and seeding, RQ-VAE "
        "init and batches, Sinkhorn samples); None: the run's `seed`. Another value gives another map of the "
        "same catalog (`gti compare --sid-seeds N` trains on N of them)")
    levels: int = Field(
        4, ge=1, le=26, description="code levels per item (one token each; de-duplication may add one)")
    codebook_size: int = Field(256, ge=2, le=MAX_CODEBOOK_SIZE, description="codes per level (new tokens per level)")
    code_dim: int = Field(32, gt=0, description="rqvae: size of the latent the codebooks quantise")
    encoder_dims: list[PositiveInt] = Field(
        default_factory=lambda: [512, 256], description="rqvae: hidden layer sizes of the encoder MLP (the decoder "
        "mirrors it)")
    dropout: float = Field(0.1, ge=0, lt=1, description="rqvae: dropout in the encoder/decoder MLPs")
    epochs: int = Field(50, ge=1, description="rqvae: training epochs over all items")
    batch_size: int = Field(1024, gt=0, description="rqvae: global batch (items per step, split over workers)")
    lr: float = Field(1e-3, gt=0, description="rqvae: learning rate")
    weight_decay: float = Field(0.0, ge=0, description="rqvae: optimizer weight decay")
    commitment_beta: float = Field(
        0.25, ge=0, description="rqvae: weight of the commitment loss (keeps the encoder near its codes)")
    rotation_trick: bool = Field(
        False, description="rqvae: pass gradients through the quantiser by the rotation trick (false: "
        "straight-through)")
    diversity_weight: float = Field(
        0.0, ge=0, description="rqvae: weight of the term pushing the batch's soft code usage towards uniform "
        "(0: off)")
    kmeans_iters: int = Field(
        25, ge=1, description="most k-means iterations (codebook init for rqvae, fitting for rqkmeans)")
    fit_threads: int = Field(
        1, ge=1, description="torch threads for the driver's k-means (codebook init, rqkmeans fit): fixed, so "
        "that the SID map does not depend on the machine's core count")
    dead_code_threshold: int = Field(
        0, ge=0, description="codes used <= this many times in an epoch are re-seeded"
    )
    balanced: bool = Field(True, description="rqkmeans: balanced cluster sizes")
    sinkhorn_last_level: bool = Field(
        True, description="spread colliding items over the last level's codes by Sinkhorn before de-duplication")
    train_sinkhorn_epsilon: float = Field(
        0.05, ge=0,
        description="rqvae: the last level trains on Sinkhorn-balanced codes at this epsilon "
        "(relative to the median distance gap; 0 = greedy codes, as at inference)",
    )
    train_sinkhorn_levels: PositiveInt | Literal["all"] = Field(
        "all", description="rqvae: how many of the last levels train on Sinkhorn-balanced codes (1: the last "
        "only, as LC-Rec; all: every level, which keeps every level's codes in use where 1 leaves the "
        "middle levels short: bench/sid/RESULTS.md, \"RQ-VAE: Sinkhorn-balanced training codes on more "
        "levels\")")
    sinkhorn_epsilon: float = Field(
        0.003, gt=0, description="entropy of the Sinkhorn balancing that spreads colliding items over the last "
        "level, relative to the median distance gap: smaller is closer to hard assignment")
    kmeans_sinkhorn_epsilon: float = Field(
        0.003, gt=0, description="rqkmeans (balanced): entropy of the Sinkhorn prices in the balanced Lloyd "
        "steps, relative to the median distance gap. 0.05 reconstructs better and collides less, but the "
        "learnability gate's mean-init walk fell with it (bench/sid/RESULTS.md, \"Sinkhorn without "
        "denormals\"), so 0.003, the value from before this key")
    sinkhorn_iters: int = Field(50, ge=1, description="Sinkhorn iterations per balancing (at most; rqkmeans "
                                "balanced: its final assignment, the warm-started steps before it run at most 10)")
    dedup: Literal["extra_level", "reassign"] = Field(
        "extra_level", description="SIDs still shared: extra_level appends a level numbering each group's "
        "members; reassign moves them to the nearest free last-level code (extra level where none is free)")
    num_workers: int = Field(1, ge=1, description="rqvae: Ray Train workers")
    use_gpu: bool = Field(
        False, description="rqvae training and the assignment on GPU (one per Train worker / assignment actor)")
    assign_batch_size: int = Field(4096, gt=0, description="items per call of an assignment actor")
    assign_concurrency: int = Field(1, ge=1, description="actors in the SID assignment pool")
    assign_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "float32", description="rqvae: precision of the encoder MLP at assignment; auto = bfloat16 "
        "where bf16 is native (CUDA, CPUs with AVX512-BF16/AMX), else float32. float32 by default: auto "
        "gives other codes on other machines. The resolved value enters the stage fingerprint",
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
        128, ge=0, description="driver memory for the colliding items' last residuals during "
        "collision resolution; items past it are re-read and re-encoded in each round",
    )
    resolve_bucket_rows: PositiveInt = Field(
        1 << 19, description="catalog rows per bucket of collision resolution: the driver holds one bucket's "
        "colliding items (~100 B each at 4 levels) at a time; smaller buckets, more passes over the codes. "
        "These defaults hold the driver's memory lowest at 10M items in the same time "
        "(bench/scale_memory/RESULTS.md, \"Smaller buckets and residual cache\")")
    sinkhorn_min_gain: float = Field(
        0.01, ge=0, lt=1, description="stop Sinkhorn spreading after a round that frees fewer "
        "than this share of the colliding items (de-duplication resolves the rest)",
    )
    revive_every_steps: int = Field(
        0, ge=0, description="re-seed dead codes every N optimizer steps (0: once per epoch)"
    )
    revive_after_training: bool = Field(
        True, description="rqvae: after the last epoch, re-seed the codes that the greedy assignment leaves "
        "unused (training on Sinkhorn codes uses every code; the final greedy codes may not), each at a real "
        "residual of its level, so no SID token is dead (bench/sid/RESULTS.md, \"Every code used\")")
    checkpoint_every_s: float = Field(
        30.0, ge=0, description="rqvae: seconds between epoch checkpoints (the last epoch always checkpoints; 0: "
        "every epoch). A checkpoint costs more than a whole epoch on a small catalog; a killed run redoes at "
        "most this much training")
    epoch_cache_mb: int = Field(
        512, ge=0, description="rqvae: when a Train worker's shard of the embeddings (rows x dim float32) "
        "fits in this many MB, the worker reads it once into memory and every epoch trains on a full "
        "shuffle of it seeded by (seed, epoch, worker rank): re-reading the shard through Ray Data each "
        "epoch costs far more than the epoch's compute on catalogs of this size (bench/quality/RESULTS.md, "
        "\"Stage overhead: the RQ-VAE's epochs\"). 0: stream the shard through Ray Data every epoch with a seeded local shuffle buffer "
        "(the batches of the runs from before this option, bit for bit)")
    token_format: str = Field(
        "<{level}_{code}>", description="SID token string; {level} is a letter a, b, c, ...; {code} the code index")
    gates: SidGates = Field(default_factory=SidGates, description="quality gates of the codes")

    @field_validator("path")
    @classmethod
    def _path_iff_file(cls, v: str | None, info) -> str | None:
        if (v is None) == (info.data.get("method") == "file"):
            raise ValueError("sid.method=file needs sid.path; the other methods read none")
        return v

    @field_validator("token_format")
    @classmethod
    def _fmt_has_fields(cls, v: str) -> str:
        if "{level}" not in v or "{code}" not in v:
            raise ValueError("token_format must contain {level} and {code}")
        return v


# --------------------------------------------------------------------------- model / vocab
class ModelConfig(_Strict):
    """The language model whose vocabulary the SID tokens extend."""

    name: str = Field(
        "smollm2-135m", description="smollm2-135m (offline PyPI package), tiny (random tiny Llama built from this "
        "config, for tests), a local HF folder, or a hub id where a network exists")
    trust_remote_code: bool = Field(False, description="let transformers run the model folder's own code")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the loaded weights (bfloat16 needs zero_stage >= 1 to keep fp32 masters)")
    sid_markers: bool = Field(False, description="add <sid_start>/<sid_end> tokens")
    tiny_hidden: int = Field(64, gt=0, description="name tiny only: hidden size")
    tiny_layers: int = Field(2, gt=0, description="name tiny only: transformer layers")
    tiny_heads: int = Field(4, gt=0, description="name tiny only: attention heads")
    tiny_tied: bool = Field(True, description="name tiny only: tie input embeddings and output head")
    tiny_pad_vocab_to: int | None = Field(
        None, description="name tiny only: pad the embedding matrix past the tokenizer to this many rows (None: no "
        "padding), as checkpoints like Qwen3 are")


class InitConfig(_Strict):
    """How the new SID-token rows of the embedding matrix start (gti.lm.init)."""

    method: Literal[INIT_METHODS] = Field(  # type: ignore[valid-type]
        "mean", description="mean (vocabulary mean), mean_noise (mean + scaled noise), random (random directions "
        "at the mean norm), description (mean embedding of the texts of items carrying the code), codebook "
        "(RQ-VAE code vectors mapped into the LM space)")
    noise_std: float = Field(0.02, ge=0, description="mean_noise: std relative to vocab std")


# --------------------------------------------------------------------------- pairs
class PairsConfig(_Strict):
    """The pairs stage: text <-> SID grounding pairs rendered with the chat template."""

    system_prompt: str = Field(
        "You are a helpful assistant.", description="system prompt of every chat-rendered pair and SFT prompt")
    templates: dict[str, str] = Field(
        default_factory=lambda: dict(DEFAULT_GROUNDING_TEMPLATES),
        description="grounding task name -> question template ({title}, {description}, {sid}); the tasks "
        "listed are the tasks rendered")
    max_len: int = Field(128, gt=8, description="tokens per rendered pair; longer text is cut")
    max_desc_chars: int = Field(300, gt=0, description="characters of an item's description used in its pairs")
    exclude_items: list[str] = Field(
        default_factory=list, description="items kept out of grounding (cold-start studies): ids, or one path to a "
        "file of ids")
    val_fraction: float = Field(
        0.02, ge=0, lt=1, description="share of items held out for grounding validation (chosen by a seeded hash)")
    val_holdout: Literal["text2sid", "item"] = Field(
        "text2sid", description="rows of a validation item held out: text2sid (its text->SID rows; its SID->text "
        "rows still train) or item (all its rows)")

    @field_validator("templates")
    @classmethod
    def _known_templates(cls, v: dict[str, str]) -> dict[str, str]:
        unknown = set(v) - set(DEFAULT_GROUNDING_TEMPLATES)
        if unknown:
            raise ValueError(
                f"unknown template name(s) {sorted(unknown)}; known: {sorted(DEFAULT_GROUNDING_TEMPLATES)}"
            )
        return v


# --------------------------------------------------------------------------- run
LOCAL_RAY_ENV = "GTI_LOCAL_RAY"  # "<pid>:<gcs address>" of the local Ray this process started


class RunConfig(_Strict):
    """One run: where it lives, its seed, its Ray, and every section."""

    run_dir: str = Field("runs/demo", description="folder of the run's stages, manifests and reports")
    seed: Seed = Field(0, description="seed of every sample, shuffle and initialisation of the run")
    ray_address: str | None = Field(
        None, description="Ray to join (None: $RAY_ADDRESS, else start a local Ray; auto: a running cluster)")
    ray_num_cpus: int | None = Field(None, ge=1, description="CPUs of a local Ray this run starts (None: all)")
    local_max_items: int = Field(
        20_000, ge=0, description="catalogs of at most this many items get their SIDs assigned and their pairs "
        "rendered in the driver process, larger ones on Ray Data actor pools (whose start-up costs more than the "
        "work below this size; ingest likewise reads a source of one read task in the driver); the outputs are "
        "the same either way, so it is in no stage's fingerprint (0: always Ray Data)")
    data: DataConfig = Field(default_factory=DataConfig, description="ingest: sources, text limits, caps")
    embed: EmbedConfig = Field(default_factory=EmbedConfig, description="embed: item text -> content embedding")
    sid: SidConfig = Field(default_factory=SidConfig, description="sid: embeddings -> semantic IDs")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the language model")
    init: InitConfig = Field(default_factory=InitConfig, description="initial rows of the new SID tokens")
    pairs: PairsConfig = Field(default_factory=PairsConfig, description="pairs: text <-> SID grounding pairs")
    ground: GroundConfig = Field(default_factory=GroundConfig, description="ground: training of the SID rows")
    sft: SftConfig = Field(default_factory=SftConfig, description="sft: next-item recommendation fine-tuning")
    rl: RlConfig = Field(default_factory=RlConfig, description="rl: GRPO after SFT (off by default)")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="evaluate: top-K metrics by beam search")
    report: ReportConfig = Field(default_factory=ReportConfig, description="report: plots and CIs")
    tune: TuneConfig = Field(default_factory=TuneConfig, description="gti tune: the sweep")
    compare: CompareConfig = Field(default_factory=CompareConfig, description="gti compare: arms x seeds")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="metric sinks (TensorBoard, MLflow)")
    refresh: RefreshConfig = Field(default_factory=RefreshConfig, description="gti refresh: new items onto a run")
    serve: ServeConfig = Field(default_factory=ServeConfig, description="gti serve: the online service")

    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir).expanduser().resolve()

    def requested_ray_address(self, env: Any = None) -> str | None:
        """The Ray a run joins: `ray_address`, else $RAY_ADDRESS, except where $RAY_ADDRESS is
        this very process's own local Ray (pinned by gti.ray_start.ensure_ray, marked in
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
