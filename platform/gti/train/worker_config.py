"""The one config every Ray Train worker of the shared loop receives (`gti.train.loop`).

What it is for: `WorkerConfig` (frozen, picklable) says what a worker trains: the task and its
hooks, the run's config, the padding id, the task's inputs (`GroundRows` for grounding,
`SftStart` for SFT, `RlStart` for RL), the validation set (`ValSet`), test-only fault injection
(`FaultInjection`), and two fields the driver side fills in. `WorkerConfig.build` is the one
place a runner makes one. Ray Train takes its `train_loop_config` as a dict:
`gti.train.ray_train.run_trainer` flattens the dataclass's top level into one and the worker
rebuilds the same object with `from_loop_dict`; nothing else sees the dict.

What it does not know: how the loop trains, what the files hold beyond their shapes, Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gti.train.task import TaskHooks

@dataclass(frozen=True)
class GroundRows:
    """The grounding task's trainable rows: ids [first_new_id, first_new_id + n_new)."""

    init_path: str  # safetensors: "e_new" float [n_new, d] (+ "head_new" [n_new, d] for an untied head)
    first_new_id: int  # id of the first new row in the extended vocabulary
    n_new: int  # how many rows train (the rest of the model is frozen)


@dataclass(frozen=True)
class SftStart:
    """Where SFT starts from."""

    model_dir: str  # a standard HF folder (safetensors) whose vocabulary already holds the new tokens


@dataclass(frozen=True)
class RlStart:
    """Where RL starts from, and the catalog its rollouts decode into."""

    model_dir: str  # the SFT model (a standard HF folder): the policy's start and the KL reference
    sids_path: str  # safetensors: "sid_token_ids" int64 [N_items, levels], the catalog's trie
    new_start: int  # [new_start, new_end): the token ids the trie holds
    new_end: int
    levels: int  # tokens per SID


@dataclass(frozen=True)
class ValSet:
    """The constrained-decoding validation a task's hook runs every `val_every` steps."""

    path: str  # parquet: `prompt` list<int> and, grounding, `target` list<int>[levels] (the SID token
    #            ids) or, SFT, `target_row` int (the row of the target item in `sids_path`)
    sids_path: str  # safetensors: "sid_token_ids" int64 [N_items, levels], the catalog's trie
    new_start: int  # [new_start, new_end): the token ids the trie holds
    new_end: int
    levels: int  # tokens per SID
    k: int = 1  # SFT only: items kept per user (Recall@k); grounding decodes greedily (k = beams = 1)
    beam_width: int = 1  # SFT only: beams of the constrained beam search
    batch_users: int = 16  # prompts decoded per forward pass
    mrr: bool = False  # SFT only: also `val_mrr`, the exact rank of the target over the whole catalog


@dataclass(frozen=True)
class FaultInjection:
    """Tests only: worker rank `fail_rank` kills its own process once at step `fail_at_step`."""

    fail_at_step: int
    fail_marker: str  # created just before dying; while it exists no worker fails again
    fail_rank: int = 0
    fail_wait_s: float = 120.0  # wait up to this long for the last checkpoint to be registered


@dataclass(frozen=True)
class WorkerConfig:
    """What `gti.train.loop.train_loop_per_worker` runs. Everything in it must pickle."""

    task: str  # "ground" | "sft" | "rl": names the run in errors; `run_config[task]` is its TrainConfig
    hooks: "TaskHooks"  # the task's hooks (`gti.train.task.hooks_for(task)`); their functions pickle by reference
    run_config: dict[str, Any]  # RunConfig.model_dump(mode="json"), validated again in each worker
    pad_id: int  # right-pads every batch ([B, T] input_ids / labels / attention_mask) and val prompts
    ground: GroundRows | None = None  # task "ground" only
    sft: SftStart | None = None  # task "sft" only
    rl: RlStart | None = None  # task "rl" only
    val: ValSet | None = None  # None: no validation
    fault: FaultInjection | None = None
    progress_file: str | None = None  # set by driver.run_trainer: rank 0 appends a JSON line per step
    fit_id: str | None = None  # set by loop.fit, one per call (gti.train.nonfinite's stop marker)

    @classmethod
    def build(cls, task: str, run_cfg, pad_id: int, *, ground: GroundRows | None = None,
              sft: SftStart | None = None, rl: RlStart | None = None, val: ValSet | None = None,
              fault: FaultInjection | None = None) -> "WorkerConfig":
        """The worker config of `task` on `run_cfg` (a RunConfig; its `task` section is the
        TrainConfig), with the task's hooks; ValueError when the task's input is missing."""
        from gti.train.task import hooks_for

        hooks = hooks_for(task)  # the task module registers them; this module imports none
        given = {"ground": ground, "sft": sft, "rl": rl}
        if any((name == task) != (inp is not None) for name, inp in given.items()):
            raise ValueError(f"training task '{task}' takes its own input only (ground= for ground, sft= for sft, "
                             "rl= for rl)")
        return cls(task=task, hooks=hooks, run_config=run_cfg.model_dump(mode="json"), pad_id=int(pad_id),
                   ground=ground, sft=sft, rl=rl, val=val, fault=fault)


def from_loop_dict(config: "WorkerConfig | dict[str, Any]") -> WorkerConfig:
    """The WorkerConfig again, in the worker (a WorkerConfig passes through)."""
    return config if isinstance(config, WorkerConfig) else WorkerConfig(**config)
