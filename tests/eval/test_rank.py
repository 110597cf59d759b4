"""Exact full-catalog ranking (gti/eval/rank.py) on a tiny random Llama: tree-attention scoring
equals brute-force per-item scoring, ranks equal argsort ranks (mid-rank on ties), the beam
search top-K get ranks 1..K, and the rank metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gti.eval.decode import constrained_beam_search, score_all_sids
from gti.eval.rank import exact_ranks, rank_metrics, score_catalog
from gti.sid.trie import SidTrie


def _brute(model, users, sids):
    return torch.stack([score_all_sids(model, p, sids) for p in users])


@pytest.mark.parametrize(
    ("levels", "codebook", "n_items", "prefix_batch", "batch_users"),
    [
        (3, 8, 40, 7, 3),  # 3 levels, chunks smaller than the number of prefixes at each depth
        (3, 8, 40, 1024, 4),  # one chunk per depth, all users in one batch
        (2, 8, 40, 5, 2),  # 2 levels: only the deepest (cropped) level
        (1, 8, 6, 4, 2),  # 1 level: the prefill alone
    ],
)
def test_score_catalog_equals_brute_force(sidspace, levels, codebook, n_items, prefix_batch, batch_users):
    s = sidspace
    sids = s.random_sids(n_items, levels, codebook, s.FIRST_NEW, seed=levels)
    model = s.tiny_llama(seed=2)
    users = s.prompts(5, seed=4)  # lengths 4, 7, 10, 6, 9: real left padding in each batch
    assert len({len(p) for p in users}) > 1
    got = score_catalog(model, users, sids, pad_id=0, batch_users=batch_users, prefix_batch=prefix_batch)
    assert got.shape == (5, n_items) and got.dtype == torch.float32
    torch.testing.assert_close(got, _brute(model, users, sids), atol=1e-4, rtol=0)


def test_score_catalog_shares_prefixes_and_restores_training(sidspace):
    """The scored catalog must be a real tree (shared prefixes), and a train-mode model is
    scored in eval mode and handed back in train mode."""
    s = sidspace
    sids = s.random_sids(40, s.LEVELS, s.CODEBOOK, s.FIRST_NEW, seed=1)
    assert torch.unique(sids[:, :1], dim=0).shape[0] < 40, "items share first tokens"
    model = s.tiny_llama(seed=5)
    users = s.prompts(3, seed=2)
    ref = score_catalog(model.eval(), users, sids, pad_id=0)
    model.train()
    got = score_catalog(model, users, sids, pad_id=0, prefix_batch=3)
    assert model.training
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    # Each user's scores do not depend on who shares the batch.
    alone = score_catalog(model, users[1:2], sids, pad_id=0)
    torch.testing.assert_close(alone[0], ref[1], atol=1e-4, rtol=0)


def test_exact_ranks_equal_argsort(sidspace):
    s = sidspace
    sids = s.random_sids(40, s.LEVELS, s.CODEBOOK, s.FIRST_NEW, seed=3)
    model = s.tiny_llama(seed=3)
    users = s.prompts(4, seed=6)
    scores = score_catalog(model, users, sids, pad_id=0, prefix_batch=8)
    for u in range(4):
        srt = scores[u].sort(descending=True).values
        assert (srt[:-1] - srt[1:]).min() > 1e-6, "the tiny model must not produce ties"
    # Brute force: position of every item in the descending argsort of the brute scores.
    brute = _brute(model, users, sids)
    pos = torch.empty_like(brute, dtype=torch.long)
    pos.scatter_(1, brute.argsort(dim=1, descending=True), torch.arange(40).expand(4, 40).contiguous())
    for target in range(40):
        rows = torch.full((4,), target)
        got = exact_ranks(scores, rows)
        assert got.tolist() == (pos[:, target] + 1).double().tolist()


def test_exact_ranks_tie_rule():
    scores = torch.tensor(
        [
            [0.5, 0.9, 0.5, 0.1, 0.5],  # target 0 tied with two others, one item above
            [0.5, 0.9, 0.5, 0.1, 0.5],  # target 1: best, no tie
            [0.5, 0.9, 0.5, 0.1, 0.5],  # target 3: last
            [1.0, 1.0, 1.0, 1.0, 1.0],  # all tied: the middle rank
        ]
    )
    got = exact_ranks(scores, torch.tensor([0, 1, 3, 2]))
    assert got.tolist() == [1 + 1 + 0.5 * 2, 1.0, 5.0, 3.0]
    with pytest.raises(ValueError):
        exact_ranks(scores, torch.tensor([0, 1, 5, 2]))


def test_beam_topk_get_ranks_one_to_k(sidspace):
    """On users whose beam top-K is known, the exact ranks of those K items are 1..K in order
    (beam width >= N: nothing is pruned, so the beam top-K is the true top-K)."""
    s = sidspace
    sids = s.random_sids(40, s.LEVELS, s.CODEBOOK, s.FIRST_NEW, seed=7)
    trie = SidTrie(sids, s.FIRST_NEW, s.NEW_END)
    model = s.tiny_llama(seed=7)
    users = s.prompts(4, seed=9)
    k = 10
    res = constrained_beam_search(model, users, trie, beam_width=40, k=k, levels=s.LEVELS, pad_id=0, batch_users=2)
    scores = score_catalog(model, users, sids, pad_id=0, prefix_batch=16)
    for u in range(4):
        top = res.items[u]
        assert (top >= 0).all()
        ranks = exact_ranks(scores[u].expand(k, -1), top)
        assert ranks.tolist() == [float(r) for r in range(1, k + 1)]
        torch.testing.assert_close(scores[u, top], res.scores[u], atol=1e-4, rtol=0)


def test_rank_metrics_values():
    ranks = torch.tensor([1.0, 2.0, 4.0, 11.0])
    m = rank_metrics(ranks, n_items=11, bootstrap=500, seed=3)
    assert m["mrr"]["value"] == pytest.approx((1 + 1 / 2 + 1 / 4 + 1 / 11) / 4)
    assert m["mean_percentile_rank"]["value"] == pytest.approx((0 + 0.1 + 0.3 + 1.0) / 4)
    assert m["median_rank"] == 3.0 and m["mean_rank"] == 4.5
    assert m["n_users"] == 4 and m["n_items"] == 11
    for key in ("mrr", "mean_percentile_rank"):
        lo, hi = m[key]["ci"]
        assert lo <= m[key]["value"] <= hi and lo < hi
    again = rank_metrics(np.array([1, 2, 4, 11]), n_items=11, bootstrap=500, seed=3)
    assert again == m, "seeded: same CI"
    one = rank_metrics([1.0], n_items=1, bootstrap=100, seed=0)
    assert one["mrr"]["value"] == 1.0 and one["mean_percentile_rank"]["value"] == 0.0
    assert one["mrr"]["ci"] == [1.0, 1.0]
    assert math.isclose(rank_metrics([6.0], n_items=11, bootstrap=0)["mean_percentile_rank"]["value"], 0.5)
    with pytest.raises(ValueError):
        rank_metrics([0.5], n_items=11)


def test_score_catalog_eager_attention(sidspace):
    """The custom 4D mask is honoured by the eager kernel too (it adds the mask)."""
    s = sidspace
    sids = s.random_sids(30, s.LEVELS, s.CODEBOOK, s.FIRST_NEW, seed=8)
    model = s.tiny_llama(seed=8)
    model.set_attn_implementation("eager")
    users = s.prompts(3, seed=5)
    got = score_catalog(model, users, sids, pad_id=0, batch_users=3, prefix_batch=6)
    torch.testing.assert_close(got, _brute(model, users, sids), atol=1e-4, rtol=0)
