"""gti.train.schedule: warmup and decay multipliers, and that LambdaLR uses them per step."""

from __future__ import annotations

import math

import pytest
import torch

from gti.train.schedule import LrMultiplier


def test_constant_without_warmup_is_one_from_the_first_step():
    m = LrMultiplier("constant", 0, 10)
    assert [m(s) for s in range(10)] == [1.0] * 10


def test_warmup_is_linear_and_never_zero():
    m = LrMultiplier("constant", 4, 10)
    assert [m(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decays_to_zero_at_total_and_not_before():
    m = LrMultiplier("linear", 2, 12)
    vals = [m(s) for s in range(12)]
    assert vals[:2] == [0.5, 1.0]
    assert vals[2] == 1.0 and vals[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(vals[2:], vals[3:]))
    assert m(12) == 0.0


def test_cosine_halfway_is_half():
    m = LrMultiplier("cosine", 0, 10)
    assert m(0) == 1.0
    assert m(5) == pytest.approx(0.5)
    assert m(10) == pytest.approx(0.0, abs=1e-12)
    assert m(3) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.3)))


def test_unknown_schedule_rejected():
    with pytest.raises(ValueError, match="unknown schedule"):
        LrMultiplier("step", 0, 10)


def test_lambdalr_state_roundtrip_keeps_position():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, LrMultiplier("linear", 0, 10))
    lrs = []
    for _ in range(4):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1.0, 0.9, 0.8, 0.7])
    state = sched.state_dict()
    opt2 = torch.optim.AdamW([p], lr=1.0)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, LrMultiplier("constant", 0, 1))
    sched2.load_state_dict(state)
    # The multiplier's settings travel with the state dict, so the restored schedule continues.
    assert sched2.lr_lambdas[0].schedule == "linear"
    opt2.step()
    sched2.step()
    assert sched2.get_last_lr()[0] == pytest.approx(0.5)
