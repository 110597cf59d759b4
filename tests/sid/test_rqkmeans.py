"""gti/sid/rqkmeans.py: residual k-means, the quantiser without gradient training."""

from __future__ import annotations

import torch

from gti.sid.rqkmeans import RQKMeansConfig, ResidualKMeans


def _fit(seed=0):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 6, generator=g)
    q = ResidualKMeans(RQKMeansConfig(in_dim=6, levels=2, codebook_size=8, balanced=False))
    q.fit(x, iters=5, generator=torch.Generator().manual_seed(seed))
    return q, x


def test_codes_are_deterministic_and_decoding_beats_the_mean():
    q, x = _fit()
    codes = q.encode(x)
    assert codes.shape == (200, 2) and int(codes.max()) < 8 and q.codebook_sizes == [8, 8]
    assert torch.equal(codes, _fit()[0].encode(x))
    err = ((q.decode_codes(codes) - x) ** 2).mean()
    assert err < ((x - x.mean(0)) ** 2).mean()
    # The last level's input is the residual after the first level.
    first = q.level_codebooks()[0][codes[:, 0]]
    torch.testing.assert_close(q.last_residual(x), x - first)


def test_balanced_steps_take_their_own_epsilon_from_the_sid_config():
    """The balanced Lloyd steps use `sid.kmeans_sinkhorn_epsilon`; `sid.sinkhorn_epsilon` is the
    collision spreading's and does not reach the quantiser."""
    from gti.config import SidConfig

    cfg = RQKMeansConfig.from_sid_config(SidConfig(method="rqkmeans", sinkhorn_epsilon=0.007), in_dim=6)
    assert cfg.sinkhorn_epsilon == SidConfig().kmeans_sinkhorn_epsilon == 0.003
    cfg = RQKMeansConfig.from_sid_config(SidConfig(method="rqkmeans", kmeans_sinkhorn_epsilon=0.02), in_dim=6)
    assert cfg.sinkhorn_epsilon == 0.02
