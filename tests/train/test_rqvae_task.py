"""gti/train/rqvae_task.py: the RQ-VAE worker's checkpoint pieces (the full Ray Train run is
tests/stages/test_sid.py, marked slow)."""

from __future__ import annotations

import torch

from gti.train.rqvae_task import _load_optimizer, _save_optimizer


def test_optimizer_state_round_trips_through_safetensors(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
    _save_optimizer(opt, tmp_path / "opt.safetensors")
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _load_optimizer(fresh, tmp_path / "opt.safetensors")
    a, b = opt.state_dict()["state"], fresh.state_dict()["state"]
    assert a.keys() == b.keys()
    for i in a:
        for k in a[i]:
            assert torch.equal(torch.as_tensor(a[i][k]), torch.as_tensor(b[i][k])), (i, k)
