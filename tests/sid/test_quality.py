"""gti/sid/quality.py: code usage per level and the quality gates."""

from __future__ import annotations

import math

import pytest
import torch

from gti.common.errors import GateError
from gti.sid.quality import check_gates, level_usage


def test_usage_and_perplexity_per_level():
    codes = torch.tensor([[0, 1], [1, 1], [2, 1], [3, 1]])
    util, perp = level_usage(codes, [4, 8])
    assert util == [1.0, 1 / 8]
    assert perp[0] == pytest.approx(4.0) and perp[1] == pytest.approx(1.0)
    assert math.isfinite(level_usage(torch.zeros(0, 1, dtype=torch.long), [2])[1][0])


def test_gates_fail_with_the_stats_in_one_message():
    check_gates([0.9, 0.8], 0.0, 0.5, 0.01)
    with pytest.raises(GateError, match="0.2"):
        check_gates([0.9, 0.2], 0.0, 0.5, 0.01, {"perplexity": [3.0, 1.1]})
    with pytest.raises(GateError):
        check_gates([0.9, 0.9], 0.05, 0.5, 0.01)


def test_usage_from_summed_counts_equals_usage_of_the_whole_array():
    import numpy as np

    from gti.sid.quality import usage_from_counts

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 5, (300, 3), generator=g)
    codes[:, 2] = torch.randint(0, 9, (300,), generator=g)  # past the size: counts grow, as bincount's
    sizes = [5, 6, 7]
    counts = [sum(np.bincount(codes[s : s + 64, lv].numpy(), minlength=k) for s in range(0, 300, 64))
              for lv, k in enumerate(sizes)]
    assert usage_from_counts(counts, sizes) == level_usage(codes, sizes)  # exactly, not approx
