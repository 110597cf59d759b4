"""The GRPO objective (gti/rl/grpo.py): group advantages, reward statistics, log-probs at the
labelled (SID) positions, and exact checks of the clipped loss and its KL term."""

from __future__ import annotations

import copy

import pytest
import torch
from gti.rl.grpo import (
    group_advantages,
    grpo_loss,
    k3_kl,
    labelled_logprobs,
    reward_stats,
    sequence_logprobs,
)
from gti.train.loss import IGNORE_INDEX, labelled_loss


# --------------------------------------------------------------------------- advantages
def test_advantages_zero_mean_unit_std_and_zero_for_constant_groups():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5], [0.2, -1.0, 3.0, 0.7], [0.0, 0.0, 0.0, 0.0]])
    adv, zero = group_advantages(r)
    assert adv.shape == (4, 4) and zero.tolist() == [False, True, False, True]
    torch.testing.assert_close(adv.mean(dim=1), torch.zeros(4), atol=1e-6, rtol=0)
    assert (adv[1] == 0).all() and (adv[3] == 0).all()
    torch.testing.assert_close(adv[[0, 2]].std(dim=1, unbiased=False), torch.ones(2), atol=1e-4, rtol=0)
    # Hand value: rewards (1,0,0,0): mean 1/4, population std sqrt(3)/4.
    torch.testing.assert_close(adv[0, 0], torch.tensor(0.75 / (3 ** 0.5 / 4)), atol=1e-4, rtol=0)
    assert adv[0, 0] > 0 > adv[0, 1]


def test_advantages_single_candidate_and_shape_error():
    adv, zero = group_advantages(torch.tensor([[3.0], [1.0]]))
    assert (adv == 0).all() and zero.all()
    with pytest.raises(ValueError, match=r"\[B, G\]"):
        group_advantages(torch.zeros(4))


def test_reward_stats():
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    s = reward_stats(r)
    assert s == pytest.approx({"reward_mean": 0.25, "reward_std": 0.25, "zero_std_share": 0.5})
    with pytest.raises(ValueError):
        reward_stats(torch.zeros(0, 3))


# --------------------------------------------------------------------------- log-probs
def _batch(rl, n_rows: int = 4, seed: int = 0):
    """Right-padded rows prompt + 3 SID tokens, labels on the SID tokens only."""
    g = torch.Generator().manual_seed(seed)
    sids = rl.random_sids(n_rows, seed=seed)
    prompts = rl.prompts(n_rows, seed=seed + 1)
    width = max(len(p) for p in prompts) + rl.LEVELS
    ids = torch.zeros(n_rows, width, dtype=torch.long)
    labels = torch.full((n_rows, width), IGNORE_INDEX)
    mask = torch.zeros(n_rows, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        row = p + sids[i].tolist()
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, len(p): len(row)] = sids[i]
        mask[i, : len(row)] = 1
    ids[mask == 0] = torch.randint(3, 60, (int((mask == 0).sum()),), generator=g)  # pad content is masked
    return ids, mask, labels


class _NoHead(torch.nn.Module):
    """Wraps a causal LM so `supports_labelled_loss` is False (no output embeddings): the
    full-logits fallback runs."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask=None):
        return self.lm(input_ids=input_ids, attention_mask=attention_mask)


def test_labelled_logprobs_match_full_logits_and_the_sft_loss(rl):
    model = rl.tiny_llama()
    ids, mask, labels = _batch(rl)
    logp, keep = labelled_logprobs(model, ids, mask, labels)
    assert logp.shape == keep.shape == (4, ids.shape[1] - 1) and logp.dtype == torch.float32
    assert int(keep.sum()) == 4 * rl.LEVELS and (logp[~keep] == 0).all()
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    ref = full[:, :-1].gather(-1, labels[:, 1:].clamp_min(0).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp[keep], ref[keep], atol=1e-5, rtol=0)
    fallback, keep2 = labelled_logprobs(_NoHead(model), ids, mask, labels)
    assert torch.equal(keep, keep2)
    torch.testing.assert_close(fallback, logp, atol=1e-5, rtol=0)
    # The SFT loss is the negative mean of the same log-probs.
    torch.testing.assert_close(-logp[keep].mean(), labelled_loss(model, ids, mask, labels), atol=1e-5, rtol=0)
    torch.testing.assert_close(sequence_logprobs(logp, keep), (logp * keep).sum(1))
    with pytest.raises(ValueError, match="shape"):
        labelled_logprobs(model, ids, mask, labels[:, 1:])


# --------------------------------------------------------------------------- objective
def test_on_policy_loss_is_minus_mean_advantage_and_gradient_is_reinforce(rl):
    model = rl.tiny_llama(seed=1)
    ids, mask, labels = _batch(rl)
    adv = torch.tensor([1.5, -0.5, 0.25, -1.25])
    logp, keep = labelled_logprobs(model, ids, mask, labels)
    with torch.no_grad():
        ref, _ = labelled_logprobs(model, ids, mask, labels)
    out = grpo_loss(logp, keep, adv, ref_logp=ref, kl_coef=10.0, clip_eps=0.2)
    # Ratio 1 and policy == reference: the KL term is exactly 0 and the loss is -mean(A) over
    # SID tokens (every row has L = 3 of them, so it is also -mean over rows).
    assert out.stats["kl"] == 0.0 and out.stats["ratio_mean"] == 1.0 and out.stats["clip_fraction"] == 0.0
    assert out.stats["tokens"] == 12.0
    assert out.loss.item() == pytest.approx(-float(adv.mean()), abs=1e-7)
    out.loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logp2, _ = labelled_logprobs(model, ids, mask, labels)
    (-(adv.unsqueeze(1) * logp2 * keep).sum() / keep.sum()).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=1e-6, rtol=1e-5, msg=n)


def test_clipping_by_hand():
    # One row of 4 tokens; ratios 0.5, 1.0, 1.5, 1.1 against old log-probs; eps 0.2.
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[0.5, 1.0, 1.5, 1.1]])).requires_grad_(True)
    mask = torch.ones(1, 4, dtype=torch.bool)
    pos = grpo_loss(logp, mask, torch.tensor([2.0]), old_logp=old, clip_eps=0.2)
    # A > 0: min(r A, clip(r) A) = A * [0.5, 1.0, 1.2, 1.1]; only the 1.5 ratio is clipped.
    assert pos.loss.item() == pytest.approx(-2.0 * (0.5 + 1.0 + 1.2 + 1.1) / 4, abs=1e-6)
    assert pos.stats["clip_fraction"] == 0.25 and pos.stats["ratio_mean"] == pytest.approx(1.025)
    pos.loss.backward()
    assert logp.grad[0, 2] == 0.0 and logp.grad[0, 0] != 0.0  # a clipped token gets no gradient
    neg = grpo_loss(logp, mask, torch.tensor([-1.0]), old_logp=old, clip_eps=0.2)
    # A < 0: min picks max(r, clip(r)) * A: [0.8, 1.0, 1.5, 1.1]; only the 0.5 ratio is clipped.
    assert neg.loss.item() == pytest.approx((0.8 + 1.0 + 1.5 + 1.1) / 4, abs=1e-6)
    assert neg.stats["clip_fraction"] == 0.25


def test_masked_tokens_do_not_count():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    mask = torch.tensor([[True, False, True], [False, False, False]])
    ref = torch.tensor([[-1.5, 5.0, -3.0], [9.0, 9.0, 9.0]])
    out = grpo_loss(logp, mask, torch.tensor([1.0, 7.0]), ref_logp=ref, kl_coef=1.0)
    kl = k3_kl(torch.tensor(-1.0), torch.tensor(-1.5))
    assert out.stats["tokens"] == 2.0
    assert out.loss.item() == pytest.approx(-1.0 + float(kl) / 2, abs=1e-6)
    empty = grpo_loss(logp, torch.zeros_like(mask), torch.tensor([1.0, 1.0]))
    assert empty.loss.item() == 0.0 and empty.loss.requires_grad


def test_k3():
    a = torch.tensor([-1.0, -2.0, -0.1], requires_grad=True)
    b = torch.tensor([-1.0, -0.5, -3.0])
    kl = k3_kl(a, b)
    assert kl[0] == 0 and (kl[1:] > 0).all()
    kl.sum().backward()
    assert a.grad[0] == 0.0


def test_argument_errors():
    x, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(x, m, torch.zeros(2), kl_coef=0.1)
    with pytest.raises(ValueError, match="do not fit"):
        grpo_loss(x, m, torch.zeros(3))
    with pytest.raises(ValueError, match="clip_eps"):
        grpo_loss(x, m, torch.zeros(2), clip_eps=-0.1)
    grpo_loss(x, m, torch.zeros(2, 3))  # per-token advantages


def test_kl_term_pulls_the_policy_back_to_the_reference(rl):
    """Zero advantages and kl_coef 1: only the KL acts, and a few steps shrink it."""
    ref_model = rl.tiny_llama(seed=2)
    policy = copy.deepcopy(ref_model).train()
    with torch.no_grad():
        policy.lm_head.weight[rl.FIRST_NEW: rl.NEW_END] += 0.7 * torch.randn(rl.NEW_END - rl.FIRST_NEW, 32)
    ids, mask, labels = _batch(rl)
    with torch.no_grad():
        ref, _ = labelled_logprobs(ref_model, ids, mask, labels)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    kls = []
    for _ in range(8):
        logp, keep = labelled_logprobs(policy, ids, mask, labels)
        out = grpo_loss(logp, keep, torch.zeros(4), ref_logp=ref, kl_coef=1.0)
        kls.append(out.stats["kl"])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert kls[0] > 0.05 and kls[-1] < 0.5 * kls[0], kls
