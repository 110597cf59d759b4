"""gti.train.best: the best validation is kept (the start counts), ties keep the earlier step,
the stop rule, and a checkpoint record restores it (tensors on the keeping rank only)."""

from __future__ import annotations

import pytest
import torch

from gti.train.best import BestKeeper


def _snap(step):
    return lambda: {"w": torch.full((2,), float(step))}


def test_the_best_validation_is_kept_and_the_start_counts():
    k = BestKeeper("val_mrr")
    assert k.observe(0, {"val_mrr": 0.30}, _snap(0)) is False
    assert k.observe(2, {"val_mrr": 0.25}, _snap(2)) is False
    assert (k.step, k.value, k.start) == (0, 0.30, 0.30) and torch.equal(k.state["w"], torch.zeros(2))
    k.observe(4, {"val_mrr": 0.40}, _snap(4))
    k.observe(6, {"val_mrr": 0.40}, _snap(6))  # a tie keeps the earlier step
    assert (k.step, k.value) == (4, 0.40) and torch.equal(k.state["w"], torch.full((2,), 4.0))


def test_the_stop_rule_and_the_snapshot_only_on_a_new_best():
    calls = []
    k = BestKeeper("val_mrr", stop_margin=0.05, keep=False)
    k.observe(0, {"val_mrr": 0.30}, lambda: calls.append(0) or {})
    assert k.observe(2, {"val_mrr": 0.26}, lambda: calls.append(2) or {}) is False  # within the margin
    assert k.observe(4, {"val_mrr": 0.24}, lambda: calls.append(4) or {}) is True
    assert calls == [0] and k.state is None  # a non-keeping rank follows the decisions only
    with pytest.raises(KeyError, match="no 'val_mrr'"):
        k.observe(6, {"val_loss": 1.0}, _snap(6))


def test_a_record_restores_the_keeper():
    k = BestKeeper("val_mrr")
    k.observe(0, {"val_mrr": 0.3}, _snap(0))
    k.observe(2, {"val_mrr": 0.5}, _snap(2))
    again = BestKeeper("val_mrr")
    again.restore(k.record(), k.state)
    assert again.record() == {"metric": "val_mrr", "start": 0.3, "value": 0.5, "step": 2}
    assert again.observe(4, {"val_mrr": 0.4}, _snap(4)) is False and again.step == 2
    other = BestKeeper("val_mrr", keep=False)
    other.restore(k.record(), k.state)
    assert other.state is None and other.step == 2
