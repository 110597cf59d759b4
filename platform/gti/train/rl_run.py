"""The RL runner: GRPO after SFT in the shape of the grounding and SFT runners.

What it is for: `rl_rows_from_sft` turns SFT's rendered training rows into RL prompts (the
user-history windows only: their prompts and their targets' SID tokens, packed by
`gti.train.rl_task.rl_row`; the grounding pairs of a multitask mix are left out), and
`run_rl(inputs, storage_path=, name=, start_ray=, log=)` trains: the worker config
(`WorkerConfig.build("rl", ...)`), the Ray dataset of the rows (materialised, in file order),
the Train run (`gti.train.runner.train`: a second call with the same storage path and name
resumes) and the facts (`TrainResult.facts`): SFT's history facts, plus the best validation
(step 0 is the SFT model), the early stop and the mean of each step statistic.

What it does not know: where the SFT rows or the model came from (the caller keeps valid and
test targets out of the rows), the validation users, where the model is exported, Ray's API.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

import polars as pl

from gti.errors import ConfigError
from gti.lm.templates import SEQ_TASK
from gti.train import ray_train, runner
from gti.train.rl_task import BEST_METRIC, rl_row
from gti.train.runner import TrainResult
from gti.train.sft_run import history_facts
from gti.train.worker_config import FaultInjection, RlStart, ValSet, WorkerConfig


@dataclass(frozen=True)
class RlInputs:
    """What an RL run trains on."""

    run_cfg: Any  # RunConfig the workers rebuild: `rl` is the RlConfig
    train_path: Path  # parquet of `rl_row`s (input_ids = prompt, labels = the target SID at its end)
    start: RlStart  # the SFT model (policy start and KL reference) and the catalog's trie
    pad_id: int
    val: ValSet  # the validation users; must compute val_mrr (the best-checkpoint metric)
    fault: FaultInjection | None = None  # tests only


def rl_rows_from_sft(rows: pl.DataFrame, levels: int) -> pl.DataFrame:
    """SFT training rows (`gti.train.sft_data`: task, prompt_ids, answer_ids, ...) -> RL rows
    {"input_ids", "labels"} (list<int32>) of the sequence task only, in the same order; the
    target is the first `levels` answer tokens (the next item's SID)."""
    seq = rows.filter(pl.col("task") == SEQ_TASK)
    packed = [rl_row(list(p), list(a)[:levels]) for p, a in zip(seq["prompt_ids"].to_list(), seq["answer_ids"].to_list())]
    lists = pl.List(pl.Int32)
    return pl.DataFrame({"input_ids": [r["input_ids"] for r in packed], "labels": [r["labels"] for r in packed]},
                        schema={"input_ids": lists, "labels": lists})


def step_stat_means(history: dict[str, Any]) -> dict[str, float]:
    """{stat: mean over the steps} of the step statistics in a history (reward_mean, kl, ...)."""
    return {k: sum(v for _, v in pts) / len(pts) for k, pts in history.get("stats", {}).items() if pts}


def run_rl(
    inputs: RlInputs,
    *,
    storage_path: str | Path,
    name: str,
    start_ray: Callable[[], None],
    log: Callable[[str], None],
    tracker: Callable[[], ContextManager] | None = None,
    callbacks: list | None = None,
) -> TrainResult:
    """GRPO on `inputs.start.model_dir` over the prompts of `inputs.train_path` with
    `inputs.run_cfg.rl`.

    storage_path, name, start_ray, tracker, callbacks: as `gti.train.sft_run.run_sft`.
    Returns the best validation's tensors ({name: fp32 tensor}; the SFT model's own when no step
    beat it), the history and the facts: `history_facts` + best {metric, start, value, step},
    stopped_at (the step of an early stop, or None), step_stats (means), trainable_params,
    precision, timing.
    """
    rc = inputs.run_cfg.rl
    if not inputs.val.mrr:
        raise ConfigError(f"rl keeps its best checkpoint by {BEST_METRIC}: its validation set must compute it "
                          "(ValSet.mrr=True)")
    config = WorkerConfig.build("rl", inputs.run_cfg, inputs.pad_id, rl=inputs.start, val=inputs.val,
                                fault=inputs.fault)

    def dataset():
        # Materialised before the worker group reserves its CPUs (see gti.train.sft_run).
        return ray_train.read_parquet_dataset(inputs.train_path, ["input_ids", "labels"], materialize=True)

    res = runner.train(config, dataset, rc, storage_path=storage_path, name=name, start_ray=start_ray, log=log,
                       progress_every=max(1, rc.log_every), callbacks=callbacks, tracker=tracker)
    facts = {
        **history_facts(res.history, res.steps_done),
        "best": res.history.get("best"),
        "stopped_at": res.history.get("stopped_at"),
        "step_stats": step_stat_means(res.history),
        "trainable_params": int(sum(t.numel() for t in res.state_dict.values())),
        "precision": res.precision or rc.precision,
        "timing": res.timing,
    }
    return TrainResult(res.state_dict, res.history, facts)
