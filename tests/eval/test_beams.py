"""The shared decoding plumbing (gti/eval/beams.py): prompt batches, left padding with real
positions, final-beam selection, result concatenation and the near-tie agreement check."""

from __future__ import annotations

import pytest
import torch

from gti.eval.beams import (
    NEG_INF,
    DecodeResult,
    as_prompt_lists,
    chunks,
    finalise,
    left_pad,
    model_device,
    topk_agreement,
)


def test_as_prompt_lists_accepts_lists_and_2d_tensors_only():
    assert as_prompt_lists([[1, 2], (3,)]) == [[1, 2], [3]]
    assert as_prompt_lists(torch.tensor([[4, 5], [6, 7]])) == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        as_prompt_lists([[1], []])
    with pytest.raises(ValueError, match=r"\[U, T\]"):
        as_prompt_lists(torch.tensor([1, 2, 3]))


def test_left_pad_counts_positions_over_real_tokens_only():
    ids, mask, pos = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    # The short prompt's real token is at position 0, as if it were alone in the batch.
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]


def test_chunks_cover_the_range_in_order():
    assert [(s.start, s.stop) for s in chunks(7, 3)] == [(0, 3), (3, 6), (6, 7)]
    assert list(chunks(0, 3)) == []


def test_model_device_is_where_the_parameters_are():
    assert model_device(torch.nn.Linear(2, 2)) == torch.device("cpu")


class _Catalog:
    """Two-level trie of three items: rows 0..2 = (10, 20), (10, 21), (11, 20)."""

    vocab_new_start, vocab_new_end = 10, 22
    sids = {(10, 20): 0, (10, 21): 1, (11, 20): 2}

    def item_index(self, sid_ids: torch.Tensor) -> torch.Tensor:
        return torch.tensor([self.sids.get(tuple(r), -1) for r in sid_ids.tolist()], dtype=torch.long)


def test_finalise_keeps_valid_beams_in_score_order_and_counts_invalid_ones():
    # One user, 4 beams best first: valid, INVALID, valid, -inf (fewer candidates than beams).
    seqs = torch.tensor([[[10, 21], [11, 21], [11, 20], [10, 20]]])
    scores = torch.tensor([[-0.5, -1.0, -2.0, NEG_INF]])
    res = finalise(seqs, scores, _Catalog(), k=3, timings={"total_s": 1.0})
    assert res.items.tolist() == [[1, 2, -1]], "the invalid beam is skipped; a pad fills the K-th slot"
    assert res.scores[0, :2].tolist() == [-0.5, -2.0] and res.scores[0, 2] == NEG_INF
    assert res.sid_ids.tolist() == [[[10, 21], [11, 20], [-1, -1]]]
    assert res.n_returned == 3 and res.n_invalid == 1, "top-K finite beams, one of them invalid"
    assert res.invalid_sid_rate == pytest.approx(1 / 3)
    assert torch.equal(res.beam_sids, seqs) and res.timings == {"total_s": 1.0}


def test_concat_stacks_users_and_adds_counts_and_timings():
    seqs = torch.tensor([[[10, 20], [11, 21]]])
    scores = torch.tensor([[-1.0, -2.0]])
    a = finalise(seqs, scores, _Catalog(), k=2, timings={"total_s": 1.0, "prefill_s": 0.5})
    b = finalise(seqs, scores, _Catalog(), k=2, timings={"total_s": 2.0})
    both = DecodeResult.concat([a, b])
    assert both.items.tolist() == [[0, -1], [0, -1]]
    assert both.n_returned == 4 and both.n_invalid == 2
    assert both.timings == {"total_s": 3.0, "prefill_s": 0.5}
    assert DecodeResult.concat([a]) is a
    assert DecodeResult(a.items[:0], a.scores[:0], a.sid_ids[:0], a.beam_sids[:0], a.beam_scores[:0]).invalid_sid_rate == 0.0


def test_topk_agreement_treats_near_ties_as_equal():
    def res(items, scores):
        it, sc = torch.tensor([items]), torch.tensor([scores])
        return DecodeResult(it, sc, it.unsqueeze(-1), it.unsqueeze(-1), sc)

    a = res([1, 2, 3], [-1.0, -2.0, -2.00001])
    assert topk_agreement(a, res([1, 3, 2], [-1.0, -2.00001, -2.0]))["identical_users"] == 1
    assert topk_agreement(a, res([1, 2, 4], [-1.0, -2.0, -2.00001]))["identical_users"] == 1
    assert topk_agreement(a, res([2, 1, 3], [-1.0, -2.0, -2.00001]))["identical_users"] == 0
    assert topk_agreement(a, res([1, 2, 3], [-1.0, -2.5, -2.6]))["mismatched_users"] == [0]
