"""The typed configuration: one validated `RunConfig` that every stage and command reads.

`run_config` (the run, the sections without a module of their own: embed, sid, model, init,
pairs; `load`, `validate`, `dump`), `train`, `data`, `eval` (evaluation and report), `serve`,
`commands` (compare, tune, tracking, refresh), `io` (the schema-free machinery: strict base
model, YAML, overrides, redaction, error lines, bounded types), `explain` (`--explain`).
What most callers use is re-exported here: `from gti import config as C; C.load(path)`.

What it does not know: how stages run, where outputs go (`gti.run`), or Ray; no torch either.
"""

from gti.config.data import DataConfig, DenseSubset, InteractionColumns, InteractionsSource, ItemColumns, ItemsSource
from gti.config.run_config import (LOCAL_RAY_ENV, MAX_CODEBOOK_SIZE, EmbedConfig, InitConfig, ModelConfig,
                                   PairsConfig, RunConfig, SidConfig, SidGates, dump, load, validate)

__all__ = ["DataConfig", "DenseSubset", "EmbedConfig", "InitConfig", "InteractionColumns", "InteractionsSource",
           "ItemColumns", "ItemsSource", "LOCAL_RAY_ENV", "MAX_CODEBOOK_SIZE", "ModelConfig", "PairsConfig",
           "RunConfig", "SidConfig", "SidGates", "dump", "load", "validate"]
