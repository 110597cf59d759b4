"""Tests of gti.sid.quantizer (build/save/load) and gti.sid.rqkmeans."""

from __future__ import annotations

import pytest
import torch

from gti import config as C
from gti.common.errors import DataError
from gti.sid.quantizer import build_quantizer, codebooks_tensor, load_quantizer, save_quantizer
from gti.sid.rqkmeans import RQKMeansConfig, ResidualKMeans


@pytest.mark.parametrize("method", ["rqvae", "rqkmeans"])
def test_save_load_round_trip(tmp_path, clusters, method):
    cfg = C.load(None, [f"sid.method={method}", "sid.levels=2", "sid.codebook_size=8", "sid.code_dim=4",
                        "sid.encoder_dims=[16]"]).sid
    x, _ = clusters(120, 12, 6)
    q = build_quantizer(cfg, 12)
    if method == "rqvae":
        q.init_codebooks(x, generator=torch.Generator().manual_seed(0))
    else:
        q.fit(x, iters=5, generator=torch.Generator().manual_seed(0))
    save_quantizer(q, tmp_path)
    q2 = load_quantizer(tmp_path)
    assert type(q2) is type(q)
    assert torch.equal(q.encode(x), q2.encode(x))
    assert torch.allclose(q.decode_codes(q.encode(x)), q2.decode_codes(q2.encode(x)))
    cbs = codebooks_tensor(q2)
    assert sorted(cbs) == ["level_0", "level_1"] and cbs["level_0"].shape[0] == 8


def test_load_missing_raises(tmp_path):
    with pytest.raises(DataError, match="no quantizer"):
        load_quantizer(tmp_path)


def test_rqkmeans_reconstructs_clusters(clusters):
    x, _ = clusters(400, 8, 16, seed=5, spread=0.01)
    q = ResidualKMeans(RQKMeansConfig(in_dim=8, levels=2, codebook_size=16, balanced=False))
    inert = q.fit(x, iters=20, generator=torch.Generator().manual_seed(0))
    assert inert[1] <= inert[0]
    codes = q.encode(x)
    assert codes.shape == (400, 2) and codes.max() < 16
    err = ((q.decode_codes(codes) - x) ** 2).mean()
    assert err < 0.01**2 * 2
    # The last residual is what is left after level 0.
    r = q.last_residual(x)
    assert torch.allclose(r, x - q.codebooks[0][codes[:, 0]], atol=1e-5)
