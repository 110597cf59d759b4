"""gti.train.engine: the DeepSpeed engine of a worker. A one-rank ZeRO-0 engine skips the
gradient all-reduce and trains bit for bit like DeepSpeed's own engine; other settings keep it."""

from __future__ import annotations

import pytest
import torch

from gti.config import ModelConfig
from gti.config.train import SftConfig
from gti.lm import models
from gti.train.deepspeed_config import build_ds_config
from gti.train.engine import SchedulerFactory, make_engine, skips_gradient_allreduce


def test_only_one_rank_at_zero_stage_0_skips_the_allreduce():
    assert skips_gradient_allreduce(1, 0)
    assert not skips_gradient_allreduce(2, 0)
    for stage in (1, 2, 3):
        assert not skips_gradient_allreduce(1, stage)


def _model():
    model, tok = models.build_tiny(ModelConfig(name="tiny", tiny_hidden=32, tiny_layers=2, tiny_heads=2), seed=0)
    model.train()
    return model, len(tok)


def _train(engine, vocab: int, micro_steps: int) -> int:
    """`micro_steps` forward/backward/step calls on fixed batches; the number of gradient
    all-reduces DeepSpeed ran meanwhile."""
    calls = 0
    reduce = engine.allreduce_gradients

    def counting(*a, **k):
        nonlocal calls
        calls += 1
        return reduce(*a, **k)

    engine.allreduce_gradients = counting
    g = torch.Generator().manual_seed(0)
    for _ in range(micro_steps):
        ids = torch.randint(0, vocab, (4, 12), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    return calls


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_one_rank_zero0_engine_skips_the_allreduce_and_trains_bit_identically(single_process_dist_env, grad_accum):
    import deepspeed

    tc = SftConfig(zero_stage=0, batch_size=4 * grad_accum, grad_accum=grad_accum, lr=1e-2, steps=3,
                   weight_decay=0.1, max_grad_norm=0.5)
    ours_model, vocab = _model()
    ours, _ = make_engine(ours_model, list(ours_model.parameters()), tc, 1, use_gpu=False, bf16_weights=False)
    ref_model, _ = _model()
    ref, _, _, _ = deepspeed.initialize(  # DeepSpeed as it comes: the all-reduce on
        model=ref_model, model_parameters=list(ref_model.parameters()),
        config=build_ds_config(tc, 1, use_gpu=False), lr_scheduler=SchedulerFactory(tc.schedule, 0, tc.steps))
    assert _train(ours, vocab, 3 * grad_accum) == 0
    assert _train(ref, vocab, 3 * grad_accum) >= 3  # what the skip saves: one per optimizer step at least
    start, _ = _model()
    moved = False
    for (name, a), b, s in zip(ours.module.named_parameters(), ref.module.parameters(), start.parameters()):
        assert torch.equal(a.detach(), b.detach()), f"{name} differs from DeepSpeed's own engine"
        moved |= not torch.equal(a.detach(), s.detach())
    assert moved


def test_other_zero_stages_keep_deepspeeds_reduction(single_process_dist_env):
    model, _ = _model()
    tc = SftConfig(zero_stage=2, batch_size=4, lr=1e-2, steps=2)
    engine, _ = make_engine(model, list(model.parameters()), tc, 1, use_gpu=False, bf16_weights=False)
    assert engine.enable_backward_allreduce is True
