"""Growing an extended vocabulary (gti/lm/grow_vocab.py): tokens appended to a model that already has
SID rows keep every old row bit-identical, start at their level's mean, encode as one token each
and survive an export / reload (tied and untied heads, a matrix padded past its tokenizer)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gti.lm import grow_vocab
from gti.lm import new_rows as V
from gti.lm.models import build_tiny

SID = [f"<{lvl}_{c}>" for lvl, k in (("a", 4), ("b", 3)) for c in range(k)]
ADDED = ["<b_3>", "<b_4>"]


def _grounded(cfg):
    """A tiny model whose tokenizer has the SID tokens and whose SID rows are distinct (as after
    grounding): (model, tokenizer, [first, end) of the SID tokens)."""
    model, tok = build_tiny(cfg, seed=0)
    first, end = V.extend_tokenizer(tok, SID)
    g = torch.Generator().manual_seed(3)
    d = model.config.hidden_size
    V.attach_new_rows(model, first, end - first, torch.randn(end - first, d, generator=g),
                      torch.randn(end - first, d, generator=g))
    V.merge_new_rows(model)
    return model, tok, first, end


def _weights(model):
    head = model.get_output_embeddings()
    return model.get_input_embeddings().weight.detach().clone(), head.weight.detach().clone()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("pad_to", [None, 512])
def test_appended_rows_are_the_level_mean_and_old_rows_stay(tiny_model_cfg, tied, pad_to, tmp_path):
    model, tok, first, end = _grounded(tiny_model_cfg(tiny_tied=tied, tiny_pad_vocab_to=pad_to))
    w_in, w_out = _weights(model)
    n_tok = len(tok)
    level_b = tok.convert_tokens_to_ids(["<b_0>", "<b_1>", "<b_2>"])
    a, b = grow_vocab.append_tokens(model, tok, ADDED, level_b)
    assert (a, b) == (n_tok, n_tok + 2) and len(tok) == b
    e_in, e_out = _weights(model)
    # every old row bit-identical (padding rows the new ids do not take included)
    assert torch.equal(e_in[:a], w_in[:a]) and torch.equal(e_in[b:], w_in[b:])
    assert torch.equal(e_out[:a], w_out[:a])
    assert e_in.shape[0] == max(w_in.shape[0], b) and model.config.vocab_size == e_in.shape[0]
    # the added rows: the mean of level b's rows, in the input matrix and in an untied head
    want_in = w_in[level_b].mean(0)
    assert all(torch.equal(e_in[i], want_in) for i in range(a, b))
    want_out = w_out[level_b].mean(0)
    assert all(torch.equal(e_out[i], want_out) for i in range(a, b))
    assert V.heads_tied(model) is tied
    if not tied:
        assert not torch.equal(want_in, want_out)
    # one token each, in the tokenizer and through an export / reload
    assert tok("x <b_4><a_1>", add_special_tokens=False)["input_ids"][-2:] == [a + 1, first + 1]
    out = V.export_model(model, tok, tmp_path / "m", {"sid_map_hash": "h"})
    tok2 = AutoTokenizer.from_pretrained(str(out))
    assert tok2.convert_tokens_to_ids(ADDED) == [a, a + 1] and tok2.convert_ids_to_tokens(a + 1) == "<b_4>"
    assert tok2.convert_tokens_to_ids(SID) == list(range(first, end))
    back = AutoModelForCausalLM.from_pretrained(str(out), use_safetensors=True)
    assert torch.equal(back.get_input_embeddings().weight, e_in)
    assert torch.equal(back.get_output_embeddings().weight, e_out)
    logits = back(input_ids=torch.tensor([[first, a, a + 1]])).logits
    assert logits.shape[-1] >= b and torch.isfinite(logits).all()


def test_tokens_already_present_or_no_level_rows_are_refused(tiny_model_cfg):
    model, tok, first, end = _grounded(tiny_model_cfg())
    n = len(tok)
    with pytest.raises(V.VocabError, match="'<b_2>' is in the tokenizer already"):
        grow_vocab.append_tokens(model, tok, ["<b_2>", "<b_3>"], [first])
    with pytest.raises(V.VocabError, match="no existing rows"):
        grow_vocab.append_tokens(model, tok, ["<b_3>"], [])
    with pytest.raises(V.VocabError, match="outside"):
        grow_vocab.level_mean(torch.zeros(4, 2), [5])
    assert len(tok) == n and not V.is_split(model)  # nothing half-done
    assert torch.equal(grow_vocab.level_mean(torch.tensor([[1.0, 2.0], [3.0, 6.0], [9.0, 9.0]]), [0, 1]),
                       torch.tensor([2.0, 4.0]))
