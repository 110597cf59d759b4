"""Model resolution, loading and the tiny model (gti/lm/models.py)."""

from __future__ import annotations

import pytest
import torch

from gti.config import ModelConfig
from gti.lm import models as M


def test_tiny_is_deterministic_and_padded(tiny_model_cfg):
    cfg = tiny_model_cfg(tiny_pad_vocab_to=500, tiny_tied=False)
    m1, t1 = M.build_tiny(cfg, seed=3)
    m2, t2 = M.build_tiny(cfg, seed=3)
    m3, _ = M.build_tiny(cfg, seed=4)
    assert t1.get_vocab() == t2.get_vocab()
    assert m1.get_input_embeddings().weight.shape == (500, 32) and len(t1) < 500
    assert m1.get_output_embeddings().weight is not m1.get_input_embeddings().weight
    for (n, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n
    assert not torch.equal(m1.get_input_embeddings().weight, m3.get_input_embeddings().weight)


def test_tiny_tokenizer_chat_template_and_specials(tiny_model_cfg):
    _, tok = M.build_tiny(tiny_model_cfg())
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Which item has the title: Glass beaker?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "Glass beaker" in text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id != tok.eos_token_id
    # byte-level: any UTF-8 text round-trips
    s = "Bécher en verre 500 ml — ∅ 8 cm"
    assert tok.decode(tok(s, add_special_tokens=False)["input_ids"]) == s


def test_tiny_save_and_load_like_a_real_model(tmp_path, tiny_model_cfg):
    cfg = tiny_model_cfg()
    model, tok = M.build_tiny(cfg)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    m2, t2 = M.load_model_and_tokenizer(ModelConfig(name=str(tmp_path / "m")))
    assert t2.chat_template == tok.chat_template and len(t2) == len(tok)
    ids = torch.tensor([[1, 30, 40, 2]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, m2(input_ids=ids).logits)


def test_resolution_of_paths_and_hub_ids(tmp_path):
    assert M.resolve_model_path(ModelConfig(name="Qwen/Qwen3-0.6B")) == "Qwen/Qwen3-0.6B"
    with pytest.raises(M.ModelError, match="model.name"):
        M.resolve_model_path(ModelConfig(name=str(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(M.ModelError, match="config.json"):
        M.resolve_model_path(ModelConfig(name=str(tmp_path / "empty")))


def test_loading_refuses_pickle_weights(tmp_path, tiny_model_cfg):
    model, tok = M.build_tiny(tiny_model_cfg())
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    # Replace the safetensors file by a pickle checkpoint: it must not be loaded.
    (tmp_path / "m" / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(M.ModelError, match="cannot load"):
        M.load_model_and_tokenizer(ModelConfig(name=str(tmp_path / "m")))


@pytest.mark.slow
def test_smollm2_converts_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GTI_CACHE", str(tmp_path / "cache"))
    cfg = ModelConfig(name="smollm2-135m")
    path = M.resolve_model_path(cfg)
    assert path == tmp_path / "cache" / "models" / "smollm2-135m"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert M.resolve_model_path(cfg) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not converted twice
    model, tok = M.load_model_and_tokenizer(cfg)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == 49152 and model.config.hidden_size == 576
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert len(tok) == 49152 and tok.chat_template
    # Its chat template renders through gti.lm.templates exactly like the whole-text render.
    from gti.common.arms import DEFAULT_GROUNDING_TEMPLATES
    from gti.lm.templates import PairRenderer
    from gti.lm.chat import end_of_turn_ids
    from gti.lm.new_rows import extend_tokenizer

    first, _ = extend_tokenizer(tok, ["<a_0>", "<a_1>", "<b_0>", "<b_1>"])
    assert first == 49152 and tok.convert_ids_to_tokens(end_of_turn_ids(tok)) == ["<|im_end|>"]
    row = PairRenderer(tok, DEFAULT_GROUNDING_TEMPLATES, "You are a helpful assistant.", 128).render_item(
        "Glass beaker 500 ml", "Borosilicate.", [first + 1, first + 2])[0]
    text = tok.apply_chat_template(
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Which item has the title: Glass beaker 500 ml?"}],
        tokenize=False, add_generation_prompt=True)
    assert row["prompt_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert row["answer_ids"] == [first + 1, first + 2, *end_of_turn_ids(tok)]


def test_parallel_resolution_converts_once(tmp_path, monkeypatch):
    """Workers resolving smollm2 at the same time: one converts under the lock, the others
    wait and reuse the folder; nobody sees a half-written folder."""
    import threading
    import time

    monkeypatch.setenv("GTI_CACHE", str(tmp_path))
    calls = []

    def fake_convert(gguf, out_dir, log=print):
        calls.append(out_dir)
        time.sleep(0.3)
        tmp = out_dir.parent / ".tmp-fake"
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(b"x")
        tmp.rename(out_dir)

    monkeypatch.setattr(M, "_smollm2_gguf", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(M, "_convert_gguf", fake_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(M.resolve_model_path(ModelConfig()))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [tmp_path / "models" / "smollm2-135m"] * 3
