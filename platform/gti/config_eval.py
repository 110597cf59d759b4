"""Config of the evaluation's reference rows: the `eval.baselines` names and `eval.sasrec`.

What it is for: the typed, validated settings of the SASRec reference row (`gti.eval.sasrec`),
kept out of `gti.config` (which re-exports them) so that module stays small. Unknown keys are
rejected like every other section (`gti.config_io.StrictModel`).

What it does not know: how the rows are computed (`gti.eval.reference`), Ray, torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

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
