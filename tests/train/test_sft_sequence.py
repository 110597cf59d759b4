"""Tests for the `sequence` SFT objective (gti/train/sft_data.training_sequences,
gti/lm/templates.RecRenderer.sequence_row, SftConfig.objective): every item a target, and a
training row that scores each target exactly as evaluation scores the same history."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch

from gti.common.errors import ConfigError, DataError
from gti.lm import templates as T
from gti.lm.chat import IGNORE
from gti.train import sft_data as S


def _seqs(n_users: int = 40, seed: int = 0) -> pl.DataFrame:
    """Users with 0..14 training items; valid/test items unique to each user."""
    rng = np.random.default_rng(seed)
    return pl.DataFrame([
        {"user_id": f"u{u}", "train_items": [f"i{int(x)}" for x in rng.integers(0, 12, int(rng.integers(0, 15)))],
         "valid_item": f"v_{u}", "test_item": f"t_{u}"}
        for u in range(n_users)
    ])


@pytest.mark.parametrize("h", [1, 2, 3, 5, 20])
def test_every_training_target_is_in_exactly_one_chunk(h):
    seqs = _seqs()
    chunks = S.training_sequences(seqs, h)
    assert chunks["items"].list.len().min() >= 2 and chunks["items"].list.len().max() <= h + 1
    for user, items in zip(seqs["user_id"], seqs["train_items"]):
        mine = chunks.filter(pl.col("user_id") == user).sort("chunk")
        # the targets of a chunk are its items after the first, keyed by their position
        targets = []
        start = 0
        for c, its in zip(mine["chunk"], mine["items"]):
            assert c * h == start and list(its) == list(items[start:start + h + 1])
            targets += list(range(start + 1, start + len(its)))
            start += h
        assert targets == list(range(1, len(items)))  # each target once, none missed


def test_sequence_chunks_never_hold_a_valid_or_test_item():
    seqs = _seqs(80, seed=3)
    chunks = S.training_sequences(seqs, 3)
    held_out = set(seqs["valid_item"]) | set(seqs["test_item"])
    assert not held_out & set(chunks["items"].explode().to_list())
    assert set(chunks["items"].explode().to_list()) <= set(seqs["train_items"].explode().drop_nulls().to_list())


def test_chunk_history_shrinks_to_max_len():
    assert S.sequence_chunk_history(20, 200, 3) == 20
    assert S.sequence_chunk_history(20, 30, 3) == 9  # 10 items of 3 tokens
    assert S.sequence_chunk_history(3, 12, 5) == 1
    with pytest.raises(ConfigError, match="sft.max_len=9"):
        S.sequence_chunk_history(3, 9, 5)


def _tiny(markers: bool):
    """(tokenizer with 2x4 SID tokens, item -> SID ids for 12 items, tiny random Llama)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from gti.lm import models, new_rows
    from gti.sid.codec import SidCodec

    tok = models.build_tiny_tokenizer()
    codec = SidCodec(2, [4, 3])
    new_rows.extend_tokenizer(tok, codec.tokens(), markers=markers)
    codes = np.array([[i // 3, i % 3] for i in range(12)])
    ids = codec.token_ids(codes, tok).numpy()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).eval()
    return tok, {f"i{k}": ids[k] for k in range(12)}, model


@pytest.mark.parametrize("markers", [False, True])
def test_sequence_row_labels_every_item_after_the_first(markers):
    tok, sid_ids, _ = _tiny(markers)
    r = T.make_renderer(tok, sid_ids, "", max_len=200, prompt_style="sequence")
    items = ["i3", "i7", "i1", "i9"]
    row = r.sequence_row(items)
    per_item = [r.item_ids(i) for i in items]
    assert row["input_ids"] == [t for p in per_item for t in p]
    assert row["labels"] == [IGNORE] * len(per_item[0]) + [t for p in per_item[1:] for t in p]
    assert r.eot_ids == []  # no end of turn between items
    # evaluation prompt of history items[:t] = the row's tokens before item t (+ <sid_start>)
    for t in range(1, len(items)):
        prompt, kept = r.prompt(items[:t])
        start = sum(len(p) for p in per_item[:t])
        assert kept == t
        assert prompt == row["input_ids"][:start + (1 if markers else 0)]
    with pytest.raises(DataError, match=">= 2 items"):
        r.sequence_row(["i1"])
    with pytest.raises(ConfigError, match="sft.max_len=5"):
        T.make_renderer(tok, sid_ids, "", max_len=5, prompt_style="sequence").sequence_row(items)


@pytest.mark.parametrize("markers", [False, True])
def test_sequence_row_scores_each_target_as_evaluation_scores_its_window(markers):
    """The invariant that makes the objective correct: in one forward pass over a sequence row,
    item t's SID-token log-probs equal those evaluation computes from the window prompt of the
    same history (gti.eval.rank.score_catalog on `RecRenderer.prompt`), to float tolerance."""
    from gti.eval.rank import score_catalog

    tok, sid_ids, model = _tiny(markers)
    r = T.make_renderer(tok, sid_ids, "", max_len=200, prompt_style="sequence")
    item_ids = list(sid_ids)
    mat = torch.from_numpy(np.stack([sid_ids[i] for i in item_ids]))
    items = ["i3", "i7", "i1", "i9", "i4"]
    row = torch.tensor([r.sequence_row(items)["input_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(row).logits.float(), -1)[0]
    per_item = [r.item_ids(i) for i in items]
    prompts = [r.prompt(items[:t])[0] for t in range(1, len(items))]
    scores = score_catalog(model, prompts, mat, pad_id=tok.pad_token_id, batch_users=2)
    checked = 0
    for t in range(1, len(items)):
        start = sum(len(p) for p in per_item[:t]) + (1 if markers else 0)  # first SID code of item t
        codes = sid_ids[items[t]].tolist()
        in_row = sum(float(logp[start + j - 1, c]) for j, c in enumerate(codes))
        # the same history rendered alone as a window row, the way window SFT would see it
        window = torch.tensor([prompts[t - 1] + codes])
        with torch.no_grad():
            wlp = torch.log_softmax(model(window).logits.float(), -1)[0]
        in_window = sum(float(wlp[len(prompts[t - 1]) + j - 1, c]) for j, c in enumerate(codes))
        assert in_row == pytest.approx(in_window, abs=1e-4)
        assert in_row == pytest.approx(float(scores[t - 1, item_ids.index(items[t])]), abs=1e-4)
        checked += 1
    assert checked == len(items) - 1


def test_objective_config():
    from gti.config.train import SftConfig

    assert SftConfig().render_style == "chat"
    assert SftConfig(prompt_style="compact").render_style == "compact"
    assert SftConfig(objective="sequence").render_style == "sequence"
    assert SftConfig(objective="sequence", prompt_style="compact").render_style == "sequence"
    # a dumped config holds the default prompt_style too, so it is ignored rather than refused
    assert SftConfig(objective="sequence", prompt_style="chat").render_style == "sequence"
    assert SftConfig.model_validate(SftConfig(objective="sequence").model_dump()).render_style == "sequence"
    with pytest.raises(Exception, match="objective"):
        SftConfig(objective="windows")
    with pytest.raises(Exception, match="epochs"):
        SftConfig(epochs=0)


def test_epochs_resolve_to_steps():
    from gti.config import RunConfig
    from gti.stages.sft import resolve_budget

    cfg = RunConfig.model_validate({"sft": {"steps": 7, "batch_size": 16}})
    assert resolve_budget(cfg, 1000).sft.steps == 7  # no epochs: steps as given
    cfg = RunConfig.model_validate({"sft": {"steps": 7, "batch_size": 16, "epochs": 2.5}})
    assert resolve_budget(cfg, 1000).sft.steps == 157  # ceil(2.5 * 1000 / 16)
    assert resolve_budget(cfg, 1).sft.steps == 1


def test_loaded_run_refuses_a_model_trained_on_other_prompts(tmp_path):
    import json

    from gti.config import RunConfig
    from gti.lm.new_rows import META_NAME
    from gti.run.loaded import check_render_style

    (tmp_path / META_NAME).write_text(json.dumps({"render_style": "sequence"}))
    check_render_style(tmp_path, RunConfig.model_validate({"sft": {"objective": "sequence"}}))
    with pytest.raises(ConfigError, match="trained on 'sequence' prompts but the config renders 'compact'"):
        check_render_style(tmp_path, RunConfig.model_validate({"sft": {"prompt_style": "compact"}}))
    (tmp_path / META_NAME).write_text(json.dumps({}))  # older exports: nothing recorded, not checked
    check_render_style(tmp_path, RunConfig.model_validate({}))
