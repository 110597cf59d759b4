"""One GRPO step (gti/rl/step.py): settings checks, phase time shares, the step's statistics,
and real learning on a tiny model: a few optimizer steps raise the probability of the rewarded
item, in sampling mode with hit + prefix rewards and in beam mode with the rank reward; groups
without the target give no signal."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from gti.eval.decode import score_all_sids
from gti.rl.step import PHASES, GrpoSettings, PhaseClock, grpo_step_loss


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
