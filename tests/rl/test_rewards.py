"""The RL rewards (gti/rl/rewards.py) on hand-made groups: hit, rank, prefix, weighted sums, the
spec checks, and the [B, G] batch form."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from gti.rl.rewards import (
    REWARDS,
    combined_rewards,
    group_rewards,
    hit_rewards,
    parse_reward_spec,
    prefix_rewards,
    rank_discounts,
    rank_rewards,
)

T = (1, 2, 3)  # the target SID (codes per level)


def _z(g: int) -> float:
    return sum(1.0 / math.log2(r + 1) for r in range(1, g + 1))


def test_hit():
    assert hit_rewards([(1, 2, 4), T, (0, 2, 3)], T) == [0.0, 1.0, 0.0]
    assert hit_rewards([(3, 2, 1)], T) == [0.0]


def test_rank_discounts_sum_to_one_and_fall():
    d = rank_discounts(5)
    assert math.isclose(sum(d), 1.0) and all(a > b for a, b in itertools.pairwise(d))
    assert d[0] == pytest.approx(1.0 / _z(5)) and d[2] == pytest.approx(0.5 / _z(5))
    with pytest.raises(ValueError, match="group_size"):
        rank_discounts(0)


def test_rank_target_at_rank_three():
    # Ranks 1 and 2 are wrong and above the target: -D(r)/Z; the target +1; rank 4 below it: 0.
    got = rank_rewards([(9, 9, 9), (1, 2, 4), T, (1, 0, 0)], T)
    z = _z(4)
    assert got == pytest.approx([-1.0 / z, -(1.0 / math.log2(3)) / z, 1.0, 0.0])


def test_rank_target_first_penalises_nothing():
    assert rank_rewards([T, (1, 2, 4), (5, 5, 5)], T) == [1.0, 0.0, 0.0]


def test_rank_without_the_target_gives_no_signal():
    assert rank_rewards([(9, 9, 9), (8, 8, 8), (7, 7, 7), (6, 6, 6)], T) == [0.0] * 4


def test_rank_target_last_penalises_every_wrong_candidate_by_rank():
    got = rank_rewards([(9, 9, 9), (8, 8, 8), (7, 7, 7), T], T)
    d = rank_discounts(4)
    assert got == pytest.approx([-d[0], -d[1], -d[2], 1.0])
    assert got[0] < got[1] < got[2] < 0


def test_rank_duplicates_of_the_target_all_score_one():
    assert rank_rewards([(0, 0, 0), T, T], T) == pytest.approx([-1.0 / _z(3), 1.0, 1.0])


def test_prefix_counts_leading_levels():
    got = prefix_rewards([T, (1, 2, 9), (1, 9, 3), (9, 2, 3)], T)
    assert got == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])


def test_codes_or_token_ids_give_the_same_rewards():
    """Level l code c spelled as token 64 + 8l + c: per-level comparisons are unchanged."""
    codes = [(1, 2, 4), (1, 2, 3), (0, 2, 3), (1, 5, 3)]
    tok = [tuple(64 + 8 * lv + c for lv, c in enumerate(s)) for s in codes]
    tgt = tuple(64 + 8 * lv + c for lv, c in enumerate(T))
    for name, fn in REWARDS.items():
        assert fn(codes, T) == fn(tok, tgt), name


def test_combined_is_the_weighted_sum():
    cands = [(1, 2, 9), T, (9, 9, 9)]
    got = combined_rewards(cands, T, {"hit": 1.0, "prefix": 0.5})
    assert got == pytest.approx([0.5 * 2 / 3, 1.5, 0.0])
    assert combined_rewards(cands, T, "hit") == [0.0, 1.0, 0.0]
    with_rank = combined_rewards(cands, T, {"rank": 2.0, "hit": -1.0})
    assert with_rank == pytest.approx([-2.0 / _z(3), 1.0, 0.0])
    # Without the target in the group only prefix gives a signal.
    miss = [(1, 2, 9), (1, 9, 9), (9, 9, 9)]
    assert combined_rewards(miss, T, {"rank": 1.0, "prefix": 0.5}) == pytest.approx([1 / 3, 1 / 6, 0.0])


def test_spec_parsing_and_errors():
    assert parse_reward_spec("rank") == {"rank": 1.0}
    assert parse_reward_spec({"hit": 1, "prefix": 0.5}) == {"hit": 1.0, "prefix": 0.5}
    with pytest.raises(ValueError, match=r"unknown reward 'ndcg'.*\['hit', 'prefix', 'rank'\]"):
        parse_reward_spec({"hit": 1.0, "ndcg": 0.5})
    with pytest.raises(ValueError, match="unknown reward 'recall'"):
        combined_rewards([T], T, "recall")
    with pytest.raises(ValueError, match="finite"):
        parse_reward_spec({"hit": float("nan")})
    with pytest.raises(ValueError, match="finite"):
        parse_reward_spec({"hit": "1"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="zero"):
        parse_reward_spec({"hit": 0.0})
    with pytest.raises(ValueError, match="empty"):
        parse_reward_spec({})


def test_group_shape_errors():
    with pytest.raises(ValueError, match="levels"):
        hit_rewards([(1, 2)], T)
    with pytest.raises(ValueError, match="at least one candidate"):
        prefix_rewards([], T)


def test_group_rewards_batch():
    groups = [[T, (1, 2, 0)], [(5, 5, 5), (1, 9, 9)]]
    r = group_rewards(groups, [T, T], {"hit": 1.0, "prefix": 1.0})
    assert r.dtype == torch.float32 and r.shape == (2, 2)
    torch.testing.assert_close(r, torch.tensor([[2.0, 2 / 3], [0.0, 1 / 3]]))
    assert group_rewards([], [], "hit").shape == (0, 0)
    with pytest.raises(ValueError, match="same number"):
        group_rewards([[T], [T, T]], [T, T], "hit")
    with pytest.raises(ValueError, match="targets"):
        group_rewards([[T]], [T, T], "hit")
