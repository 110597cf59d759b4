"""GRPO's rollout and update losses, composed from the rollout, reward and objective blocks, with
the share of step time each phase took.

What it is for: what an RL training step does before its backward pass, in calls a loop hook
(or a test) can run. `grpo_rollout` rolls out G candidates per prompt (`gti.rl.rollouts`),
rewards them (`gti.rl.rewards`), normalises the advantages per group and scores the completions
under the frozen reference, once, into a `RolloutBatch`; `grpo_update_loss` returns the clipped
GRPO loss (`gti.rl.grpo`) of one update on it. `GrpoSettings` holds the `rl` section's knobs;
`PhaseClock` times the phases and reports each one's share of the step.

What it does not know: optimizers, DeepSpeed, data loading, checkpoints, the config file, which
optimizer step reuses which rollout (`gti.train.rl_task` decides), or Ray.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from gti.eval.beams import TrieLike, model_device
from gti.rl.grpo import group_advantages, grpo_loss, labelled_logprobs, reward_stats
from gti.rl.rewards import group_rewards, parse_reward_spec
from gti.rl.rollouts import MODES, Rollouts, completion_batch, rollout
from gti.train.loss import is_engine, run_as_engine_forward

PHASES = ("rollout", "reward", "update")


@dataclass(frozen=True)
class GrpoSettings:
    """The RL knobs (what `gti.train.rl_task.grpo_settings` takes from the `rl` config section).

    group_size: G candidates per prompt. rollout: "beam" (G best distinct items, width
    max(beam_width, G)) or "sample" (temperature sampling under the trie). reward: a reward
    name or weights ({"hit": 1.0, "prefix": 0.5}, see `gti.rl.rewards`). clip_eps: ratio clip.
    kl_coef: weight of the k3 KL to the reference (0 = no reference needed). adv_eps: added to
    the group std. batch_users: prompts per rollout forward batch. updates_per_rollout: policy
    updates (optimizer steps) per rollout batch; 1 is on-policy REINFORCE with group baselines
    (ratio == 1, the clip never binds), > 1 makes the clipped ratio the objective that trains.
    """

    group_size: int = 8
    rollout: str = "beam"
    beam_width: int | None = None
    temperature: float = 1.0
    reward: str | Mapping[str, float] = "hit"
    clip_eps: float = 0.2
    kl_coef: float = 0.04
    adv_eps: float = 1e-6
    batch_users: int = 8
    updates_per_rollout: int = 1

    def __post_init__(self) -> None:
        if self.updates_per_rollout < 1:
            raise ValueError(f"updates_per_rollout must be >= 1, got {self.updates_per_rollout}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.rollout not in MODES:
            raise ValueError(f"unknown rollout mode {self.rollout!r}; expected one of {list(MODES)}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.clip_eps < 0 or self.kl_coef < 0 or self.adv_eps < 0:
            raise ValueError("clip_eps, kl_coef and adv_eps must be >= 0")
        parse_reward_spec(self.reward)


class PhaseClock:
    """Wall seconds per named phase, summed over `with clock.phase(name):` blocks: rollout /
    reward / update, the caller adding its backward and optimizer step to "update"."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def shares(self) -> dict[str, float]:
        """{"time_share/<phase>": its share of the summed seconds} for every phase timed (and
        0.0 for the PHASES not timed); all 0.0 before anything was timed."""
        total = sum(self.seconds.values())
        names = list(PHASES) + [n for n in self.seconds if n not in PHASES]
        return {f"time_share/{n}": (self.seconds.get(n, 0.0) / total if total > 0 else 0.0) for n in names}


@dataclass
class StepOutput:
    """loss: the scalar to backpropagate. stats: floats to log (reward_mean, reward_std,
    zero_std_share, pg_loss, kl, clip_fraction, ratio_mean, tokens, rollout_s).
    rollouts: the candidates. rewards / advantages: FloatTensor [B, G]."""

    loss: torch.Tensor
    stats: dict[str, float]
    rollouts: Rollouts
    rewards: torch.Tensor
    advantages: torch.Tensor


@dataclass
class RolloutBatch:
    """What one rollout leaves for the updates that reuse it (R = B * G completion rows,
    prompt-major; T the padded completion length).

    args: (input_ids, attention_mask, labels) [R, T] on the policy's device (labels only on the
    SID tokens); rollouts: the candidates; rewards / advantages: FloatTensor [B, G]; ref_logp:
    [R, T-1] under the frozen reference (None without a KL term); old_logp: [R, T-1] under the
    policy before the first update of this batch, detached, set by that update (None before);
    updates: the updates run on it; stats: the rewards' summary and the rollout's seconds."""

    args: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    rollouts: Rollouts
    rewards: torch.Tensor
    advantages: torch.Tensor
    ref_logp: torch.Tensor | None
    stats: dict[str, float]
    old_logp: torch.Tensor | None = None
    updates: int = 0


def grpo_rollout(
    policy: Any,
    reference: Any | None,
    prompt_ids: Sequence[Sequence[int]],
    target_sids: Sequence[Sequence[int]],
    trie: TrieLike,
    settings: GrpoSettings,
    *,
    levels: int,
    pad_id: int,
    seed: int | None = None,
    clock: PhaseClock | None = None,
) -> RolloutBatch:
    """Rollouts -> rewards -> advantages -> reference log-probs for B prompts (no policy
    gradient here: `grpo_update_loss` runs the updates on the result).

    policy: the causal LM being trained, or a DeepSpeed engine around it (rollouts run in eval
    mode on the bare model); reference: the frozen start model (None allowed when
    settings.kl_coef == 0); prompt_ids: B token-id lists; target_sids: B SID token-id tuples (L
    each, the trie's row of the target item); seed: for sampling rollouts; clock: times the
    phases "rollout", "reward" and "update" (the reference's scoring forward).
    """
    if len(prompt_ids) != len(target_sids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(target_sids)} targets")
    if reference is None and settings.kl_coef != 0:
        raise ValueError("kl_coef != 0 needs a reference model")
    clock = clock or PhaseClock()
    s = settings
    module = policy.module if is_engine(policy) else policy  # rollouts decode with the bare model
    with clock.phase("rollout"):
        ro = rollout(module, prompt_ids, trie, mode=s.rollout, group_size=s.group_size, levels=levels,
                     pad_id=pad_id, beam_width=s.beam_width, temperature=s.temperature,
                     batch_users=s.batch_users, seed=seed)
    with clock.phase("reward"):
        rewards = group_rewards(ro.candidates(), target_sids, s.reward)  # [B, G]
        adv, _ = group_advantages(rewards, eps=s.adv_eps)
    with clock.phase("update"):
        batch = {k: v.to(model_device(module)) for k, v in completion_batch(prompt_ids, ro, pad_id).items()}
        args = (batch["input_ids"], batch["attention_mask"], batch["labels"])
        ref_logp = None
        if reference is not None and s.kl_coef != 0:
            # The reference is frozen: its log-probs serve every update of this batch.
            with torch.no_grad():
                ref_logp, _ = labelled_logprobs(reference, *args)
    stats = {**reward_stats(rewards), "rollout_s": ro.timings.get("rollout_s", 0.0)}
    return RolloutBatch(args=args, rollouts=ro, rewards=rewards, advantages=adv, ref_logp=ref_logp, stats=stats)


def grpo_update_loss(policy: Any, batch: RolloutBatch, settings: GrpoSettings, *,
                     clock: PhaseClock | None = None) -> StepOutput:
    """The clipped GRPO loss of one policy update on `batch` (no backward here); call it
    `settings.updates_per_rollout` times per rollout, one optimizer step after each.

    The first update of a batch is on policy: old log-probs = its own log-probs detached (ratio
    exactly 1), and those detached log-probs are kept in `batch.old_logp`, so every later update
    of the batch measures its ratio against the policy as it was before the first update (what
    the clip bounds). Reusing the first update's forward saves a forward per rollout and gives
    what a separate no_grad forward of the same policy would (dropout aside). policy: the model being trained or its
    DeepSpeed engine (its train/eval mode is kept for this scoring forward); clock: times
    "update".
    """
    clock = clock or PhaseClock()
    s = settings
    got: dict[str, Any] = {}

    def objective(model) -> torch.Tensor:
        logp, mask = labelled_logprobs(model, *batch.args)
        got["logp"] = logp.detach()
        got["obj"] = grpo_loss(logp, mask, batch.advantages.reshape(-1), old_logp=batch.old_logp,
                               ref_logp=batch.ref_logp, clip_eps=s.clip_eps, kl_coef=s.kl_coef)
        return got["obj"].loss

    with clock.phase("update"):
        # An engine runs the objective as its module's forward (labelled positions only, and
        # DeepSpeed's forward bookkeeping in place); a plain model is called directly.
        loss = run_as_engine_forward(policy, objective) if is_engine(policy) else objective(policy)
    if batch.old_logp is None:
        batch.old_logp = got["logp"]
    batch.updates += 1
    return StepOutput(loss=loss, stats={**batch.stats, **got["obj"].stats}, rollouts=batch.rollouts,
                      rewards=batch.rewards, advantages=batch.advantages)
