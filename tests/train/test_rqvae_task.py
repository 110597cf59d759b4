"""gti/train/rqvae_task.py: the RQ-VAE worker's checkpoint pieces and its epoch batches (the
in-memory epoch cache against the streaming path, with a stand-in for the Ray Data shard and
`_run_epoch` on one process), without Ray (the full Ray Train run is tests/stages/test_sid.py,
marked slow)."""

from __future__ import annotations

import pytest
import torch

from gti.sid.rqvae import RQVAE, RQVAEConfig
from gti.train import rqvae_task as T
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


# --------------------------------------------------------------------------- the epoch cache

class FakeShard:
    """The part of a Ray Data shard the worker uses: `iter_torch_batches` over fixed rows, in
    order (no shuffle), recording each call's arguments."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x, self.calls = x, []

    def iter_torch_batches(self, batch_size, device=None, **kw):
        self.calls.append({"batch_size": batch_size, "device": device, **kw})
        for i in range(0, self.x.shape[0], batch_size):
            yield {"embedding": self.x[i:i + batch_size].to(device)}


def _rows(n: int, d: int = 6) -> torch.Tensor:
    return torch.arange(n * d, dtype=torch.float32).reshape(n, d)


def _ids(batches) -> list[list[int]]:
    """Row ids of batches cut from `_rows` (column 0 is 6 * id)."""
    return [(b[:, 0] / 6).long().tolist() for b in batches]


def test_cached_batches_are_a_function_of_seed_epoch_and_rank():
    x = _rows(50)
    once = _ids(T.cached_epoch_batches(x, 8, seed=3, epoch=2, rank=1))
    assert once == _ids(T.cached_epoch_batches(x.clone(), 8, seed=3, epoch=2, rank=1))
    assert once != _ids(T.cached_epoch_batches(x, 8, seed=3, epoch=3, rank=1))
    assert once != _ids(T.cached_epoch_batches(x, 8, seed=4, epoch=2, rank=1))
    assert once != _ids(T.cached_epoch_batches(x, 8, seed=3, epoch=2, rank=0))


@pytest.mark.parametrize("n,bs", [(50, 8), (48, 8), (7, 10), (1, 1), (0, 4)])
def test_every_row_exactly_once_per_epoch_in_ceil_n_over_batch_batches(n, bs):
    batches = list(T.cached_epoch_batches(_rows(n), bs, seed=0, epoch=5, rank=0))
    assert len(batches) == -(-n // bs)
    assert all(b.shape[0] == bs for b in batches[:-1])
    assert sorted(i for b in _ids(batches) for i in b) == list(range(n))


def test_every_ddp_worker_runs_the_same_number_of_steps():
    """The invariant the collectives in `_revive` need: Ray Train's shards are equal-sized
    (streaming_split(equal=True)), and a cached epoch is ceil(rows / batch) steps whatever the
    rank, the same count the streaming path gives."""
    rows, bs = 37, 5
    counts = {len(list(T.cached_epoch_batches(_rows(rows) + r, bs, seed=1, epoch=e, rank=r)))
              for r in range(4) for e in range(3)}
    assert counts == {len(list(FakeShard(_rows(rows)).iter_torch_batches(bs)))} == {8}


def test_the_fits_decision_counts_rows_dim_and_bytes():
    mb = 2**20
    assert T.epoch_cache_fits(1000, 384, 512)  # the demo's catalog: ~1.5 MB
    assert T.epoch_cache_fits(mb // 4, 1, 1) and not T.epoch_cache_fits(mb // 4 + 1, 1, 1)
    assert not T.epoch_cache_fits(1000, 384, 1)
    assert T.epoch_cache_fits(mb // 2, 1, 1, itemsize=2)
    assert not T.epoch_cache_fits(1, 1, 0), "0 MB is the streaming path, whatever the size"


def test_streaming_path_calls_ray_data_exactly_as_before():
    shard = FakeShard(_rows(20))
    cfg = {"batch_size": 4, "shuffle_buffer": 16, "seed": 7}
    got = list(T._epoch_batches(shard, None, cfg, 3, 0, "cpu"))
    assert shard.calls == [{"batch_size": 4, "local_shuffle_buffer_size": 16,
                            "local_shuffle_seed": 7 * 100003 + 3, "device": "cpu"}]
    assert torch.equal(torch.cat(got), _rows(20))


def test_a_restarted_worker_rebuilds_the_same_cache_and_batches():
    x = torch.randn(30, 6)
    first, again = T._read_shard(FakeShard(x), "cpu"), T._read_shard(FakeShard(x), "cpu")
    assert torch.equal(first, x)
    cfg = {"batch_size": 4, "seed": 2}
    a = list(T._epoch_batches(None, first, cfg, 4, 1, "cpu"))
    b = list(T._epoch_batches(None, again, cfg, 4, 1, "cpu"))
    assert all(torch.equal(p, q) for p, q in zip(a, b)) and len(a) == len(b) == 8
    assert T._read_shard(FakeShard(torch.zeros(0, 6)), "cpu").shape[0] == 0


@pytest.mark.parametrize("every", [0, 3])
def test_cached_epoch_trains_the_same_items_and_steps_as_streaming(every):
    """`_run_epoch` (world 1, no Ray) over one epoch both ways: the same item count, the same
    per-level code counts in total and the same step count."""
    torch.manual_seed(0)
    x = torch.randn(45, 8)
    cfg = {"batch_size": 8, "shuffle_buffer": 16, "seed": 0, "revive_every_steps": every,
           "dead_code_threshold": 0}
    out = {}
    for name, cached in (("stream", None), ("cache", T._read_shard(FakeShard(x), "cpu"))):
        torch.manual_seed(1)
        m = RQVAE(RQVAEConfig(in_dim=8, encoder_dims=[16], code_dim=4, levels=2, codebook_size=4))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        window = torch.zeros(2, 4, dtype=torch.float64)
        batches = T._epoch_batches(FakeShard(x), cached, cfg, 0, 0, "cpu")
        counts, sums, last, _, step = T._run_epoch(m, m, opt, batches, cfg, 1, torch.device("cpu"), window, 0)
        assert last is not None and counts.sum(1).tolist() == [45.0, 45.0]
        out[name] = (int(sums[4].item()), step)
    assert out["stream"] == out["cache"] == (45, 6)


@pytest.mark.parametrize("mb,want", [(512, True), (0, False)])
def test_train_rqvae_decides_once_on_the_driver(monkeypatch, tmp_path, mb, want):
    from gti.config import SidConfig

    s = SidConfig(epochs=2, batch_size=64, num_workers=2, epoch_cache_mb=mb)
    model = RQVAE(RQVAEConfig(in_dim=384, encoder_dims=[16], code_dim=4, levels=2, codebook_size=4))
    seen = {}

    def fake_run(fn, config, datasets, spec, read, progress=None):
        seen.update(config)
        return (model, [{"epoch": 2}]), {}, ""

    monkeypatch.setattr(T.ray_train, "read_parquet_dataset", lambda *a, **k: "ds")
    monkeypatch.setattr(T.ray_train, "run_trainer", fake_run)
    T.train_rqvae(s, 0, tmp_path / "e.parquet", model, 300, tmp_path, log=lambda m: None)
    assert seen["epoch_cache"] is want
    assert seen["revive_final"] is True  # sid.revive_after_training reaches the workers


def test_checkpoint_due_after_the_last_epoch_and_every_n_seconds():
    from gti.train.rqvae_task import checkpoint_due

    assert checkpoint_due(epoch=19, epochs=20, since_last_s=0.0, every_s=30.0)  # the last: always
    assert not checkpoint_due(epoch=3, epochs=20, since_last_s=29.9, every_s=30.0)
    assert checkpoint_due(epoch=3, epochs=20, since_last_s=30.0, every_s=30.0)
    assert all(checkpoint_due(e, 5, 0.0, 0.0) for e in range(5))  # 0: every epoch


@pytest.mark.parametrize("final", [True, False])
def test_worker_loop_revives_what_greedy_codes_leave_unused_after_the_last_epoch(monkeypatch, final):
    """`sid_train_loop` on one process (the Ray Train calls replaced): with `revive_final`
    (sid.revive_after_training) the codes the greedy assignment leaves unused after the last
    epoch are re-seeded at real residuals, so the saved codebook differs from the trained one
    exactly there and the final greedy codes use more codes."""
    import contextlib

    torch.manual_seed(0)
    x = torch.cat([torch.randn(24, 6) * 0.05 + 3, torch.randn(24, 6) * 0.05 - 3])  # two tight clusters
    m = RQVAE(RQVAEConfig(in_dim=6, encoder_dims=[8], code_dim=4, levels=2, codebook_size=6, dropout=0.0))
    saved = []
    monkeypatch.setattr(T.ray_train, "worker_rank_world", lambda: (0, 1))
    monkeypatch.setattr(T.ray_train, "latest_checkpoint", lambda: contextlib.nullcontext(None))
    monkeypatch.setattr(T.ray_train, "torch_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(T.ray_train, "prepare_ddp", lambda model: model)
    monkeypatch.setattr(T.ray_train, "dataset_shard", lambda name: FakeShard(x))
    monkeypatch.setattr(T, "_save", lambda core, *a, **k: saved.append((core.codebooks.detach().clone(), a[4])))
    config = {"model": m.cfg.to_dict(), "init_state": m.state_dict(), "epochs": 2, "batch_size": 16, "lr": 0.0,
              "weight_decay": 0.0, "dead_code_threshold": 0, "seed": 0, "shuffle_buffer": 16,
              "revive_every_steps": 0, "revive_final": final, "epoch_cache": True}
    T.sid_train_loop(config)
    (book1, _), (book2, last) = saved  # lr 0: only revival moves a code
    trained = RQVAE(m.cfg)
    trained.load_state_dict({**m.state_dict(), "codebooks": book1})
    unused = [6 - int(c.unique().numel()) for c in trained.encode(x).T]
    assert all(u > 0 for u in unused)  # two tight clusters cannot use 6 codes per level
    moved = (book2 != book1).any(-1).sum(1).tolist()
    if final:
        assert last["revived"] == unused and moved == unused
        after = RQVAE(m.cfg)
        after.load_state_dict({**m.state_dict(), "codebooks": book2})
        assert sum(c.unique().numel() for c in after.encode(x).T) > sum(6 - u for u in unused)
    else:
        assert last["revived"] == [0, 0] and moved == [0, 0]
