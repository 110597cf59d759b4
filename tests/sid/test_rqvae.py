"""Tests of gti.sid.rqvae."""

from __future__ import annotations

import torch

from gti.sid.rqvae import RQVAE, RQVAEConfig, rotate_to


def _model(in_dim=16, **kw):
    kw.setdefault("dropout", 0.0)
    cfg = RQVAEConfig(in_dim=in_dim, encoder_dims=[32], code_dim=8, levels=3, codebook_size=16, **kw)
    torch.manual_seed(0)
    return RQVAE(cfg)


def test_kmeans_init_uses_the_data(clusters):
    x, _ = clusters(400, 16, 16, seed=2)
    m = _model()
    before = m.codebooks.detach().clone()
    m.init_codebooks(x, iters=10, generator=torch.Generator().manual_seed(0))
    z = m.encoder(x).detach()
    # Level-0 codes are encoder outputs of real items (k-means centroids lie among them) ...
    d0 = torch.cdist(m.codebooks[0].detach(), z).min(1).values
    assert d0.max() < torch.cdist(before[0], z).min(1).values.min()
    # ... and the codebooks depend on the data.
    m2 = _model()
    m2.init_codebooks(x * 3 + 1, iters=10, generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(m.codebooks, m2.codebooks)
    assert bool(m.initialised)


def test_codes_in_range_and_shapes(clusters):
    x, _ = clusters(100, 16, 4)
    m = _model()
    m.init_codebooks(x, generator=torch.Generator().manual_seed(0))
    out = m(x)
    assert out.codes.shape == (100, 3) and out.codes.dtype == torch.long
    assert out.codes.min() >= 0 and out.codes.max() < 16
    assert out.residuals.shape == (3, 100, 8)
    codes = m.encode(x)
    assert codes.min() >= 0 and codes.max() < 16
    assert torch.equal(codes, out.codes)  # no dropout: training and eval codes agree
    assert m.decode_codes(codes).shape == (100, 16)
    assert m.last_residual(x).shape == (100, 8)


def test_loss_falls_on_clustered_data(clusters):
    x, _ = clusters(256, 16, 8, seed=3, spread=0.1)
    for rotation in (False, True):
        m = _model(rotation_trick=rotation, diversity_weight=0.1)
        m.init_codebooks(x, generator=torch.Generator().manual_seed(0))
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        first = None
        for step in range(40):
            out = m(x)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            first = first if first is not None else out.recon_loss.item()
        assert out.recon_loss.item() < 0.5 * first, rotation
        assert torch.isfinite(out.loss)


def test_rotation_trick_value_and_gradient():
    e = torch.randn(5, 4, requires_grad=True)
    q = torch.randn(5, 4)
    out = rotate_to(e, q)
    assert torch.allclose(out, q, atol=1e-5)
    out.sum().backward()
    assert e.grad is not None and torch.isfinite(e.grad).all()
    # Unlike the STE, the gradient is not the identity.
    assert not torch.allclose(e.grad, torch.ones_like(e.grad))


def test_dead_code_revival_raises_utilisation(clusters):
    x, _ = clusters(256, 16, 16, seed=4)
    m = _model()
    m.init_codebooks(x, generator=torch.Generator().manual_seed(0))
    # Kill half of every codebook by moving codes far away.
    with torch.no_grad():
        m.codebooks[:, 8:] += 100.0
    out = m(x)
    counts = torch.stack([torch.bincount(out.codes[:, lv], minlength=16) for lv in range(3)])
    used_before = (counts > 0).sum(1)
    assert (used_before <= 8).all()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    out.loss.backward()
    opt.step()
    revived = m.revive_dead_codes(counts, out.residuals, generator=torch.Generator().manual_seed(0),
                                  optimizer=opt)
    assert revived == [int(v) for v in (counts == 0).sum(1)]
    assert (opt.state[m.codebooks]["exp_avg"][0, 8:] == 0).all()
    codes = m.encode(x)
    used_after = torch.tensor([codes[:, lv].unique().numel() for lv in range(3)])
    assert (used_after > used_before).all()


def test_inference_encoder_equals_eval_module_in_any_mode(clusters):
    """`_enc_eval` (Linear layers only, in-place ReLU) must give the eval-mode encoder's output,
    also when the module is in train mode with dropout on."""
    x, _ = clusters(300, 16, 8, seed=4)
    m = _model(dropout=0.3)
    m.eval()
    with torch.no_grad():
        ref = m.encoder(x)
    m.train()
    with torch.no_grad():
        got = m._enc_eval(x)
    assert m.training  # mode restored / untouched
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_linear_layers_start_xavier_normal():
    torch.manual_seed(0)
    m = RQVAE(RQVAEConfig(in_dim=256, encoder_dims=[512], code_dim=64, levels=1, codebook_size=4))
    for lin in [l for l in m.encoder if isinstance(l, torch.nn.Linear)]:
        fan_out, fan_in = lin.weight.shape
        want = (2.0 / (fan_in + fan_out)) ** 0.5
        assert abs(float(lin.weight.detach().std()) - want) < 0.05 * want
        assert float(lin.bias.abs().max()) == 0.0


def test_train_sinkhorn_balances_last_level_only_in_training():
    """With train_sinkhorn_epsilon > 0 the last level's training codes are spread over the
    codebook; levels above it and inference codes stay greedy."""
    torch.manual_seed(0)
    x = torch.randn(512, 16) * 0.01 + torch.randn(1, 16)  # one tight blob: greedy piles up
    m = _model(train_sinkhorn_epsilon=0.05)
    m.init_codebooks(torch.randn(512, 16), iters=5)  # codebooks fit to other data
    m.train()
    with torch.no_grad():
        out = m(x)
    m.eval()
    greedy = m.encode(x)
    n_greedy = torch.bincount(greedy[:, -1], minlength=16)
    n_train = torch.bincount(out.codes[:, -1], minlength=16)
    assert int(n_train.max()) < int(n_greedy.max()) // 2
    assert int((n_train > 0).sum()) > int((n_greedy > 0).sum())
    assert torch.equal(out.codes[:, :-1], greedy[:, :-1])
    m.cfg.train_sinkhorn_epsilon = 0.0
    m.train()
    with torch.no_grad():
        assert torch.equal(m(x).codes, greedy)  # dropout 0: greedy training codes = encode


def test_train_sinkhorn_levels_balances_that_many_last_levels():
    """train_sinkhorn_levels=2 of 3 levels: the two last train on spread codes, the first stays
    greedy; the saved config round-trips the field (an old config without it means 1)."""
    torch.manual_seed(0)
    x = torch.randn(512, 16) * 0.01 + torch.randn(1, 16)
    m = _model(train_sinkhorn_epsilon=0.05, train_sinkhorn_levels=2)
    m.init_codebooks(torch.randn(512, 16), iters=5)
    m.train()
    with torch.no_grad():
        out = m(x)
    m.eval()
    greedy = m.encode(x)
    for lv in (1, 2):  # the blob piles onto few greedy codes; the balanced ones spread it
        n_greedy = torch.bincount(greedy[:, lv], minlength=16)
        n_train = torch.bincount(out.codes[:, lv], minlength=16)
        assert int((n_train > 0).sum()) > int((n_greedy > 0).sum()), lv
    assert torch.equal(out.codes[:, :1], greedy[:, :1])
    assert RQVAEConfig(**m.cfg.to_dict()).train_sinkhorn_levels == 2
    old = {k: v for k, v in m.cfg.to_dict().items() if k != "train_sinkhorn_levels"}
    assert RQVAEConfig(**old).train_sinkhorn_levels == 1


def test_bf16_encoding_matches_float32_on_clear_cases(clusters):
    """The bf16 encoder path gives float32 codes wherever the nearest code is not a near tie;
    on well separated clusters that is every item at the first level."""
    x, _ = clusters(400, 16, 16, seed=5)
    m = _model()
    m.init_codebooks(x, iters=10)
    m.eval()
    c32 = m.encode(x)
    m.cfg.encode_dtype = "bfloat16"
    c16 = m.encode(x)
    assert c16.dtype == torch.long and c16.shape == c32.shape
    assert torch.equal(c16[:, 0], c32[:, 0])
    assert float((c16 == c32).all(1).float().mean()) > 0.8
    # last_residual follows the same precision: bf16 encoder output minus the prefix codes.
    cbs = m.codebooks.detach()
    want = m._enc_eval(x, torch.bfloat16) - sum(cbs[lv][c16[:, lv]] for lv in range(m.levels - 1))
    torch.testing.assert_close(m.last_residual(x), want, rtol=0, atol=1e-6)
    assert not torch.allclose(m._enc_eval(x), m._enc_eval(x, torch.bfloat16), rtol=0, atol=1e-6)


def test_encode_dtype_validated_and_auto_resolved(monkeypatch):
    import pytest

    from gti.sid import rqvae

    with pytest.raises(ValueError, match="encode_dtype"):
        RQVAEConfig(in_dim=4, encode_dtype="float16")
    with pytest.raises(ValueError, match="assign_dtype"):
        rqvae.resolve_encode_dtype("int8")
    assert rqvae.resolve_encode_dtype("float32") == "float32"
    monkeypatch.setattr(rqvae, "native_bf16", lambda device="cpu": True)
    assert rqvae.resolve_encode_dtype("auto") == "bfloat16"
    monkeypatch.setattr(rqvae, "native_bf16", lambda device="cpu": False)
    assert rqvae.resolve_encode_dtype("auto") == "float32"


def test_encode_dtype_survives_save_and_load(tmp_path):
    from gti.sid.quantizer import load_quantizer, save_quantizer

    m = _model(encode_dtype="bfloat16")
    save_quantizer(m, tmp_path)
    assert load_quantizer(tmp_path).cfg.encode_dtype == "bfloat16"


def test_sid_config_trains_every_level_on_balanced_codes_by_default():
    """`sid.train_sinkhorn_levels: all` (the default) reaches the model as the number of levels;
    a number passes through; 0 is refused, naming the key."""
    import pydantic
    import pytest

    from gti.config import SidConfig

    assert RQVAEConfig.from_sid_config(SidConfig(levels=3), in_dim=8).train_sinkhorn_levels == 3
    assert RQVAEConfig.from_sid_config(SidConfig(levels=3, train_sinkhorn_levels=1), in_dim=8).train_sinkhorn_levels == 1
    with pytest.raises(pydantic.ValidationError, match="train_sinkhorn_levels"):
        SidConfig(train_sinkhorn_levels=0)


def test_greedy_usage_counts_the_encode_codes_and_keeps_the_first_batchs_residuals(clusters):
    x, _ = clusters(200, 16, 8, seed=1)
    m = _model()
    m.init_codebooks(x, generator=torch.Generator().manual_seed(0))
    m.eval()
    counts, res = m.greedy_usage(x[s : s + 64] for s in range(0, 200, 64))
    codes = m.encode(x)
    want = torch.stack([torch.bincount(codes[:, lv], minlength=16) for lv in range(3)]).double()
    assert torch.equal(counts, want)
    assert res.shape == (3, 64, 8)
    assert torch.allclose(res, m(x[:64]).residuals, atol=1e-5)  # the forward's level inputs, in eval mode
    assert m.greedy_usage(iter([]))[1] is None
