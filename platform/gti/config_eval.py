"""The evaluation and report sections of the run config: `eval:` (with its reference rows,
`eval.baselines` and `eval.sasrec`) and `report:`.

What it is for: `EvalConfig` (beam search, K values, splits, user sample, bootstrap, exact
ranks, the cold-item slice), `SasrecConfig` (the SASRec reference row, `gti.eval.sasrec`) and
`ReportConfig` (the report stage's plots and CIs), kept out of `gti.config` (which holds them
in `RunConfig`) so that module stays small. Unknown keys are rejected like every other section
(`gti.config_io.StrictModel`).

What it does not know: how metrics or rows are computed (`gti.eval`, `gti.stages.evaluate`),
Ray, torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from gti.config_io import PositiveInt, Seed
from gti.config_io import StrictModel as _Strict

BASELINES = ("mostpop", "markov", "sasrec")
BASELINES_HELP = (
    "reference rows scored on the same users and splits as the model: mostpop and markov (fitted "
    "per split on its training data), sasrec (trained once on the SFT windows, selected on valid; "
    "with eval.exact_rank also ranked over the whole catalog)"
)


def _unique(names: list[str]) -> list[str]:
    if len(set(names)) != len(names):
        raise ValueError(f"baselines {names} name a row twice")
    return names


# eval.baselines: known names, each at most once.
BaselineNames = Annotated[list[Literal["mostpop", "markov", "sasrec"]], AfterValidator(_unique)]


class SasrecConfig(_Strict):
    """The SASRec reference row (`gti.eval.sasrec`: cornac's PyTorch SASRec), trained in the
    evaluate stage on the SFT training windows (train items, history data.max_history), the
    checkpoint picked on the valid split only."""

    epochs: int = Field(10, ge=1, description="training epochs over the SFT windows (all run; the "
                        "best valid checkpoint is kept)")
    dim: int = Field(64, ge=1, description="item embedding / hidden size")
    blocks: int = Field(2, ge=1, description="self-attention blocks")
    heads: int = Field(1, ge=1, description="attention heads (dim must be divisible by it)")
    dropout: float = Field(0.2, ge=0.0, lt=1.0, description="dropout rate")
    lr: float = Field(1e-3, gt=0, description="Adam learning rate")
    batch_size: int = Field(256, ge=2, description="training windows per batch")
    n_sample: int = Field(1024, ge=0, description="negatives shared by a batch, drawn by popularity^0.5 "
                          "from training items (0: in-batch negatives only)")
    loss: Literal["ce", "bce", "bpr", "bpr-max", "top1"] = Field(
        "ce", description="cornac loss over the batch's targets + shared negatives; ce = sampled softmax")
    val_every: int = Field(2, ge=1, description="epochs between valid-split checks (Recall@10)")
    val_users: int | None = Field(1000, ge=0, description="valid users scored per check (seeded sample; "
                                  "None: all; 0: no selection, keep the last epoch)")
    batch_users: int = Field(512, ge=1, description="histories per scoring forward")
    threads: int | None = Field(1, ge=1, description="torch threads while training and scoring (None: "
                                "the process's setting); 1 is fastest at these model sizes (measured: "
                                "2 threads were ~10x slower on a loaded 2-core machine)")

    @model_validator(mode="after")
    def _heads_divide_dim(self) -> "SasrecConfig":
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not divisible by heads {self.heads}")
        return self


class EvalConfig(_Strict):
    """The evaluate stage: leave-one-out top-K metrics by constrained beam search."""

    beam_width: int = Field(20, ge=1, description="beams kept per user in the SID beam search (>= every K)")
    ks: list[PositiveInt] = Field(
        default_factory=lambda: [5, 10, 20], min_length=1, description="cut-offs K of Recall/NDCG/Precision@K")
    splits: list[Literal["valid", "test"]] = Field(
        default_factory=lambda: ["valid", "test"], description="leave-one-out splits evaluated")
    max_users: int | None = Field(None, gt=0, description="evaluate a seeded sample of this many users (None: all)")
    sample_seed: Seed | None = Field(
        None, description="seed of that sample (None: the run's seed; fix it to evaluate the same "
        "users in every seed of a comparison)",
    )
    batch_users: int = Field(8, ge=1, description="users decoded per batch (per actor call)")
    concurrency: int = Field(1, ge=1, description="decoding actors in the Ray Data pool")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per decoding actor (0: decode on CPU)")
    bootstrap: int = Field(1000, ge=0, description="bootstrap resamples over users for metric CIs (0: none)")
    constrained: bool = Field(
        True, description="restrict beam search to SIDs in the catalog's trie (false: the invalid-SID rate shows "
        "what the model makes up)")
    cpu_threads: int | None = Field(
        None, ge=1, description="torch threads per CPU decoding actor (None: Ray's setting, 1 by default)")
    exact_rank: bool = Field(
        False, description="also the exact rank of the true item among ALL catalog items (MRR, mean percentile "
        "rank with CIs; gti.eval.rank): one prefill plus one token per distinct SID prefix per user")
    cold_max_sft_targets: int = Field(
        1, ge=0, description="cold-item slice: metrics also for users whose target is the target of at most this "
        "many SFT training windows (counted on train items only)")
    baselines: BaselineNames = Field(default_factory=lambda: list(BASELINES), description=BASELINES_HELP)
    sasrec: SasrecConfig = Field(default_factory=SasrecConfig, description="the sasrec reference row")

    @model_validator(mode="after")
    def _k_le_beam(self) -> "EvalConfig":
        bad = [k for k in self.ks if k > self.beam_width]
        if bad:
            raise ValueError(f"ks {bad} exceed beam_width {self.beam_width}")
        return self


class ReportConfig(_Strict):
    """The report stage (and `gti compare`'s report): plots, labels and CIs."""

    max_heatmap_tokens: int = Field(
        256, gt=0, description="SID tokens shown in a cosine heatmap (an evenly spaced subset per level)")
    label: str | None = Field(
        None, description="name of this run in reports (None: derived from init method / grounding / multitask / rl)")
    text_sample: int = Field(512, ge=0, description="old vocabulary rows for SID-text cosine")
    rsa_max_codes_per_level: int = Field(
        1024, ge=2, description="codes per level kept (evenly spaced) in the RSA between RQ-VAE code vectors and "
        "learned SID rows")
    bootstrap: int = Field(1000, ge=0, description="resamples for report CIs")
    baseline_arm: str = Field("mean", description="arm the relative lifts of the comparison tables are measured "
                              "against (an arm name: mean = mean init without grounding; gti, gti+<method>, ...)")
