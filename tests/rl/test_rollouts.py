"""Rollouts (gti/rl/rollouts.py) on a tiny random Llama: every candidate is a catalog SID in
both modes, beam candidates are the G best distinct items, samples follow the temperature, the
scores are the completions' log-probs, and the training batch is laid out as the loss expects."""

from __future__ import annotations

import pytest
import torch
from gti.eval.decode import score_all_sids
from gti.rl.grpo import labelled_logprobs, sequence_logprobs
from gti.rl.rollouts import beam_rollouts, completion_batch, rollout, sample_rollouts
from gti.train.loss import IGNORE_INDEX

G = 4


def _setup(rl, n_items: int = 30, n_prompts: int = 5):
    sids = rl.random_sids(n_items, seed=n_items)
    return rl.tiny_llama(seed=3), rl.trie(sids), sids, rl.prompts(n_prompts)


def _assert_valid(ro, sids, n_prompts):
    assert ro.sid_ids.shape == (n_prompts, G, sids.shape[1]) and ro.items.shape == ro.scores.shape == (n_prompts, G)
    assert (ro.items >= 0).all(), "every candidate is a catalog SID"
    assert torch.equal(ro.sid_ids, sids[ro.items]), "sid_ids are the items' SIDs"
    assert (ro.scores[:, :-1] >= ro.scores[:, 1:]).all(), "best first"
    assert torch.isfinite(ro.scores).all()


def _assert_scores_are_logprobs(model, prompts, ro):
    """The rollout scores equal the completions' summed log-probs in the training batch
    (left-padded decoding vs right-padded scoring: the same numbers)."""
    b = completion_batch(prompts, ro, pad_id=0)
    with torch.no_grad():
        logp, keep = labelled_logprobs(model, b["input_ids"], b["attention_mask"], b["labels"])
    torch.testing.assert_close(sequence_logprobs(logp, keep), ro.scores.reshape(-1), atol=1e-4, rtol=0)


def test_beam_rollouts_are_the_g_best_distinct_catalog_items(rl):
    model, trie, sids, prompts = _setup(rl)
    ro = beam_rollouts(model, prompts, trie, group_size=G, levels=rl.LEVELS, pad_id=0, beam_width=30, batch_users=2)
    _assert_valid(ro, sids, len(prompts))
    assert ro.mode == "beam" and ro.group_size == G and ro.timings["rollout_s"] > 0
    for u, prompt in enumerate(prompts):
        assert len(set(ro.items[u].tolist())) == G, "distinct"
        # Width 30 >= catalog: nothing pruned, so these are the exact top-G of the catalog.
        assert ro.items[u].tolist() == score_all_sids(model, prompt, sids).topk(G).indices.tolist()
    _assert_scores_are_logprobs(model, prompts, ro)
    assert ro.candidates()[0][0] == tuple(ro.sid_ids[0, 0].tolist())


def test_beam_width_defaults_to_g_and_needs_g_items(rl):
    model, trie, sids, prompts = _setup(rl)
    ro = beam_rollouts(model, prompts, trie, group_size=G, levels=rl.LEVELS, pad_id=0)
    _assert_valid(ro, sids, len(prompts))
    small = rl.trie(rl.random_sids(3, seed=9))
    with pytest.raises(ValueError, match="group_size=4"):
        beam_rollouts(model, prompts, small, group_size=G, levels=rl.LEVELS, pad_id=0)


def test_sample_rollouts_are_catalog_sids_with_their_logprobs(rl):
    model, trie, sids, prompts = _setup(rl)
    model.train()
    ro = sample_rollouts(model, prompts, trie, group_size=G, levels=rl.LEVELS, pad_id=0, batch_users=2, seed=0)
    assert model.training, "the caller's mode is restored"
    _assert_valid(ro, sids, len(prompts))
    assert ro.mode == "sample" and ro.timings["prefill_s"] > 0
    _assert_scores_are_logprobs(model, prompts, ro)
    again = sample_rollouts(model, prompts, trie, group_size=G, levels=rl.LEVELS, pad_id=0, batch_users=2, seed=0)
    assert torch.equal(again.sid_ids, ro.sid_ids), "a seed reproduces the draw"


def test_sampling_follows_the_temperature(rl):
    model, trie, _, prompts = _setup(rl, n_items=30, n_prompts=3)
    # Width 1 is greedy decoding, what sampling becomes as T -> 0 (token by token).
    greedy = beam_rollouts(model, prompts, trie, group_size=1, levels=rl.LEVELS, pad_id=0, beam_width=1).items
    cold = sample_rollouts(model, prompts, trie, group_size=16, levels=rl.LEVELS, pad_id=0, temperature=0.01, seed=1)
    assert (cold.items == greedy).all(), "near-zero temperature samples the greedy item"
    hot = sample_rollouts(model, prompts, trie, group_size=64, levels=rl.LEVELS, pad_id=0, temperature=5.0, seed=1)
    assert (hot.items >= 0).all()
    assert min(len(set(row)) for row in hot.items.tolist()) > 10, "a hot policy spreads over the catalog"
    assert len(set(cold.items[0].tolist())) == 1, "duplicates are allowed when sampling"


def test_sample_frequencies_match_the_constrained_distribution(rl):
    """At T = 1 an item's sampling probability is the product over levels of the next-token
    probability renormalised over the trie's allowed tokens."""
    sids = rl.random_sids(6, seed=4)
    model, trie, prompt = rl.tiny_llama(seed=5), rl.trie(sids), rl.prompts(1, seed=2)
    n = 4000
    ro = sample_rollouts(model, prompt, trie, group_size=n, levels=rl.LEVELS, pad_id=0, seed=3)
    freq = torch.bincount(ro.items[0], minlength=6).float() / n
    with torch.no_grad():
        p = torch.ones(6)
        for lv in range(rl.LEVELS):
            ids = torch.tensor([prompt[0] + s[:lv] for s in sids.tolist()])
            probs = torch.softmax(model(input_ids=ids).logits[:, -1].float(), -1)
            allowed = trie.allowed(sids[:, :lv])  # [6, V_new]
            sub = probs[:, rl.FIRST_NEW: rl.NEW_END] * allowed
            p *= sub.gather(1, (sids[:, lv:lv + 1] - rl.FIRST_NEW)).squeeze(1) / sub.sum(1)
    assert p.sum().item() == pytest.approx(1.0, abs=1e-5)
    assert (freq - p).abs().max() < 0.03, (freq, p)


def test_completion_batch_layout(rl):
    model, trie, _, _ = _setup(rl)
    prompts = [[5, 6, 7], [8, 9]]
    ro = beam_rollouts(model, prompts, trie, group_size=G, levels=rl.LEVELS, pad_id=0)
    b = completion_batch(prompts, ro, pad_id=1)
    assert {k: tuple(v.shape) for k, v in b.items()} == {k: (2 * G, 6) for k in ("input_ids", "attention_mask", "labels")}
    for u, p in enumerate(prompts):
        for g in range(G):
            row = u * G + g
            sid = ro.sid_ids[u, g].tolist()
            n = len(p) + rl.LEVELS
            assert b["input_ids"][row, :n].tolist() == p + sid and (b["input_ids"][row, n:] == 1).all()
            assert b["labels"][row].tolist() == [IGNORE_INDEX] * len(p) + sid + [IGNORE_INDEX] * (6 - n)
            assert b["attention_mask"][row].tolist() == [1] * n + [0] * (6 - n)
    with pytest.raises(ValueError, match="prompts"):
        completion_batch(prompts[:1], ro, pad_id=0)


def test_rollout_dispatch_and_errors(rl):
    model, trie, sids, prompts = _setup(rl, n_prompts=2)
    for mode in ("beam", "sample"):
        ro = rollout(model, prompts, trie, mode=mode, group_size=G, levels=rl.LEVELS, pad_id=0, seed=0)
        assert ro.mode == mode
        _assert_valid(ro, sids, 2)
    with pytest.raises(ValueError, match="unknown rollout mode 'greedy'"):
        rollout(model, prompts, trie, mode="greedy", group_size=G, levels=rl.LEVELS, pad_id=0)
    with pytest.raises(ValueError, match="temperature"):
        sample_rollouts(model, prompts, trie, group_size=G, levels=rl.LEVELS, pad_id=0, temperature=0.0)
    with pytest.raises(ValueError, match="group_size"):
        beam_rollouts(model, prompts, trie, group_size=0, levels=rl.LEVELS, pad_id=0)
