"""The causal-LM loss computed only where there is a label (pure torch; never imports Ray).

What it is for: `labelled_loss(model, input_ids, attention_mask, labels)` gives the same number
(and gradients) as HF's `model(..., labels=labels).loss` but projects onto the vocabulary only
the N hidden states whose next-token label is not -100: in grounding and SFT most positions are
prompt or padding, so the [B, T, V] float32 logits (the largest activation of a small model with
a big vocabulary) shrink to [N, V]. It serves plain HF causal LMs, gti's `SplitLMHead`, peft LoRA
wrappers and DeepSpeed engines (ZeRO 0-3); `supports_labelled_loss` says when the shortcut is
known to be wrong (the caller falls back), `check_labelled_loss` compares both paths.

What it does NOT know: architectures with an unnamed logit transform after the head,
prompt-learning peft adapters (refused), encoder-decoder models, and Ray.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

IGNORE_INDEX = -100

# Config keys of HF causal LMs whose forward transforms the head's output (or the hidden state
# before it); the value each must have for logits == head(last_hidden_state). `None` as the
# only neutral value means "any value breaks the shortcut" (e.g. softcapping with cap 1.0 is
# still a tanh). Incomplete by nature: unknown architectures should be checked once with
# `check_labelled_loss`.
_LOGIT_TRANSFORMS: dict[str, tuple] = {
    "final_logit_softcapping": (None,),  # Gemma 2/3/4: tanh(logits / cap) * cap
    "logit_scale": (None, 1, 1.0),  # Cohere: logits * logit_scale
    "logits_scaling": (None, 1, 1.0),  # Granite (divides), HyperCLOVA X (multiplies)
    "lm_head_multiplier": (None, 1, 1.0),  # Falcon-H1
    "output_multiplier": (None, 1, 1.0),
    "dim_model_base": (None,),  # MiniCPM: hidden / (hidden_size / dim_model_base) before the head
}


def is_engine(model) -> bool:
    """True for a DeepSpeed engine (checked by class name, so deepspeed is never imported)."""
    return any(c.__name__ == "DeepSpeedEngine" for c in type(model).__mro__)


def _engine_free(model):
    """A DeepSpeed engine's module, or `model`."""
    return model.module if is_engine(model) else model


def _causal_lm(model) -> nn.Module:
    """The HF `*ForCausalLM` inside `model` (a peft PeftModel's base model, LoRA layers
    included; a DeepSpeed engine's module), or `model` itself."""
    model = _engine_free(model)
    get_base = getattr(type(model), "get_base_model", None)  # peft PeftModel
    if callable(get_base):
        model = model.get_base_model()
    return model


def _decoder(lm: nn.Module) -> nn.Module | None:
    """The decoder body of a causal LM (returns [B, T, d] hidden states), or None."""
    dec = lm.get_decoder() if callable(getattr(lm, "get_decoder", None)) else getattr(lm, "model", None)
    if dec is None or dec is lm or not isinstance(dec, nn.Module):
        return None
    return dec


def _configs(lm: nn.Module) -> list:
    conf = getattr(lm, "config", None)
    if conf is None:
        return []
    out = [conf]
    text = conf.get_text_config() if callable(getattr(conf, "get_text_config", None)) else None
    if text is not None and text is not conf:
        out.append(text)
    return out


def supports_labelled_loss(model) -> bool:
    """False where `labelled_loss` is known to differ from the HF loss (fall back to
    `model(..., labels=labels).loss` then): no output embeddings or no decoder body found, an
    encoder-decoder model, a prompt-learning peft adapter (virtual tokens are prepended by
    PeftModel.forward), or a config with a logit transform after the head (softcapping,
    logit scales/multipliers; see `_LOGIT_TRANSFORMS`). True does not prove equality for an
    unknown architecture (the shortcut assumes logits == head(decoder(ids).last_hidden_state));
    `check_labelled_loss` does, on one batch."""
    peft_cfg = getattr(_engine_free(model), "active_peft_config", None)
    if peft_cfg is not None and getattr(peft_cfg, "is_prompt_learning", False):
        return False
    lm = _causal_lm(model)
    get_out = getattr(lm, "get_output_embeddings", None)
    if not callable(get_out) or get_out() is None or _decoder(lm) is None:
        return False
    for conf in _configs(lm):
        if getattr(conf, "is_encoder_decoder", False):
            return False
        for key, neutral in _LOGIT_TRANSFORMS.items():
            if getattr(conf, key, None) not in neutral:
                return False
    return True


def labelled_logits(model, input_ids: Tensor, attention_mask: Tensor | None,
                    labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The output head on the labelled positions only: what `labelled_loss` and the RL
    objective's log-probs (`gti.rl.grpo.labelled_logprobs`) are computed from.

    model: an HF causal LM or a peft `PeftModel` around one (a DeepSpeed engine goes through
    `labelled_loss`, which runs this inside the engine's forward); input_ids, labels [B, T]
    as in `labelled_loss`. Returns (logits [N, V] float32, targets [N] long, keep [B, T-1]
    bool): the N positions t with labels[b, t+1] != -100, in row-major order.
    """
    lm = _causal_lm(model)
    dec = _decoder(lm)
    head = lm.get_output_embeddings()
    if dec is None or head is None:
        raise ValueError(f"{type(lm).__name__} has no decoder body or output head; "
                         "use the HF forward (see supports_labelled_loss)")
    out = dec(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [B, T, d]
    shift = labels[:, 1:].to(hidden.device)  # [B, T-1]: the label of the token after t
    keep = shift != IGNORE_INDEX  # [B, T-1]
    logits = head(hidden[:, :-1][keep]).float()  # [N, V], upcast like HF's ForCausalLMLoss
    return logits, shift[keep].long(), keep


def _labelled_loss(model, input_ids: Tensor, attention_mask: Tensor | None, labels: Tensor) -> Tensor:
    logits, targets, _ = labelled_logits(model, input_ids, attention_mask, labels)
    if targets.numel() == 0:
        # Nothing to learn here: an exact 0 that still reaches the decoder and the head, so
        # every trainable parameter gets a zero (not a missing) gradient and DeepSpeed's
        # backward hooks fire as usual. (HF's mean over zero tokens would be NaN.)
        return logits.sum()
    return F.cross_entropy(logits, targets)


def labelled_loss(model, input_ids: Tensor, attention_mask: Tensor | None, labels: Tensor) -> Tensor:
    """Mean next-token cross-entropy over the tokens that have a label.

    model: an HF causal LM (`LlamaForCausalLM`-like: `get_decoder()` / `.model` returning
      `last_hidden_state`, and `get_output_embeddings()` = `nn.Linear` or `SplitLMHead`), a peft
      `PeftModel` around one, or a DeepSpeed engine around either (then the computation runs as
      the engine module's forward inside `engine(...)`; backward with `engine.backward(loss)`).
    input_ids: LongTensor[B, T]; attention_mask: Tensor[B, T] (1 = token, 0 = pad) or None;
    labels: LongTensor[B, T], unshifted like HF's (`labels[b, t]` is the token at t, -100 where
      there is nothing to predict).
    Returns a float32 scalar: mean over the N pairs (b, t) with labels[b, t+1] != -100 of
    -log softmax(head(hidden[b, t]))[labels[b, t+1]] -- equal to HF's `.loss`. Logits are
    computed for those N positions only ([N, V], cast to float32 before the cross-entropy, also
    under autocast). With N == 0 the result is an exact 0.0 that is still connected to the
    graph (zero gradients everywhere), where HF would give NaN. `num_items_in_batch` is not
    known here: the mean is over this batch's labelled tokens only, like HF without it.
    """
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} and input_ids {tuple(input_ids.shape)} differ in shape")
    if not is_engine(model):
        return _labelled_loss(model, input_ids, attention_mask, labels)
    return _through_engine(model, input_ids, attention_mask, labels)


_MISSING = object()


def _through_engine(engine, input_ids: Tensor, attention_mask: Tensor | None, labels: Tensor) -> Tensor:
    return run_as_engine_forward(engine, lambda module: _labelled_loss(module, input_ids, attention_mask, labels))


def run_as_engine_forward(engine, fn: Callable[[nn.Module], Tensor]) -> Tensor:
    """`fn(engine.module)` run as the module's forward inside `engine()`: how a loss computed
    from submodules (`labelled_loss`, the RL objective) goes through a DeepSpeed engine.

    DeepSpeed's engine forward does more than call the module: it resets ZeRO's per-step
    backward state, applies its autocast, and registers hooks on the output that run the
    backward prologue (ZeRO's enter_backward / gradient-accumulation boundary / scaling).
    Calling submodules of `engine.module` directly would skip all of that (measured with
    DeepSpeed 0.19: under ZeRO-3 with gradient accumulation the new rows then train
    differently from the HF path), so the module's forward is shadowed by an instance
    attribute for the duration of one call instead. Returns fn's scalar."""
    module = engine.module
    prev = module.__dict__.get("forward", _MISSING)

    def forward():
        return fn(module)

    module.forward = forward
    try:
        return engine()
    finally:
        if prev is _MISSING:
            del module.forward
        else:
            module.forward = prev


@torch.no_grad()
def check_labelled_loss(model, input_ids: Tensor, attention_mask: Tensor | None, labels: Tensor,
                        rtol: float = 1e-4, atol: float = 1e-5) -> tuple[bool, float, float]:
    """(close, labelled, hf): both losses on one batch (no gradients), for checking an
    architecture `supports_labelled_loss` cannot vouch for before training with the shortcut.
    Pass a model (or `engine.module`), not an engine. Compare in float32 for tight tolerances."""
    ours = float(_labelled_loss(model, input_ids, attention_mask, labels))
    hf = float(model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss)
    return abs(ours - hf) <= atol + rtol * abs(hf), ours, hf


# --------------------------------------------------------------------------- training forward
def set_training_attention(model: torch.nn.Module, setting: str, use_gpu: bool) -> str | None:
    """Apply `attn_implementation` ("auto": eager on CPU, unchanged on GPU) to the HF model
    inside `model` (a peft wrapper's base model too). Returns what was set, None if nothing."""
    impl = ("eager" if not use_gpu else None) if setting == "auto" else setting
    lm = _causal_lm(model)
    if impl is None or not callable(getattr(lm, "set_attn_implementation", None)):
        return None
    lm.set_attn_implementation(impl)
    return impl


def training_autocast(precision: str, device_type: str):
    """The training forward's autocast: bf16 when the resolved precision is "bf16", else off."""
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision == "bf16")


def make_forward(model: torch.nn.Module, precision: str, device_type: str) -> Callable:
    """(engine, batch) -> scalar loss for this model and resolved precision.

    The loss is computed only at labelled positions (`gti.train.loss.labelled_loss`: last
    hidden states gathered where the next label is not -100, then projected), which equals
    the HF forward with `labels=`; models the shortcut cannot serve exactly fall back to the
    HF forward. "bf16" runs the forward under bf16 autocast: weights, gradients and optimizer
    state stay in their own dtype (fp32 unless model.dtype says otherwise).
    """
    fast = supports_labelled_loss(model)

    def forward(engine, b: dict[str, torch.Tensor]) -> torch.Tensor:
        with training_autocast(precision, device_type):
            if fast:
                return labelled_loss(engine, b["input_ids"], b["attention_mask"], b["labels"])
            return engine(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss

    return forward
