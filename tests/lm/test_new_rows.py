"""Vocabulary surgery: frozen old rows, split modules, merge and export (gti/lm/new_rows.py)."""

from __future__ import annotations

import pytest
import torch

from gti.lm import new_rows as V
from gti.lm.models import build_tiny

SID_TOKENS = [f"<{lvl}_{c}>" for lvl in "ab" for c in range(8)]


def _extended(cfg, markers=False, seed=0):
    model, tok = build_tiny(cfg, seed=seed)
    n_real = len(tok)
    first, end = V.extend_tokenizer(tok, SID_TOKENS, markers=markers)
    g = torch.Generator().manual_seed(1)
    d = model.config.hidden_size
    init_in = torch.randn(end - first, d, generator=g) * 0.1
    init_out = torch.randn(end - first, d, generator=g) * 0.1
    V.attach_new_rows(model, first, end - first, init_in, init_out)
    return model, tok, n_real, first, end


def test_extend_tokenizer_single_tokens_contiguous_and_idempotent(tiny_model_cfg):
    _, tok = build_tiny(tiny_model_cfg())
    n0 = len(tok)
    first, end = V.extend_tokenizer(tok, SID_TOKENS, markers=True)
    assert (first, end) == (n0, n0 + len(SID_TOKENS) + 2)
    ids = tok("item <a_3><b_7> here", add_special_tokens=False)["input_ids"]
    assert first + 3 in ids and first + 8 + 7 in ids
    assert tok.convert_ids_to_tokens(end - 1) == V.SID_END
    assert V.extend_tokenizer(tok, SID_TOKENS, markers=True) == (first, end)
    with pytest.raises(V.VocabError):
        V.extend_tokenizer(tok, SID_TOKENS + ["<c_0>"], markers=True)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("pad_to", [None, 512])
def test_old_rows_bit_identical_after_adamw_with_weight_decay(tiny_model_cfg, tied, pad_to):
    model, tok, n_real, first, end = _extended(tiny_model_cfg(tiny_tied=tied, tiny_pad_vocab_to=pad_to))
    V.freeze_backbone(model)
    emb, head = V.split_modules(model)
    old_in = emb.old_weight.detach().clone()
    old_out = head.old_weight.detach().clone()
    backbone = {n: p.detach().clone() for n, p in model.named_parameters() if "new_rows" not in n}
    new0 = [p.detach().clone() for p in V.new_rows_parameters(model)]
    assert len(new0) == (1 if tied else 2)
    assert V.heads_tied(model) is tied
    # Even if a careless caller hands every parameter to AdamW, frozen ones have no grad.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids = torch.randint(0, end, (2, 12), generator=g)
        ids[:, ::3] = torch.randint(first, end, (2, 4), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.equal(emb.old_weight, old_in)
    assert torch.equal(head.old_weight, old_out)
    for n, p in model.named_parameters():
        if "new_rows" not in n:
            assert torch.equal(p, backbone[n]), n
    for p, p0 in zip(V.new_rows_parameters(model), new0):
        assert not torch.equal(p, p0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all("new_rows" in n for n in trainable) and trainable


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("pad_to", [None, 392, 512])
def test_split_logits_equal_merged_logits(tiny_model_cfg, tied, pad_to):
    # pad_to=392: the new ids start on padding rows and run past the matrix (it must grow);
    # 512: they land on padding rows inside it.
    model, tok, n_real, first, end = _extended(tiny_model_cfg(tiny_tied=tied, tiny_pad_vocab_to=pad_to))
    assert first == n_real
    v_rows = max(pad_to or 0, n_real)
    ids = torch.tensor([[1, 5, first, first + 3, end - 1, 7, 2]])
    with torch.no_grad():
        split_logits = model(input_ids=ids).logits
    assert split_logits.shape[-1] == max(v_rows, end)
    emb, head = V.split_modules(model)
    new_in = emb.new_rows.detach().clone()
    V.merge_new_rows(model)
    assert not V.is_split(model)
    w = model.get_input_embeddings().weight
    assert w.shape[0] == max(v_rows, end) == model.config.vocab_size
    assert torch.equal(w[first:end], new_in)
    assert (model.get_output_embeddings().weight is w) is tied
    with torch.no_grad():
        merged_logits = model(input_ids=ids).logits
    torch.testing.assert_close(split_logits, merged_logits, rtol=0, atol=1e-5)


def test_padded_rows_outside_new_range_are_kept(tiny_model_cfg):
    model, tok, n_real, first, end = _extended(tiny_model_cfg(tiny_pad_vocab_to=512))
    emb, _ = V.split_modules(model)
    pad_tail = emb.old_weight[end:].detach().clone()
    V.merge_new_rows(model)
    assert torch.equal(model.get_input_embeddings().weight[end:], pad_tail)


@pytest.mark.parametrize("tied", [True, False])
def test_export_then_plain_hf_reload_gives_identical_logits(tmp_path, tiny_model_cfg, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok, n_real, first, end = _extended(tiny_model_cfg(tiny_tied=tied, tiny_pad_vocab_to=400), markers=True)
    ids = torch.tensor([[1, 9, first, first + 9, end - 2, 2]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    out = V.export_model(model, tok, tmp_path / "model", {"sid_map_hash": "abc", "new_token_ids": [first, end]})
    assert V.is_split(model)  # export merges a copy, the training model is untouched
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    assert V.read_meta(out)["new_token_ids"] == [first, end]
    re_model = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True)
    re_tok = AutoTokenizer.from_pretrained(out)
    assert len(re_tok) == end
    assert re_tok.convert_tokens_to_ids("<b_1>") == first + 9
    with torch.no_grad():
        after = re_model(input_ids=ids).logits
    torch.testing.assert_close(before, after, rtol=0, atol=1e-5)


def test_new_rows_state_roundtrip_and_old_rows(tiny_model_cfg):
    model, tok, n_real, first, end = _extended(tiny_model_cfg(tiny_tied=False))
    st = V.new_rows_state_dict(model)
    assert set(st) == {"e_new", "head_new"} and st["e_new"].shape == (end - first, 32)
    with torch.no_grad():
        for p in V.new_rows_parameters(model):
            p.zero_()
    V.load_new_rows_state_dict(model, st)
    assert torch.equal(V.new_rows_parameters(model)[1], st["head_new"])
    assert V.old_rows(model, n_real).shape == (n_real, 32)
    with pytest.raises(V.VocabError):
        V.attach_new_rows(model, first, end - first, st["e_new"])
