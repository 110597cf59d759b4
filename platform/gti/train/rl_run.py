"""The RL runner: GRPO after SFT in the shape of the grounding and SFT runners.

What it is for: `rl_prompt_rows` makes the RL prompts: a seeded sample of SFT's training windows
(`gti.train.sft_data.training_windows`: training items only, so no valid or test item is ever a
rollout's target or in its history) rendered in the evaluation prompt form, each packed with its
target's SID tokens (`gti.train.rl_task.rl_row`); `run_rl` trains through `gti.train.runner`
(a second call with the same storage path and name resumes) and returns the facts.

What it does not know: where the SFT rows or the model came from (the caller keeps valid and
test targets out of the rows), the validation users, where the model is exported, Ray's API.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

import numpy as np
import polars as pl

from gti.common.errors import ConfigError
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


def rl_prompt_rows(windows: pl.DataFrame, renderer, sid_ids: dict[str, np.ndarray], n: int,
                   seed: int) -> pl.DataFrame:
    """RL rows {"input_ids", "labels"} (list<int32>) of a seeded sample of `n` of `windows`
    (rows of `training_windows`: user_id, history, target), in the sampled order: the prompt is
    `renderer.render_prompts`'s (what evaluate decodes), the target its item's SID tokens."""
    idx = np.random.default_rng([seed, 0x5EED]).permutation(windows.height)[: max(0, n)]
    sample = windows[idx]
    prompts = renderer.render_prompts({"user_id": sample["user_id"].to_list(), "split": ["train"] * sample.height,
                                       "history": sample["history"].to_list(), "target": sample["target"].to_list()})
    packed = [rl_row(p, [int(x) for x in sid_ids[t]]) for p, t in zip(prompts["prompt_ids"], prompts["target"])]
    lists = pl.List(pl.Int32)
    return pl.DataFrame({"input_ids": [r["input_ids"] for r in packed], "labels": [r["labels"] for r in packed]},
                        schema={"input_ids": lists, "labels": lists})


def step_stat_means(history: dict[str, Any]) -> dict[str, float]:
    """{stat: mean over the steps} of the step statistics in a history (reward_mean, kl, ...)."""
    return {k: sum(v for _, v in pts) / len(pts) for k, pts in history.get("stats", {}).items() if pts}


def time_shares(history: dict[str, Any], compute_s: float | None, grad_accum: int) -> dict[str, float] | None:
    """{"rollout", "reward", "update"}: shares of the training steps' compute time (the loop's
    compute_s: forward, backward, optimizer, in the step hook and around it) spent rolling out,
    rewarding, and in the update (the rest: scoring forwards, backward, optimizer step). None
    without compute time. The hook's seconds are per micro-step means, hence x grad_accum."""
    if not compute_s:
        return None
    spent = {k: grad_accum * sum(v for _, v in history.get("stats", {}).get(f"{k}_s", [])) for k in ("rollout", "reward")}
    out = {k: v / compute_s for k, v in spent.items()}
    out["update"] = max(0.0, 1.0 - out["rollout"] - out["reward"])
    return out


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

    storage_path, name, start_ray, tracker, callbacks: as `gti.train.sft_run.run_sft`. The rows
    go to Ray as one dataset, materialised, in file order. Steps are optimizer steps
    (`rl.steps`); with `rl.updates_per_rollout` K a rollout batch serves K of them
    (`gti.train.rl_task`), so a run of S steps rolls out ceil(S / K) times.
    Returns the best validation's tensors ({name: fp32 tensor}; the SFT model's own when no step
    beat it), the history and the facts: `history_facts` + best {metric, start, value, step},
    stopped_at (the step of an early stop, or None), step_stats (means over optimizer steps; a
    reused rollout's reward figures count once per step it served), time_shares (rollout /
    reward / update), updates_per_rollout, trainable_params, precision, timing.
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
        "time_shares": time_shares(res.history, (res.timing or {}).get("compute_s"), rc.grad_accum),
        "updates_per_rollout": rc.updates_per_rollout,
        "trainable_params": int(sum(t.numel() for t in res.state_dict.values())),
        "precision": res.precision or rc.precision,
        "timing": res.timing,
    }
    return TrainResult(res.state_dict, res.history, facts)
