"""Initialisation arms and their defining properties (gti/lm/init.py)."""

from __future__ import annotations

import pytest
import torch

from gti.common.errors import ConfigError
from gti.lm.init import init_rows, vocab_stats


@pytest.fixture
def vocab():
    g = torch.Generator().manual_seed(0)
    return torch.randn(200, 16, generator=g) * 0.5 + 0.3


def test_mean_all_rows_equal_the_vocab_mean(vocab):
    rows = init_rows("mean", vocab, 10)
    assert rows.shape == (10, 16)
    assert torch.equal(rows, rows[:1].expand(10, 16))
    torch.testing.assert_close(rows[0], vocab.mean(0))
    # rank 1: the collapse GTI is meant to fix
    assert torch.linalg.matrix_rank(rows) == 1


def test_mean_noise_is_mean_plus_scaled_noise_and_deterministic(vocab):
    a = init_rows("mean_noise", vocab, 500, noise_std=0.1, generator=torch.Generator().manual_seed(3))
    b = init_rows("mean_noise", vocab, 500, noise_std=0.1, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    st = vocab_stats(vocab)
    dev = a - st["mean"]
    ratio = dev.std(0) / (0.1 * st["std"])
    assert torch.all((ratio > 0.8) & (ratio < 1.2))
    torch.testing.assert_close(a.mean(0), st["mean"], atol=0.02, rtol=0)


def test_random_matches_vocab_mean_norm(vocab):
    rows = init_rows("random", vocab, 50, generator=torch.Generator().manual_seed(0))
    target = vocab.norm(dim=1).mean()
    torch.testing.assert_close(rows.norm(dim=1), target.expand(50), rtol=1e-5, atol=1e-5)
    assert torch.linalg.matrix_rank(rows) == 16


def test_description_is_token_weighted_mean_of_carrier_texts():
    emb = torch.arange(12, dtype=torch.float32).reshape(6, 2)  # token t -> [2t, 2t+1]
    # 3 items, 2 levels x 3 codes; item texts (token ids).
    codes = torch.tensor([[0, 1], [0, 2], [1, 2]])
    texts = [[1, 2], [3], [4, 5, 5]]
    rows = init_rows("description", emb, 8, item_codes=codes, item_token_ids=texts, codebook_sizes=[3, 3])
    mean = emb.mean(0)
    # a_0 is carried by items 0 and 1: tokens 1, 2, 3
    torch.testing.assert_close(rows[0], emb[[1, 2, 3]].mean(0))
    # a_1: item 2 only
    torch.testing.assert_close(rows[1], emb[[4, 5, 5]].mean(0))
    # a_2: nobody -> vocab mean
    torch.testing.assert_close(rows[2], mean)
    # b_0 nobody, b_1 item 0, b_2 items 1 and 2
    torch.testing.assert_close(rows[3], mean)
    torch.testing.assert_close(rows[4], emb[[1, 2]].mean(0))
    torch.testing.assert_close(rows[5], emb[[3, 4, 5, 5]].mean(0))
    # rows past the SID tokens (markers) get the mean
    torch.testing.assert_close(rows[6:], mean.expand(2, 2))


def test_codebook_shape_rank_and_geometry(vocab):
    g = torch.Generator().manual_seed(1)
    cbs = [torch.randn(12, 4, generator=g), torch.randn(12, 4, generator=g) * 0.1]
    rows = init_rows("codebook", vocab, 26, codebooks=cbs, codebook_sizes=[12, 12])
    assert rows.shape == (26, 16)
    st = vocab_stats(vocab)
    for lvl in range(2):
        block = rows[12 * lvl: 12 * (lvl + 1)]
        centred = block - st["mean"]
        # rank of the level block (around the vocab mean) is the code dimension
        assert torch.linalg.matrix_rank(centred) == 4
        # at the vocabulary's spread
        torch.testing.assert_close(centred.norm(dim=1).mean(), st["spread"], rtol=1e-4, atol=1e-5)
        # pairwise distances preserved up to one scale (orthonormal map)
        dc = torch.cdist(cbs[lvl], cbs[lvl])
        dr = torch.cdist(block, block)
        scale = dr.sum() / dc.sum()
        torch.testing.assert_close(dr, dc * scale, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(rows[24:], st["mean"].expand(2, 16))


def test_codebook_wider_than_model(vocab):
    g = torch.Generator().manual_seed(2)
    cbs = [torch.randn(40, 32, generator=g)]
    rows = init_rows("codebook", vocab, 40, codebooks=cbs)
    assert rows.shape == (40, 16)
    assert torch.linalg.matrix_rank(rows - vocab.mean(0)) == 16


def test_errors_name_the_method(vocab):
    with pytest.raises(ConfigError, match="init.method"):
        init_rows("bogus", vocab, 4)
    with pytest.raises(ConfigError, match="description"):
        init_rows("description", vocab, 4, codebook_sizes=[2, 2])
    with pytest.raises(ConfigError, match="codebook"):
        init_rows("codebook", vocab, 4, codebook_sizes=[2, 2])
