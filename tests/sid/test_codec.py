"""Tests of gti.sid.codec: spelling, round trips, token ids through a real HF tokenizer."""

from __future__ import annotations

import random

import pytest
import torch

from gti.common.errors import DataError
from gti.sid.codec import SidCodec, SidFormatError, codes_added


def _tokenizer_with(tokens: list[str]):
    """A small in-process word-level HF tokenizer with `tokens` added (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    hf.add_tokens(tokens)
    return hf


def test_tokens_level_major_order():
    c = SidCodec(3, [2, 3, 2])
    assert c.tokens() == ["<a_0>", "<a_1>", "<b_0>", "<b_1>", "<b_2>", "<c_0>", "<c_1>"]
    assert c.num_tokens == 7
    assert c.token_rank(1, 2) == 4
    assert c.level_offsets(100).tolist() == [100, 102, 105]


def test_round_trip_random_codes():
    rng = random.Random(0)
    for fmt in ["<{level}_{code}>", "[{code}{level}]", "<|sid_{level}{code}|>"]:
        c = SidCodec(4, [256, 7, 300, 12], fmt)
        for _ in range(200):
            codes = [rng.randrange(k) for k in c.codebook_sizes]
            s = c.to_string(codes)
            assert c.from_string(s) == codes
            assert c.from_string(f"  {s}\n") == codes


def test_to_string_spelling():
    c = SidCodec(3, 256)
    assert c.to_string([12, 201, 7]) == "<a_12><b_201><c_7>"
    assert c.to_string(torch.tensor([0, 1, 2])) == "<a_0><b_1><c_2>"


@pytest.mark.parametrize(
    "bad",
    ["", "<a_1><b_2>", "<a_1><b_2><c_3><d_4>", "<b_1><a_2><c_3>", "<a_1> <b_2><c_3>",
     "<a_1><b_2><c_999>", "<a_x><b_2><c_3>", "a_1b_2c_3"],
)
def test_from_string_malformed_raises_naming_input(bad):
    c = SidCodec(3, 256)
    with pytest.raises(SidFormatError) as err:
        c.from_string(bad)
    assert repr(bad) in str(err.value) or "outside" in str(err.value)
    assert isinstance(err.value, DataError)
    assert "\n" not in str(err.value)


def test_to_string_out_of_range_raises():
    c = SidCodec(2, [4, 4])
    with pytest.raises(SidFormatError, match="outside 0..3"):
        c.to_string([1, 4])
    with pytest.raises(SidFormatError, match="2 levels"):
        c.to_string([1, 2, 3])


def test_format_must_be_unambiguous():
    with pytest.raises(ValueError):
        SidCodec(2, 4, "<{level}>")


def test_token_ids_via_tokenizer():
    c = SidCodec(3, [4, 5, 6])
    tok = _tokenizer_with(c.tokens())
    table = c.code_to_token_id_table(tok)
    assert table.shape == (3, 6)
    assert (table[0, 4:] == -1).all() and (table[1, 5:] == -1).all()
    codes = torch.tensor([[0, 0, 0], [3, 4, 5], [2, 1, 3]])
    ids = c.token_ids(codes, tok)
    assert ids.shape == (3, 3)
    for r in range(3):
        assert tok.convert_ids_to_tokens(ids[r].tolist()) == [
            c.token(lv, int(codes[r, lv])) for lv in range(3)
        ]
    # Added contiguously, so the offset arithmetic agrees with the tokenizer.
    first = tok.convert_tokens_to_ids(c.tokens()[0])
    assert torch.equal(c.token_ids_from_offset(codes, first), ids)
    assert torch.equal(c.codes_from_token_ids(ids, first), codes)
    bad = ids.clone()
    bad[1, 2] = ids[1, 0]  # a level-a token at level c
    assert c.codes_from_token_ids(bad, first)[1].tolist() == [-1, -1, -1]


def test_token_ids_unknown_token_raises():
    c = SidCodec(2, [3, 3])
    tok = _tokenizer_with(c.tokens()[:-1])  # <b_2> missing
    with pytest.raises(SidFormatError, match="<b_2>"):
        c.token_ids(torch.tensor([[0, 0]]), tok)


def test_token_ids_code_out_of_range_raises():
    c = SidCodec(2, [3, 3])
    tok = _tokenizer_with(c.tokens())
    with pytest.raises(SidFormatError, match="row 1"):
        c.token_ids(torch.tensor([[0, 0], [0, 3]]), tok)


def test_from_facts():
    c = SidCodec.from_facts({"levels": 2, "codebook_sizes": [8, 3], "token_format": "<{level}{code}>"})
    assert c == SidCodec(2, [8, 3], "<{level}{code}>")


def test_codes_added_lists_the_grown_codes_level_major():
    assert codes_added([4, 4, 2], [4, 4, 2]) == []
    assert codes_added([4, 4, 2], [4, 4, 4]) == [(2, 2), (2, 3)]
    assert codes_added([2, 2], [3, 4]) == [(0, 2), (1, 2), (1, 3)]
    grown = SidCodec(3, [4, 4, 4])
    assert [grown.token(lv, c) for lv, c in codes_added([4, 4, 2], [4, 4, 4])] == ["<c_2>", "<c_3>"]
    with pytest.raises(ValueError, match="smaller"):
        codes_added([4, 4, 2], [4, 4, 1])
    with pytest.raises(ValueError, match="levels"):
        codes_added([4, 4], [4, 4, 1])
