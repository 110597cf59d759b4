"""The RL task (GRPO after SFT): its rows, model, step loss and validation, as loop hooks.

What it is for: `HOOKS` for `gti.train.loop` (task "rl"). The model is the SFT export with every
parameter trainable; `rl_step_loss` replaces the teacher-forced loss: it rolls out
`rl.group_size` candidate SIDs per prompt under the trie, rewards them against each prompt's
target and returns the clipped GRPO loss with a KL penalty to the frozen SFT model
(`gti.rl.step`). Validation is SFT's (its exact MRR, `keep_best`, keeps the best checkpoint and
stops a run that falls below the SFT model). `rl_row` / `split_batch` carry a prompt and its
target SID in the loop's row shape.

What it does not know: where prompts come from (the caller keeps valid/test targets out), how
the loop steps or checkpoints, Ray, or where the model is exported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gti import config as C
from gti.common.errors import DataError
from gti.train.loss import IGNORE_INDEX
from gti.train.sft_task import load_causal_lm, sft_trainable_state, validate_sft
from gti.train.task import TaskHooks, load_trie, register

if TYPE_CHECKING:
    from gti.rl.step import GrpoSettings
    from gti.train.worker_config import WorkerConfig

BEST_METRIC = "val_mrr"
# Per micro-step: the rewards' summary, the objective's terms, and the seconds of the rollout and
# reward phases (what a step's compute time holds besides the update: gti.train.rl_run.time_shares).
# The reward figures of a step that reuses a rollout are that rollout's; its rollout_s and
# reward_s are 0 (nothing was rolled out), so their sums stay the time actually spent.
STAT_KEYS = ("reward_mean", "reward_std", "zero_std_share", "kl", "clip_fraction", "ratio_mean", "pg_loss",
             "rollout_s", "reward_s")


def rl_row(prompt: list[int], target_sid: list[int]) -> dict[str, list[int]]:
    """One training row: input_ids = the prompt [P]; labels [P] = -100 but the last L positions,
    which hold the target's SID tokens (L = len(target_sid) <= P), so the loop's padding and
    sharding carry it unchanged. Nothing is trained on these labels: `split_batch` reads the
    target back from them."""
    n, levels = len(prompt), len(target_sid)
    if levels < 1 or n < levels:
        raise DataError(f"an RL prompt of {n} tokens cannot carry a target SID of {levels} tokens")
    return {"input_ids": list(prompt), "labels": [IGNORE_INDEX] * (n - levels) + list(target_sid)}


def split_batch(batch: dict[str, torch.Tensor], levels: int) -> tuple[list[list[int]], list[tuple[int, ...]]]:
    """A padded batch of `rl_row`s (input_ids / labels / attention_mask [B, T]) -> (B prompts,
    B target SID tuples of `levels` tokens)."""
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    ids, labels = batch["input_ids"].tolist(), batch["labels"].tolist()
    prompts = [row[:n] for row, n in zip(ids, lengths)]
    targets = [tuple(lab[n - levels: n]) for lab, n in zip(labels, lengths)]
    if any(IGNORE_INDEX in t for t in targets):
        raise DataError("an RL batch row has no target SID on its last positions (not made by rl_row)")
    return prompts, targets


def grpo_settings(cfg: C.RunConfig) -> "GrpoSettings":
    from gti.rl.step import GrpoSettings

    r = cfg.rl
    return GrpoSettings(group_size=r.group_size, rollout=r.rollout, beam_width=r.beam_width,
                        temperature=r.temperature, reward=r.reward, clip_eps=r.clip_eps, kl_coef=r.kl_coef,
                        batch_users=r.rollout_batch, updates_per_rollout=r.updates_per_rollout)


@dataclass
class _Context:
    """What a worker loads once per fit: the run config, the trie, the settings, the reference;
    and the current rollout cycle's batches: {micro-batch slot: (cycle, RolloutBatch)}."""

    cfg: C.RunConfig
    trie: Any
    settings: "GrpoSettings"
    reference: torch.nn.Module | None
    rollouts: dict[int, tuple[int, Any]] = field(default_factory=dict)


_CONTEXT: dict[tuple, _Context] = {}


def _context(config: "WorkerConfig", device: torch.device) -> _Context:
    key = (config.fit_id, config.rl.model_dir, str(device))
    if key not in _CONTEXT:
        _CONTEXT.clear()  # one fit per worker process at a time: drop an earlier fit's reference
        cfg = C.validate(config.run_config, "<rl worker config>")
        s = config.rl
        reference = None
        if cfg.rl.kl_coef != 0:
            reference = load_causal_lm(s.model_dir, cfg).to(device).eval().requires_grad_(False)
        _CONTEXT[key] = _Context(cfg, load_trie(s.sids_path, int(s.new_start), int(s.new_end)),
                                 grpo_settings(cfg), reference)
    return _CONTEXT[key]


def rollout_cycle(micro_step: int, grad_accum: int, updates_per_rollout: int) -> tuple[int, int, int]:
    """(cycle, update, slot) of a 0-based micro-step: optimizer step s = micro_step // grad_accum
    is update s % K of rollout cycle s // K (K = updates_per_rollout), and the micro-step fills
    slot micro_step % grad_accum of that step (the same slot reuses the same rollout)."""
    step, slot = divmod(int(micro_step), int(grad_accum))
    cycle, update = divmod(step, int(updates_per_rollout))
    return cycle, update, slot


def rl_step_loss(engine, batch: dict[str, torch.Tensor], config: "WorkerConfig", rank: int,
                 micro_step: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Loop hook: the GRPO loss of one micro-step and its statistics.

    The first update of a rollout cycle (`rollout_cycle`) rolls out this micro-batch of
    `rl_row`s; the later ones reuse the cycle's rollout of the same slot and ignore `batch`.
    micro_step: the run's 0-based micro-batch index (the same after a resume), which with the
    seed and the rank seeds sampling rollouts.

    `rl.steps` counts optimizer steps, as the loop does for every task (so do the schedule,
    checkpoint and validation cadences). With
    `rl.updates_per_rollout` K, optimizer steps cK .. cK + K - 1 form rollout cycle c: step cK
    rolls out its micro-batches (one rollout per micro-batch slot of `rl.grad_accum`) and updates
    on policy; the later steps update again on the same rollouts, with the ratio to the
    log-probs of step cK (old log-probs, detached). The loop still hands them a fresh
    micro-batch, which goes unused (the prompts are a sample of training windows). The rollouts
    live in the worker process only, so `rl.checkpoint_every` is a multiple of K (`RlConfig`)
    and a resume starts a cycle; validation between the steps of a cycle does not touch them.
    """
    from gti.rl.step import PhaseClock, grpo_rollout, grpo_update_loss

    ctx = _context(config, engine.device)
    cycle, update, slot = rollout_cycle(micro_step, ctx.cfg.rl.grad_accum, ctx.settings.updates_per_rollout)
    clock = PhaseClock()
    cached = ctx.rollouts.get(slot)
    if update == 0 or cached is None or cached[0] != cycle:
        # A new cycle; or (not reachable when checkpoints fall on cycle starts) a worker that lost
        # its rollouts mid-cycle, which starts afresh from this batch rather than fail.
        prompts, targets = split_batch(batch, int(config.rl.levels))
        seed = int(ctx.cfg.seed) * 1_000_003 + int(micro_step) * 7919 + int(rank)
        rb = grpo_rollout(engine, ctx.reference, prompts, targets, ctx.trie, ctx.settings,
                          levels=int(config.rl.levels), pad_id=int(config.pad_id), seed=seed, clock=clock)
        ctx.rollouts[slot] = (cycle, rb)
    else:
        rb = cached[1]
    out = grpo_update_loss(engine, rb, ctx.settings, clock=clock)
    stats = {**out.stats, "rollout_s": clock.seconds.get("rollout", 0.0), "reward_s": clock.seconds.get("reward", 0.0)}
    return out.loss, {k: float(stats[k]) for k in STAT_KEYS}


def build_rl_model(config: "WorkerConfig", cfg: C.RunConfig) -> torch.nn.Module:
    """Loop hook: the SFT model of `config.rl.model_dir`, every parameter trainable."""
    model = load_causal_lm(config.rl.model_dir, cfg)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def rebuild_trained(model_dir, cfg: C.RunConfig, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The SFT model with the RL-trained tensors loaded: a plain HF model, on CPU."""
    model = load_causal_lm(model_dir, cfg)
    own = dict(model.named_parameters())
    if set(state) != set(own):
        odd = sorted(set(state) ^ set(own))
        raise DataError(f"rl checkpoint and model disagree on their tensors: {odd[:3]}")
    with torch.no_grad():
        for n, t in state.items():
            own[n].copy_(t.to(own[n].dtype))
    return model


HOOKS = register("rl", TaskHooks(
    build_model=build_rl_model,
    trainable_state=sft_trainable_state,
    validate=validate_sft,
    grad_norm_key="grad_norm",
    step_loss=rl_step_loss,
    keep_best=BEST_METRIC,
))
