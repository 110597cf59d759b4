"""The grounding runner: one function that trains new vocabulary rows on pairs, for every caller.

What it is for: `run_grounding(inputs, storage_path=, name=, start_ray=, log=)` is how the
`ground` stage, `gti refresh` and `gti vocab ground` train: the micro-batch check on the train
pairs (before Ray starts), the worker config, the seeded Ray dataset of the train pairs, the
Train run (`gti.train.runner.train`, so a second call with the same storage path and name
resumes) and the facts every caller records. Also what the callers share around it:
`check_pairs`, `write_val_set` and `VAL_TASKS`.

What it does not know: how the pairs or the initial rows were made, which caller it serves,
where the grounded model is exported, Ray's API.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gti.common.errors import DataError
from gti.train import ray_train, runner
from gti.train.runner import TrainResult, curve, loss_ends
from gti.train.worker_config import FaultInjection, GroundRows, ValSet, WorkerConfig

VAL_TASKS = ("title2sid", "desc2sid")  # the pair tasks whose answer is a SID: what validation decodes


@dataclass(frozen=True)
class GroundingInputs:
    """What a grounding run trains on."""

    run_cfg: Any  # RunConfig the workers rebuild: `ground` is the TrainConfig, `seed` the data order
    pairs_path: Path  # parquet: split, input_ids list<int>, labels list<int> (-100 outside the
    #                   answer); the "train" rows train
    rows: GroundRows  # the initial new rows and their ids
    pad_id: int
    val: ValSet | None = None  # text->SID prompts (`write_val_set`); None: no validation
    fault: FaultInjection | None = None  # tests only
    where: str | None = None  # what the too-few-pairs DataError names (default: pairs_path)
    noun: str = "train pairs"  # ... and what it calls them
    note: str = ""  # the caller's words added to the start line (where it starts from, which validation)


def count_train_pairs(path: str | Path) -> int:
    """The number of "train" rows of a pairs parquet file."""
    t = pq.read_table(path, columns=["split"])
    return int(pc.sum(pc.equal(t["split"], "train")).as_py() or 0)


def check_pairs(pairs_path: str | Path, g, where: str | None = None, noun: str = "train pairs") -> int:
    """The train pairs' count; ConfigError naming the key when `g` (a GroundConfig) has no valid
    micro-batch, DataError when the pairs cannot fill one micro-batch on every worker. Cheap:
    it reads one column and loads no model."""
    from gti.train.deepspeed_config import micro_batch

    micro = micro_batch(g, g.num_workers)  # ConfigError naming the key before Ray starts
    n_train = count_train_pairs(pairs_path)
    if n_train < g.num_workers * micro:
        raise DataError(f"{where or pairs_path}: {n_train} {noun} cannot fill one micro-batch of {micro} on each of "
                        f"{g.num_workers} workers (ground.batch_size / ground.num_workers)")
    return n_train


def write_val_set(pairs_path: str | Path, out_path: str | Path, *, seed: int, n_samples: int, first_sid: int,
                  end_sid: int, levels: int, sid_ids: frozenset[int] | None = None) -> int:
    """Sample `n_samples` (seeded) held-out text->SID pairs of `pairs_path` (split "val", tasks
    VAL_TASKS) into `out_path`: prompt = chat prompt + the answer tokens before the SID (e.g.
    <sid_start>), target = the `levels` SID token ids. The SID tokens are the ids in
    [first_sid, end_sid), or the set `sid_ids` when given (`gti refresh` after added codes: not
    one contiguous range). Returns the number of rows (0 = none held out, nothing written)."""
    t = pq.read_table(pairs_path, columns=["task", "split", "prompt_ids", "answer_ids"])
    mask = pc.and_(pc.equal(t["split"], "val"), pc.is_in(t["task"], pa.array(list(VAL_TASKS))))
    t = t.filter(mask)
    if t.num_rows == 0:
        return 0
    rng = np.random.default_rng(seed)
    n = min(n_samples, t.num_rows)
    rows = np.sort(rng.choice(t.num_rows, size=n, replace=False))
    t = t.take(pa.array(rows))
    prompts, targets = [], []
    for i, (p, a) in enumerate(zip(t["prompt_ids"].to_pylist(), t["answer_ids"].to_pylist())):
        where = [j for j, x in enumerate(a) if (x in sid_ids if sid_ids is not None else first_sid <= x < end_sid)]
        if len(where) < levels or where[:levels] != list(range(where[0], where[0] + levels)):
            raise DataError(f"{pairs_path}: val pair {int(rows[i])} has no run of {levels} SID tokens in its answer")
        s = where[0]
        prompts.append(list(p) + list(a[:s]))
        targets.append(list(a[s: s + levels]))
    pq.write_table(pa.table({"prompt": prompts, "target": targets}), out_path)
    return n


def run_grounding(
    inputs: GroundingInputs,
    *,
    storage_path: str | Path,
    name: str,
    start_ray: Callable[[], None],
    log: Callable[[str], None],
    tracker: Callable[[], ContextManager] | None = None,
    callbacks: list | None = None,
) -> TrainResult:
    """Ground `inputs.rows` on the train pairs with `inputs.run_cfg.ground`.

    storage_path, name: the Train run (a second call with both resumes from its latest
    checkpoint; `name` must be deterministic). start_ray: joins or starts Ray (the caller's
    `ensure_ray`), called after the checks. tracker / callbacks: see `gti.train.runner.train`.
    Returns the trained rows ({"e_new": [n_new, d]} + "head_new" for an untied head, fp32),
    the history and the facts: steps_done, first_loss, final_loss, val_exact_match [{step,
    value}], tokens_per_s_median, train_pairs, val_prompts, num_workers, zero_stage,
    precision (the one trained in), precision_setting, timing.
    """
    g = inputs.run_cfg.ground
    n_train = check_pairs(inputs.pairs_path, g, inputs.where, inputs.noun)
    n_val = 0 if inputs.val is None else pq.read_metadata(inputs.val.path).num_rows
    config = WorkerConfig.build("ground", inputs.run_cfg, inputs.pad_id, ground=inputs.rows, val=inputs.val,
                                fault=inputs.fault)
    log(f"grounding {g.steps} steps x {g.batch_size} pairs on {g.num_workers} worker(s), ZeRO-{g.zero_stage}, "
        f"{g.precision}, lr {g.lr:g}; {n_train:,} train pairs, {n_val} val prompts"
        + (f" ({inputs.note})" if inputs.note else ""))
    res = runner.train(
        config, lambda: ray_train.train_dataset_from_parquet(inputs.pairs_path, seed=inputs.run_cfg.seed), g,
        storage_path=storage_path, name=name, start_ray=start_ray, log=log,
        progress_every=max(g.log_every, math.ceil(g.steps / 20)), callbacks=callbacks, tracker=tracker,
    )
    tps = [v for _, v in res.history.get("tokens_per_s", [])]
    facts = {
        "steps_done": res.steps_done,
        **loss_ends(res.history),
        "val_exact_match": curve(res.history, "val_exact_match"),
        "tokens_per_s_median": float(np.median(tps)) if tps else None,
        "train_pairs": n_train,
        "val_prompts": n_val,
        "num_workers": g.num_workers,
        "zero_stage": g.zero_stage,
        "precision": res.precision or g.precision,
        "precision_setting": g.precision,
        "timing": res.timing,
    }
    return TrainResult(res.state_dict, res.history, facts)
