"""One GRPO step (gti/rl/step.py): settings checks, phase time shares, the step's statistics,
and real learning on a tiny model: a few optimizer steps raise the probability of the rewarded
item, in sampling mode with hit + prefix rewards and in beam mode with the rank reward; groups
without the target give no signal. Several updates per rollout batch: one update per rollout
never clips (ratio exactly 1), several move the ratio off 1 so the clip binds, and the old
log-probs are the policy's before the first update, detached (constants in the gradient)."""

from __future__ import annotations

import copy
import dataclasses
import time

import pytest
import torch
from gti.eval.decode import score_all_sids
from gti.rl.grpo import grpo_loss, labelled_logprobs
from gti.rl.step import PHASES, GrpoSettings, PhaseClock, grpo_rollout, grpo_update_loss


def grpo_step_loss(policy, reference, prompt_ids, target_sids, trie, settings, *, clock=None, **kw):
    """One rollout and its first (on-policy) update, as `gti.train.rl_task` runs a cycle's first step."""
    clock = clock or PhaseClock()
    batch = grpo_rollout(policy, reference, prompt_ids, target_sids, trie, settings, clock=clock, **kw)
    return grpo_update_loss(policy, batch, settings, clock=clock)


def test_settings_are_checked():
    assert GrpoSettings().rollout == "beam"
    with pytest.raises(ValueError, match="unknown rollout mode 'greedy'"):
        GrpoSettings(rollout="greedy")
    with pytest.raises(ValueError, match="unknown reward 'ndcg'"):
        GrpoSettings(reward={"hit": 1.0, "ndcg": 1.0})
    with pytest.raises(ValueError, match="group_size"):
        GrpoSettings(group_size=0)
    with pytest.raises(ValueError, match="temperature"):
        GrpoSettings(temperature=0.0)
    with pytest.raises(ValueError, match=">= 0"):
        GrpoSettings(kl_coef=-1.0)
    assert GrpoSettings().updates_per_rollout == 1  # today's on-policy behaviour by default
    with pytest.raises(ValueError, match="updates_per_rollout must be >= 1"):
        GrpoSettings(updates_per_rollout=0)


def test_phase_clock_shares():
    clock = PhaseClock()
    assert clock.shares() == {f"time_share/{p}": 0.0 for p in PHASES}
    with clock.phase("rollout"):
        time.sleep(0.02)
    with clock.phase("update"):
        time.sleep(0.01)
    with clock.phase("update"):
        time.sleep(0.01)
    shares = clock.shares()
    assert set(shares) == {f"time_share/{p}": 0 for p in PHASES}.keys()
    assert sum(shares.values()) == pytest.approx(1.0) and shares["time_share/reward"] == 0.0
    assert shares["time_share/rollout"] > 0 and shares["time_share/update"] > 0
    assert clock.seconds["update"] >= 0.02 and clock.seconds["rollout"] >= 0.02


class _Problem:
    """12-item catalog, two prompts, the same target item for both, a near-uniform policy and
    its frozen copy as the reference."""

    def __init__(self, rl, target_rank: int):
        self.rl = rl
        self.sids = rl.random_sids(12, seed=7)
        self.trie = rl.trie(self.sids)
        self.prompts = rl.prompts(2, seed=4)
        self.policy = rl.tiny_llama(seed=6, head_std=None)
        self.reference = copy.deepcopy(self.policy).eval()
        first = score_all_sids(self.policy, self.prompts[0], self.sids)
        self.target = int(first.argsort(descending=True)[target_rank - 1])
        self.policy.train()

    def ranks_and_probs(self) -> list[tuple[int, float]]:
        """Per prompt (rank of the target among the catalog, its softmax share of the scores)."""
        out = []
        for p in self.prompts:
            s = score_all_sids(self.policy, p, self.sids)
            out.append((int((s > s[self.target]).sum()) + 1, float(s.softmax(0)[self.target])))
        return out

    def train(self, settings: GrpoSettings, steps: int, lr: float = 1e-2) -> list[dict]:
        opt = torch.optim.Adam(self.policy.parameters(), lr=lr)
        clock, history = PhaseClock(), []
        targets = [self.sids[self.target].tolist()] * 2
        for step in range(steps):
            out = grpo_step_loss(self.policy, self.reference, self.prompts, targets, self.trie, settings,
                                 levels=self.rl.LEVELS, pad_id=0, seed=step, clock=clock)
            with clock.phase("update"):
                opt.zero_grad()
                out.loss.backward()
                opt.step()
            history.append(out.stats)
        history.append(clock.shares())
        return history


def test_step_output(rl):
    prob = _Problem(rl, target_rank=1)
    s = GrpoSettings(group_size=4, rollout="sample", reward={"hit": 1.0, "prefix": 0.5}, kl_coef=0.1)
    out = grpo_step_loss(prob.policy, prob.reference, prob.prompts, [prob.sids[prob.target].tolist()] * 2,
                         prob.trie, s, levels=rl.LEVELS, pad_id=0, seed=0)
    assert out.rewards.shape == out.advantages.shape == (2, 4) and out.rollouts.mode == "sample"
    assert {"reward_mean", "reward_std", "zero_std_share", "pg_loss", "kl", "clip_fraction", "ratio_mean",
            "tokens", "rollout_s"} <= set(out.stats)
    assert out.stats["tokens"] == 2 * 4 * rl.LEVELS and out.stats["kl"] == 0.0  # policy == reference
    assert out.loss.requires_grad
    with pytest.raises(ValueError, match="reference"):
        grpo_step_loss(prob.policy, None, prob.prompts, [[0, 0, 0]] * 2, prob.trie, s, levels=rl.LEVELS, pad_id=0)
    with pytest.raises(ValueError, match="targets"):
        grpo_step_loss(prob.policy, prob.reference, prob.prompts, [[0, 0, 0]], prob.trie, s, levels=rl.LEVELS,
                       pad_id=0)


def test_sampling_with_hit_and_prefix_rewards_learns_the_item(rl):
    prob = _Problem(rl, target_rank=10)
    before = prob.ranks_and_probs()
    assert all(r > 4 and p < 0.1 for r, p in before), before
    s = GrpoSettings(group_size=8, rollout="sample", reward={"hit": 1.0, "prefix": 0.5}, kl_coef=0.01)
    history = prob.train(s, steps=12)
    after = prob.ranks_and_probs()
    assert all(r == 1 and p > 0.5 for r, p in after), (before, after)
    assert history[-1]["time_share/rollout"] > 0 and history[-1]["time_share/update"] > 0
    assert history[-2]["reward_mean"] > history[0]["reward_mean"]


def test_beam_rollouts_with_the_rank_reward_learn_the_item(rl):
    """The target ranks 4th of 12, G = 4 (width 12: the exact top 4): in the group, below three
    wrong items, which the rank reward pushes down."""
    prob = _Problem(rl, target_rank=4)
    before = prob.ranks_and_probs()
    s = GrpoSettings(group_size=4, rollout="beam", beam_width=12, reward="rank", kl_coef=0.01)
    history = prob.train(s, steps=10)
    after = prob.ranks_and_probs()
    assert history[0]["reward_mean"] > 0 and history[0]["zero_std_share"] < 1.0
    assert all(r == 1 and p > 0.9 for r, p in after), (before, after)


@pytest.mark.parametrize("reward", ["hit", "rank"])
def test_groups_without_the_target_give_no_signal(rl, reward):
    """The target ranks 10th of 12 and G = 4: no group holds it, so every group is zero-std,
    the advantages and the gradient are zero and the policy does not move."""
    prob = _Problem(rl, target_rank=10)
    before = prob.ranks_and_probs()
    s = GrpoSettings(group_size=4, rollout="beam", beam_width=12, reward=reward, kl_coef=0.01)
    history = prob.train(s, steps=2)
    assert [h["zero_std_share"] for h in history[:2]] == [1.0, 1.0] and history[0]["reward_mean"] == 0.0
    assert prob.ranks_and_probs() == before, "zero gradients: the policy did not move"


# --------------------------------------------------------------------------- updates per rollout
_CLIP = GrpoSettings(group_size=8, rollout="sample", reward={"hit": 1.0, "prefix": 0.5}, kl_coef=0.0, clip_eps=0.1)


def _updates(prob: _Problem, settings: GrpoSettings, rollouts: int, lr: float = 1e-2) -> list[list[dict]]:
    """`rollouts` rollout batches, each serving settings.updates_per_rollout Adam steps: the
    stats of every update, grouped per rollout."""
    opt = torch.optim.Adam(prob.policy.parameters(), lr=lr)
    targets = [prob.sids[prob.target].tolist()] * len(prob.prompts)
    out = []
    for r in range(rollouts):
        batch = grpo_rollout(prob.policy, prob.reference, prob.prompts, targets, prob.trie, settings,
                             levels=prob.rl.LEVELS, pad_id=0, seed=r)
        assert batch.stats["zero_std_share"] < 1.0  # some group's rewards spread: a gradient to follow
        stats = []
        for _ in range(settings.updates_per_rollout):
            step = grpo_update_loss(prob.policy, batch, settings)
            opt.zero_grad()
            step.loss.backward()
            opt.step()
            stats.append(step.stats)
        assert batch.updates == settings.updates_per_rollout
        out.append(stats)
    return out


def test_one_update_per_rollout_never_clips(rl):
    """The default: every update is on policy, so the ratio is exactly 1 and nothing is clipped,
    however far the policy moves between rollouts."""
    prob = _Problem(rl, target_rank=3)
    per_rollout = _updates(prob, _CLIP, rollouts=4)
    assert all(len(u) == 1 for u in per_rollout)
    assert [u[0]["ratio_mean"] for u in per_rollout] == [1.0] * 4
    assert [u[0]["clip_fraction"] for u in per_rollout] == [0.0] * 4
    assert prob.ranks_and_probs() != _Problem(rl, target_rank=3).ranks_and_probs()  # it did train


def test_several_updates_per_rollout_make_the_clip_bind(rl):
    """updates_per_rollout 4: each batch's first update is on policy (ratio exactly 1), the later
    ones see the ratio to the policy that rolled out move, and the clip at 1 +- 0.1 binds."""
    prob = _Problem(rl, target_rank=3)
    per_rollout = _updates(prob, dataclasses.replace(_CLIP, updates_per_rollout=4), rollouts=2)
    for updates in per_rollout:
        assert updates[0]["ratio_mean"] == 1.0 and updates[0]["clip_fraction"] == 0.0
        assert all(u["ratio_mean"] != 1.0 for u in updates[1:])
    later = [u["clip_fraction"] for updates in per_rollout for u in updates[1:]]
    assert max(later) > 0.05, later
    assert all(0.0 <= c <= 1.0 for c in later)


def test_old_logprobs_are_the_policy_before_the_first_update_and_detached(rl):
    """After the first update, batch.old_logp holds the log-probs of the policy as it was before
    that update, with no graph; the second update's gradient equals that of the clipped loss
    with those log-probs as constants, from a separate no_grad forward of the saved policy."""
    prob = _Problem(rl, target_rank=3)
    s = dataclasses.replace(_CLIP, updates_per_rollout=2)
    targets = [prob.sids[prob.target].tolist()] * 2
    batch = grpo_rollout(prob.policy, prob.reference, prob.prompts, targets, prob.trie, s,
                         levels=rl.LEVELS, pad_id=0, seed=0)
    assert batch.old_logp is None and batch.updates == 0
    before = copy.deepcopy(prob.policy)
    opt = torch.optim.SGD(prob.policy.parameters(), lr=1.0)
    first = grpo_update_loss(prob.policy, batch, s)
    opt.zero_grad()
    first.loss.backward()
    opt.step()
    with torch.no_grad():
        want_old, mask = labelled_logprobs(before, *batch.args)
    assert batch.old_logp is not None and not batch.old_logp.requires_grad and batch.old_logp.grad_fn is None
    torch.testing.assert_close(batch.old_logp, want_old, rtol=0, atol=1e-6)

    params = [p for p in prob.policy.parameters() if p.requires_grad]
    second = grpo_update_loss(prob.policy, batch, s)
    got = torch.autograd.grad(second.loss, params, allow_unused=True)
    logp, _ = labelled_logprobs(prob.policy, *batch.args)
    manual = grpo_loss(logp, mask, batch.advantages.reshape(-1), old_logp=want_old, clip_eps=s.clip_eps)
    want = torch.autograd.grad(manual.loss, params, allow_unused=True)
    assert second.stats["clip_fraction"] == pytest.approx(manual.stats["clip_fraction"])
    assert second.stats["ratio_mean"] != 1.0
    for g, w in zip(got, want):
        if w is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
