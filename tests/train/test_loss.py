"""gti.train.loss: the labelled-positions-only causal-LM loss equals HF's `.loss` (value and
gradients) for tied / untied heads, split new-row modules and LoRA, on right-padded batches;
and through a single-process DeepSpeed engine for ZeRO 0-3 (slow)."""

from __future__ import annotations

import pytest
import torch

from gti.config import ModelConfig
from gti.config.train import GroundConfig
from gti.lm import models, new_rows
from gti.train.deepspeed_config import build_ds_config
from gti.train.loss import check_labelled_loss, labelled_loss, supports_labelled_loss

N_NEW = 10
LENGTHS = (11, 8, 5)  # right-padded to 11
PROMPTS = (4, 3, 1)  # prompt tokens per row (label -100)


def _tiny(tied: bool):
    cfg = ModelConfig(name="tiny", tiny_hidden=64, tiny_layers=2, tiny_heads=4, tiny_tied=tied)
    return models.build_tiny(cfg, seed=0)


def _split(tied: bool):
    """Tiny model with N_NEW SID tokens attached as split rows, backbone frozen."""
    model, tok = _tiny(tied)
    first, end = new_rows.extend_tokenizer(tok, [f"<a_{i}>" for i in range(N_NEW)])
    d = model.config.hidden_size
    g = torch.Generator().manual_seed(1)
    init_in = torch.randn(N_NEW, d, generator=g) * 0.5
    init_out = None if tied else torch.randn(N_NEW, d, generator=g) * 0.5
    new_rows.attach_new_rows(model, first, end - first, init_in, init_out)
    new_rows.freeze_backbone(model)
    return model, tok, (first, end)


def _lora(tied: bool):
    from peft import LoraConfig, get_peft_model

    model, tok = _tiny(tied)
    peft_cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                          task_type="CAUSAL_LM")
    model = get_peft_model(model, peft_cfg)
    # LoRA B starts at zero; move it so the adapters change the forward.
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    # Like gti.train.sft_task.wrap_lora: embeddings (and head) fully trainable as well.
    model.get_input_embeddings().weight.requires_grad_(True)
    model.get_output_embeddings().weight.requires_grad_(True)
    return model, tok


def _batch(pad_id: int, answer_range: tuple[int, int], seed: int = 0, lengths=LENGTHS, prompts=PROMPTS):
    """Right-padded batch: prompt tokens (label -100), answer tokens drawn from answer_range
    (labelled), pads (`pad_id`, attention 0, label -100). Returns (ids, mask, labels) [B, T]."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.full((len(lengths), t), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for b, (n, p) in enumerate(zip(lengths, prompts)):
        ids[b, :p] = torch.randint(3, 200, (p,), generator=g)
        ids[b, p:n] = torch.randint(*answer_range, (n - p,), generator=g)
        labels[b, p:n] = ids[b, p:n]
        mask[b, :n] = 1
    return ids, mask, labels


def _loss_and_grads(model, fn):
    model.zero_grad(set_to_none=True)
    loss = fn()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_matches_hf(model, ids, mask, labels):
    ours, g_ours = _loss_and_grads(model, lambda: labelled_loss(model, ids, mask, labels))
    hf, g_hf = _loss_and_grads(model, lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss)
    assert ours.dtype == torch.float32
    assert torch.allclose(ours, hf, rtol=0, atol=1e-5), (ours.item(), hf.item())
    assert g_ours.keys() == g_hf.keys() and g_ours
    for n in g_hf:
        assert torch.allclose(g_ours[n], g_hf[n], rtol=1e-4, atol=1e-6), n
    return ours


# --------------------------------------------------------------------------- equality with HF
@pytest.mark.parametrize("tied", [True, False])
def test_matches_hf_full_model(tied):
    model, tok = _tiny(tied)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    ids, mask, labels = _batch(tok.pad_token_id, (3, len(tok)))
    assert supports_labelled_loss(model)
    _assert_matches_hf(model, ids, mask, labels)


@pytest.mark.parametrize("tied", [True, False])
def test_matches_hf_split_new_rows(tied):
    model, tok, (first, end) = _split(tied)
    head = model.get_output_embeddings()
    assert isinstance(head, new_rows.SplitLMHead)
    ids, mask, labels = _batch(tok.pad_token_id, (first, end))  # answers are new tokens only
    assert supports_labelled_loss(model)
    _assert_matches_hf(model, ids, mask, labels)
    # Only the new rows train, and they do get gradient.
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names == ({"model.embed_tokens.new_rows"} if tied
                     else {"model.embed_tokens.new_rows", "lm_head.new_rows"})
    _, grads = _loss_and_grads(model, lambda: labelled_loss(model, ids, mask, labels))
    assert all(g.abs().sum() > 0 for g in grads.values())


@pytest.mark.parametrize("tied", [True, False])
def test_matches_hf_lora(tied):
    model, tok = _lora(tied)
    assert type(model).__name__.startswith("PeftModel")
    ids, mask, labels = _batch(tok.pad_token_id, (3, len(tok)))
    assert supports_labelled_loss(model)
    _assert_matches_hf(model, ids, mask, labels)
    _, grads = _loss_and_grads(model, lambda: labelled_loss(model, ids, mask, labels))
    assert any("lora_A" in n for n in grads) and any("lora_B" in n for n in grads)


def test_shift_matters():
    """The batch discriminates: predicting labels[t] (no shift) or labels[t+2] from hidden[t]
    gives a different number, so the equality tests above pin the shift down."""
    model, tok = _tiny(False)
    ids, mask, labels = _batch(tok.pad_token_id, (3, len(tok)))
    with torch.no_grad():
        ours = labelled_loss(model, ids, mask, labels)
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        keep = labels != -100
        unshifted = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
        keep2 = labels[:, 2:] != -100
        over = torch.nn.functional.cross_entropy(logits[:, :-2][keep2], labels[:, 2:][keep2])
    # far beyond the 1e-5 the equality tests allow (a random tiny model is near-uniform)
    assert abs(ours - unshifted) > 1e-3 and abs(ours - over) > 1e-3


def test_padding_content_is_irrelevant():
    """Pads are masked in attention and unlabelled: changing their ids changes nothing."""
    model, tok = _tiny(False)
    ids, mask, labels = _batch(tok.pad_token_id, (3, len(tok)))
    other = ids.masked_fill(mask == 0, 7)
    with torch.no_grad():
        a = labelled_loss(model, ids, mask, labels)
        b = labelled_loss(model, other, mask, labels)
    assert torch.allclose(a, b, atol=1e-6)


def test_no_labels_gives_connected_zero():
    """No labelled position: exactly 0, still in the graph; backward gives zero (not None)
    gradients to every trainable parameter (DeepSpeed's per-parameter hooks still fire)."""
    model, tok, (first, end) = _split(False)
    ids, mask, labels = _batch(tok.pad_token_id, (first, end))
    labels[:, 1:] = -100  # labels[:, 0] is never a target (nothing precedes it)
    labels[:, 0] = ids[:, 0]
    loss = labelled_loss(model, ids, mask, labels)
    assert loss.item() == 0.0 and loss.grad_fn is not None and loss.dtype == torch.float32
    loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 2
    for p in trainable:
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0


def test_autocast_bf16_runs_and_upcasts(monkeypatch):
    """Under CPU bf16 autocast the head runs in bf16 on [N, d] only, and the cross-entropy
    sees float32 logits."""
    model, tok, (first, end) = _split(False)
    ids, mask, labels = _batch(tok.pad_token_id, (first, end))
    with torch.no_grad():
        ref = labelled_loss(model, ids, mask, labels)
    seen = []
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, i, o: seen.append((i[0].shape, o.dtype)))
    ce_inputs = []
    ce = torch.nn.functional.cross_entropy

    def spy(logits, *args, **kwargs):
        ce_inputs.append(logits.dtype)
        return ce(logits, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", spy)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = labelled_loss(model, ids, mask, labels)
    finally:
        handle.remove()
    assert ce_inputs == [torch.float32]
    n_labelled = int((labels[:, 1:] != -100).sum())
    assert seen == [(torch.Size([n_labelled, model.config.hidden_size]), torch.bfloat16)]
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert abs(loss.item() - ref.item()) < 0.05 * ref.item()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in model.parameters() if p.requires_grad)


def test_labels_shape_mismatch_raises():
    model, tok = _tiny(True)
    ids, mask, labels = _batch(tok.pad_token_id, (3, len(tok)))
    with pytest.raises(ValueError, match="shape"):
        labelled_loss(model, ids, mask, labels[:, 1:])


# --------------------------------------------------------------------------- supports / check
@pytest.mark.parametrize("key,value", [("final_logit_softcapping", 30.0), ("logit_scale", 0.0625),
                                       ("logits_scaling", 4.0)])
def test_not_supported_with_logit_transform(key, value):
    model, _ = _tiny(True)
    setattr(model.config, key, value)
    assert not supports_labelled_loss(model)


def test_neutral_logit_scaling_is_supported():
    model, _ = _tiny(True)
    model.config.logits_scaling = 1.0
    assert supports_labelled_loss(model)


def test_not_supported_without_head_or_decoder():
    assert not supports_labelled_loss(torch.nn.Linear(4, 4))
    model, _ = _tiny(True)
    assert not supports_labelled_loss(model.model)  # the bare decoder: no head


def test_not_supported_for_prompt_learning_peft():
    from peft import PromptTuningConfig, get_peft_model

    model, _ = _tiny(True)
    pm = get_peft_model(model, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    assert not supports_labelled_loss(pm)


def test_gemma2_softcapping_is_refused_and_would_be_wrong():
    """The deny-list is not cosmetic: on a softcapped model the shortcut gives another number."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    conf = Gemma2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                        final_logit_softcapping=0.5, pad_token_id=0)
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(conf).eval()
    with torch.no_grad():  # make the logits large enough for the cap to bite
        model.get_output_embeddings().weight.mul_(50)
    ids, mask, labels = _batch(0, (3, 300))
    assert not supports_labelled_loss(model)
    close, ours, hf = check_labelled_loss(model, ids, mask, labels)
    assert not close, (ours, hf)


def test_check_labelled_loss_on_llama():
    model, tok = _tiny(False)
    ids, mask, labels = _batch(tok.pad_token_id, (3, len(tok)))
    close, ours, hf = check_labelled_loss(model, ids, mask, labels)
    assert close and ours == pytest.approx(hf, abs=1e-5)


def test_module_imports_neither_ray_nor_deepspeed():
    import subprocess
    import sys

    code = "import sys, gti.train.loss; print(sorted({'ray', 'deepspeed'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- DeepSpeed
def _engine(model, stage: int, grad_accum: int = 1):
    import deepspeed

    trainable = [p for p in model.parameters() if p.requires_grad]
    tc = GroundConfig(zero_stage=stage, batch_size=len(LENGTHS) * grad_accum, grad_accum=grad_accum,
                      lr=1e-2, weight_decay=0.1, steps=4)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable,
                                           config=build_ds_config(tc, 1, use_gpu=False))
    return engine


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_loss_and_training_match_hf(single_process_dist_env, stage):
    """Through a single-process DeepSpeed engine (ZeRO `stage`, untied split head): 4
    micro-steps with gradient accumulation 2 driven by `labelled_loss(engine, ...)` give, step
    by step, the HF loss of an identical engine driven by `engine(...).loss`, and train the new
    rows the same. Then, on one engine, both losses through the engine on one batch agree.
    (Catches a loss that skips DeepSpeed's forward bookkeeping: calling `engine.module`'s
    submodules directly and then `engine.backward` trains differently under ZeRO-3 with
    accumulation.)"""
    losses, rows = {}, {}
    for path in ("hf", "labelled"):
        model, tok, (first, end) = _split(False)
        engine = _engine(model, stage, grad_accum=2)
        assert supports_labelled_loss(engine)
        losses[path] = []
        for step in range(4):
            ids, mask, labels = _batch(tok.pad_token_id, (first, end), seed=step)
            if path == "labelled":
                loss = labelled_loss(engine, ids, mask, labels)
                assert "forward" not in engine.module.__dict__  # the shadowing forward is gone
            else:
                loss = engine(input_ids=ids, attention_mask=mask, labels=labels).loss
            losses[path].append(loss.item())
            engine.backward(loss)
            engine.step()
        rows[path] = new_rows.new_rows_state_dict(engine.module)
    assert losses["labelled"] == pytest.approx(losses["hf"], abs=1e-5)
    init = new_rows.new_rows_state_dict(_split(False)[0])
    for k in ("e_new", "head_new"):
        assert torch.allclose(rows["labelled"][k], rows["hf"][k], rtol=1e-4, atol=1e-6), k
        assert not torch.allclose(rows["hf"][k], init[k]), k  # training did move them
    ids, mask, labels = _batch(tok.pad_token_id, (first, end), seed=9)
    with torch.no_grad():
        hf = engine(input_ids=ids, attention_mask=mask, labels=labels).loss
        ours = labelled_loss(engine, ids, mask, labels)
    assert torch.allclose(ours, hf, rtol=0, atol=1e-5), (ours.item(), hf.item())
