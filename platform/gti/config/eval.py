"""The evaluation and report sections of the run config: `eval:` (with its reference rows,
`eval.baselines` and `eval.sasrec`) and `report:`.

What it is for: `EvalConfig` (beam search, K values, splits, user sample, bootstrap, exact
ranks, the cold-item slice), `SasrecConfig` (the SASRec reference row, `gti.eval.sasrec`) with
its `SasrecSweepConfig` (the settings it is tuned over, on the valid split) and
`ReportConfig` (the report stage's plots and CIs), kept out of `gti.config` (which holds them
in `RunConfig`) so that module stays small. Unknown keys are rejected like every other section
(`gti.config.io.StrictModel`).

What it does not know: how metrics or rows are computed (`gti.eval`, `gti.stages.evaluate`),
Ray, torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from gti.config.io import PositiveInt, Seed
from gti.config.io import StrictModel as _Strict

BASELINES = ("mostpop", "markov", "sasrec")
BASELINES_HELP = (
    "reference rows scored on the same users and splits as the model: mostpop and markov (fitted "
    "per split on its training data), sasrec (trained once on the training items, its settings "
    "and checkpoint chosen on valid only: eval.sasrec.sweep; with eval.exact_rank also ranked over the "
    "whole catalog)"
)


def _unique(names: list[str]) -> list[str]:
    if len(set(names)) != len(names):
        raise ValueError(f"baselines {names} name a row twice")
    return names


# eval.baselines: known names, each at most once.
BaselineNames = Annotated[list[Literal["mostpop", "markov", "sasrec"]], AfterValidator(_unique)]


# eval.sasrec.sweep.max_len: an int, or "history" = data.max_history (the LM's prompt length).
MaxLen = int | Literal["history"]


def _positive_lens(lens: list) -> list:
    bad = [v for v in lens if isinstance(v, int) and v < 1]
    if bad:
        raise ValueError(f"max_len values must be >= 1 or 'history', got {bad}")
    return lens


class SasrecSweepConfig(_Strict):
    """eval.sasrec.sweep: the settings SASRec is tuned over, on the VALID split only
    (`gti.eval.sasrec.tune_sasrec`). Every candidate trains on the training items alone and is
    scored on the valid items (`metric`, whole-catalog ranks); the best is kept for every row.
    Keys not swept (blocks, heads, lr, batch_size, n_sample, loss, val_every, val_users) come
    from eval.sasrec. What the default costs: bench/proof/RESULTS.md, "What SASRec's default sweep
    costs"."""

    enabled: bool = Field(True, description="tune on valid (false: train eval.sasrec's own epochs, dim, "
                          "dropout and max_len once, e.g. for fast tests)")
    search: Literal["axes", "grid"] = Field(
        "axes", description="axes: one axis at a time in the order dropout, dim, epochs, max_len (the "
        "longest inputs cost the most: tried once, with the best of the rest), each trying its values with "
        "the best values found so far, the others at their first value (1 + sum(len - 1) candidates: 6 by "
        "default); grid: every combination (prod(len) candidates: 24)")
    max_len: Annotated[list[MaxLen], AfterValidator(_positive_lens)] = Field(
        default_factory=lambda: ["history", 20, 50], min_length=1,
        description="SASRec's input length: a user's last max_len items (history = data.max_history)")
    epochs: list[PositiveInt] = Field(default_factory=lambda: [10, 20], min_length=1,
                                      description="training epochs (the best valid checkpoint within is kept)")
    dim: list[PositiveInt] = Field(default_factory=lambda: [64, 128], min_length=1,
                                   description="item embedding / hidden size")
    dropout: list[Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        default_factory=lambda: [0.2, 0.5], min_length=1, description="dropout rate")
    metric: Literal["mrr", "recall@10"] = Field(
        "mrr", description="what picks the candidate: MRR of the valid item's exact rank over the whole "
        "catalog (every user counts, hit or not), or Recall@10 on the same ranks")
    val_users: int | None = Field(None, ge=1, description="valid users each candidate is scored on (seeded "
                                  "sample; None: every user)")


class SasrecConfig(_Strict):
    """The SASRec reference row (`gti.eval.sasrec`: cornac's PyTorch SASRec), trained in the
    evaluate stage on the training items only (valid and test items never train it), its
    settings chosen on the valid split by `sweep` and its checkpoint picked on the valid split.
    With the sweep off it trains once with the settings below."""

    max_len: int | None = Field(None, ge=1, description="input length with the sweep off: a user's last "
                                "max_len items (None: data.max_history)")
    epochs: int = Field(10, ge=1, description="training epochs over the training windows (all run; "
                        "the best valid checkpoint is kept)")
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
                                "the process's setting); 1 is fastest at these model sizes "
                                "(bench/proof/RESULTS.md, \"What SASRec's default sweep costs\")")

    sweep: SasrecSweepConfig = Field(default_factory=SasrecSweepConfig,
                                     description="tuning on the valid split (enabled by default)")

    @model_validator(mode="after")
    def _heads_divide_dim(self) -> "SasrecConfig":
        dims = [self.dim] + (list(self.sweep.dim) if self.sweep.enabled else [])
        bad = [d for d in dims if d % self.heads]
        if bad:
            raise ValueError(f"dim {bad[0]} is not divisible by heads {self.heads}")
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
    normalise: Literal["vocab", "trie"] = Field(
        "vocab", description="beam scores: each SID token's log-prob over the full vocabulary (vocab, generate's "
        "scores) or over the catalog children of its prefix only (trie: an item's score is its log-prob under the "
        "model restricted to catalog items); needs constrained, not with exact_rank (which scores by vocab)")
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
        if self.normalise == "trie" and not self.constrained:
            raise ValueError("eval.normalise 'trie' needs eval.constrained true (it normalises over the trie)")
        if self.normalise == "trie" and self.exact_rank:
            raise ValueError("eval.normalise 'trie' with eval.exact_rank: the exact rank scores by the full "
                             "vocabulary, so the two would rank by different scores")
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
