"""The SFT runner: one function that fine-tunes a model on prepared SFT rows, for every caller.

What it is for: `run_sft(inputs, storage_path=, name=, start_ray=, log=)` is how the `sft`
stage and `gti refresh` train: the worker config (`WorkerConfig.build("sft", ...)`), the Ray
dataset of the training rows (materialised, in file order), the Train run
(`gti.train.runner.train`, so a second call with the same storage path and name resumes) and
the facts both record (`TrainResult.facts`, `history_facts`). The caller rebuilds the trained
model from `TrainResult.state_dict` (`gti.train.sft_task.rebuild_trained`) and exports it.

What it does not know: how the rows were rendered or shuffled, the validation users, which
caller it serves, where the model is exported, Ray's API.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

from gti.train import ray_train, runner
from gti.train.runner import TrainResult, curve, loss_ends
from gti.train.sft_task import VAL_METRIC
from gti.train.worker_config import FaultInjection, SftStart, ValSet, WorkerConfig


@dataclass(frozen=True)
class SftInputs:
    """What an SFT run trains on."""

    run_cfg: Any  # RunConfig the workers rebuild: `sft` is the TrainConfig (LoRA, max_len, ...)
    train_path: Path  # parquet: input_ids list<int>, labels list<int> (-100 outside the answer), already
    #                   shuffled with the seed: trained in file order
    model_dir: Path  # the standard HF folder SFT starts from (vocabulary already extended)
    pad_id: int
    val: ValSet | None = None  # the validation users' prompts and the catalog trie; None: no validation
    fault: FaultInjection | None = None  # tests only


def history_facts(history: dict[str, Any], steps_done: int) -> dict[str, Any]:
    """steps_done, final_loss, first_loss, loss_history [{step, value}], val_recall@10 [{step,
    value}] and val_history {metric: [{step, value}]} (every validation metric's curve) of a
    history ({"loss": [], "val": {}} for a run that did not train)."""
    ends = loss_ends(history)
    return {
        "steps_done": int(steps_done),
        "final_loss": None if ends["final_loss"] is None else float(ends["final_loss"]),
        "first_loss": None if ends["first_loss"] is None else float(ends["first_loss"]),
        "loss_history": [{"step": int(s), "value": float(v)} for s, v in history.get("loss", [])],
        VAL_METRIC: curve(history, VAL_METRIC),
        "val_history": {k: curve(history, k) for k in history.get("val", {})},
    }


def run_sft(
    inputs: SftInputs,
    *,
    storage_path: str | Path,
    name: str,
    start_ray: Callable[[], None],
    log: Callable[[str], None],
    tracker: Callable[[], ContextManager] | None = None,
    callbacks: list | None = None,
) -> TrainResult:
    """Fine-tune `inputs.model_dir` on `inputs.train_path` with `inputs.run_cfg.sft`.

    storage_path, name: the Train run (a second call with both resumes from its latest
    checkpoint; `name` must be deterministic). start_ray: joins or starts Ray (the caller's
    `ensure_ray`). tracker / callbacks: see `gti.train.runner.train`.
    Returns every trainable tensor ({name: fp32 tensor}, LoRA adapters unmerged), the history
    and the facts: `history_facts` + trainable_params, precision (the one trained in), timing.
    """
    sc = inputs.run_cfg.sft
    config = WorkerConfig.build("sft", inputs.run_cfg, inputs.pad_id, sft=SftStart(str(inputs.model_dir)),
                                val=inputs.val, fault=inputs.fault)

    def dataset():
        # Materialised before the worker group reserves its CPUs: the streaming split then needs
        # no read task while the workers hold their slots (on a full cluster, with Tune trials or
        # compare arms side by side, a pending read would otherwise wait for ever).
        return ray_train.read_parquet_dataset(inputs.train_path, ["input_ids", "labels"], materialize=True)

    res = runner.train(config, dataset, sc, storage_path=storage_path, name=name, start_ray=start_ray, log=log,
                       progress_every=max(1, sc.log_every), callbacks=callbacks, tracker=tracker)
    facts = {
        **history_facts(res.history, res.steps_done),
        "trainable_params": int(sum(t.numel() for t in res.state_dict.values())),
        "precision": res.precision or sc.precision,
        "timing": res.timing,
    }
    return TrainResult(res.state_dict, res.history, facts)
