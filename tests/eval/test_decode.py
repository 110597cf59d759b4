"""Constrained beam search (gti/eval/decode.py) on a tiny random Llama: validity, exactness
against exhaustive scoring, batch invariance, eval mode (the peer and the generation-config
override are tested in test_generate.py)."""

from __future__ import annotations

import pytest
import torch

from gti.eval.decode import constrained_beam_search, score_all_sids
from gti.sid.trie import SidTrie


@pytest.fixture(params=["sidtrie", "dicttrie"])
def trie_cls(request, sidspace):
    return SidTrie if request.param == "sidtrie" else sidspace.DictTrie


def _search(model, prompts, trie, s, **kw):
    args = dict(beam_width=8, k=5, levels=s.LEVELS, pad_id=0)
    args.update(kw)
    return constrained_beam_search(model, prompts, trie, **args)


def test_constrained_emits_only_catalog_sids(sidspace, trie_cls):
    s = sidspace
    sids = s.random_sids(40, s.LEVELS, s.CODEBOOK, s.FIRST_NEW)
    trie = trie_cls(sids, s.FIRST_NEW, s.NEW_END)
    # SID head rows shrunk: left free, the model would rather emit ordinary tokens.
    model = s.tiny_llama(sid_row_scale=0.05)
    res = _search(model, s.prompts(5), trie, s, batch_users=3)
    assert res.items.shape == (5, 5) and res.sid_ids.shape == (5, 5, s.LEVELS)
    assert (res.items >= 0).all(), "every user gets K valid items from a 40-item catalog"
    assert res.n_invalid == 0 and res.invalid_sid_rate == 0.0 and res.n_returned == 25
    for u in range(5):
        assert len(set(res.items[u].tolist())) == 5, "items are distinct"
        assert torch.equal(res.sid_ids[u], sids[res.items[u]]), "sid_ids are the items' SIDs"
        assert (res.scores[u][:-1] >= res.scores[u][1:]).all(), "best first"
    # The same model searched freely emits non-SID tokens: the mask is what keeps it valid.
    free = _search(model, s.prompts(5), trie, s, constrained=False)
    assert free.n_invalid > 0 and free.invalid_sid_rate > 0.5
    # A free search maximises over a superset, so its best beam scores at least as high.
    assert (free.beam_scores[:, 0] >= res.scores[:, 0] - 1e-5).all()


@pytest.mark.parametrize("n_items", [6, 14])
def test_topk_equals_exhaustive_scoring(sidspace, trie_cls, n_items):
    """With W >= N nothing is ever pruned, so beam search must return the exact top-K of
    teacher-forced scores over the whole catalog."""
    s = sidspace
    sids = s.random_sids(n_items, s.LEVELS, s.CODEBOOK, s.FIRST_NEW, seed=n_items)
    trie = trie_cls(sids, s.FIRST_NEW, s.NEW_END)
    model = s.tiny_llama(seed=3)
    k = 5
    users = s.prompts(3, seed=7)
    res = _search(model, users, trie, s, beam_width=n_items, k=k)
    for u, prompt in enumerate(users):
        exact = score_all_sids(model, prompt, sids)
        top_scores, top_items = exact.topk(k)
        gaps = (top_scores[:-1] - top_scores[1:]).min()
        assert gaps > 1e-3, "test model must not have near-ties"
        assert res.items[u].tolist() == top_items.tolist()
        torch.testing.assert_close(res.scores[u], top_scores, atol=1e-4, rtol=0)


def _trie_normalised_scores(model, prompt, sids):
    """Reference: each item's sum over levels of log_softmax over the catalog children of its
    prefix only (teacher forced, brute force over the [N, L] catalog)."""
    n_items, levels = sids.shape
    ids = torch.cat([torch.tensor([list(prompt)]).expand(n_items, -1), sids[:, :-1]], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, logits_to_keep=levels).logits.float()  # [N, L, V]
    scores = torch.zeros(n_items)
    for i in range(n_items):
        for d in range(levels):
            children = sorted({int(t) for t in sids[(sids[:, :d] == sids[i, :d]).all(-1), d]})
            row = logits[i, d, children].log_softmax(-1)
            scores[i] += row[children.index(int(sids[i, d]))]
    return scores


@pytest.mark.parametrize("n_items", [6, 14])
def test_trie_normalised_scores_are_a_distribution_over_the_catalog(sidspace, trie_cls, n_items):
    """normalise='trie': with W >= N every item survives to the last step, its score is the
    brute-force restricted log-prob, and the catalog's probabilities sum to 1 (over the full
    vocabulary they sum to less: the model's mass off the catalog)."""
    s = sidspace
    sids = s.random_sids(n_items, s.LEVELS, s.CODEBOOK, s.FIRST_NEW, seed=n_items)
    trie = trie_cls(sids, s.FIRST_NEW, s.NEW_END)
    model = s.tiny_llama(seed=3)
    users = s.prompts(3, seed=7)
    res = _search(model, users, trie, s, beam_width=n_items, k=5, normalise="trie")
    vocab = _search(model, users, trie, s, beam_width=n_items, k=5)
    for u, prompt in enumerate(users):
        torch.testing.assert_close(res.beam_scores[u].logsumexp(-1), torch.tensor(0.0), atol=1e-4, rtol=0)
        assert vocab.beam_scores[u].logsumexp(-1) < -1e-2
        ref = _trie_normalised_scores(model, prompt, sids)
        top_scores, top_items = ref.topk(5)
        assert (top_scores[:-1] - top_scores[1:]).min() > 1e-3, "test model must not have near-ties"
        assert res.items[u].tolist() == top_items.tolist()
        torch.testing.assert_close(res.scores[u], top_scores, atol=1e-4, rtol=0)


def test_trie_normalisation_needs_the_constraint(sidspace):
    s = sidspace
    sids = s.random_sids(6, s.LEVELS, s.CODEBOOK, s.FIRST_NEW)
    trie = s.DictTrie(sids, s.FIRST_NEW, s.NEW_END)
    with pytest.raises(ValueError, match="constrained"):
        _search(s.tiny_llama(), s.prompts(1), trie, s, constrained=False, normalise="trie")
    with pytest.raises(ValueError, match="normalise='softmax'"):
        _search(s.tiny_llama(), s.prompts(1), trie, s, normalise="softmax")


def test_fewer_items_than_k_pads(sidspace, trie_cls):
    s = sidspace
    sids = s.random_sids(3, s.LEVELS, s.CODEBOOK, s.FIRST_NEW, seed=5)
    trie = trie_cls(sids, s.FIRST_NEW, s.NEW_END)
    res = _search(s.tiny_llama(), s.prompts(2), trie, s, beam_width=6, k=5)
    assert sorted(res.items[0, :3].tolist()) == [0, 1, 2]
    assert (res.items[:, 3:] == -1).all() and torch.isinf(res.scores[:, 3:]).all()
    assert (res.sid_ids[:, 3:] == -1).all()
    assert res.n_invalid == 0 and res.n_returned == 6


def test_batch_size_invariance(sidspace):
    s = sidspace
    sids = s.random_sids(60, s.LEVELS, s.CODEBOOK, s.FIRST_NEW, seed=2)
    trie = SidTrie(sids, s.FIRST_NEW, s.NEW_END)
    model = s.tiny_llama(seed=4)
    users = s.prompts(4, seed=11)  # different lengths -> real left padding in the batch of 4
    one = _search(model, users, trie, s, batch_users=1)
    four = _search(model, users, trie, s, batch_users=4)
    assert torch.equal(one.items, four.items)
    torch.testing.assert_close(one.scores, four.scores, atol=1e-4, rtol=0)
    # Prompts given as a tensor (equal lengths, no padding) give the same as lists.
    eq = [p[:4] for p in users]
    torch.testing.assert_close(
        _search(model, torch.tensor(eq), trie, s).scores, _search(model, eq, trie, s).scores
    )


def test_search_runs_in_eval_mode_and_restores_training(sidspace):
    s = sidspace
    sids = s.random_sids(30, s.LEVELS, s.CODEBOOK, s.FIRST_NEW, seed=4)
    trie = SidTrie(sids, s.FIRST_NEW, s.NEW_END)
    model = s.tiny_llama(seed=6)
    model.config.attention_dropout = 0.5  # dropout would make a train-mode search random
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    ref = _search(model.eval(), s.prompts(3), trie, s)
    model.train()
    got = _search(model, s.prompts(3), trie, s)
    assert model.training, "the caller's train mode is restored"
    assert torch.equal(got.items, ref.items)
    torch.testing.assert_close(got.scores, ref.scores)
