"""Regularisers for full fine-tuning on small data: freezing the lower layers, dropout.

What it is for: two small surgeries `gti.train.sft_task` applies to the grounded model before
SFT when `sft.freeze_layers` / `sft.dropout` ask for them: `freeze_lower_layers(model, n)` (the
token embedding and the first n decoder layers stop training from the input side) and
`add_dropout(model, p)` (dropout on the token embeddings' output and the attention
probabilities, train mode only; Llama-style decoders ship with none).

What it does NOT know: configs, the training loop, or which rows are new.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gti.common.errors import ConfigError


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder blocks of a causal LM (`model.model.layers` for Llama/Qwen/Mistral)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(f"sft.freeze_layers: {type(model).__name__} has no `model.layers` list of decoder "
                          "blocks; freezing layers is supported for Llama-style decoders only")
    return layers


def freeze_lower_layers(model: torch.nn.Module, n: int) -> torch.nn.Module:
    """Freeze the first `n` of the L decoder layers and stop gradients at the embedding output.

    Their parameters get requires_grad False and the embedding's output is detached, so the
    backward pass stops at layer n (it costs (L - n) / L of a full one). The embedding matrix
    keeps requires_grad when it is tied to the head (it then trains from the output side only,
    so the SID rows keep learning what to emit); an untied input embedding is frozen. Returns
    the model (in place)."""
    layers = decoder_layers(model)
    if not 0 <= n < len(layers):
        raise ConfigError(f"sft.freeze_layers={n}: the model has {len(layers)} decoder layers; freeze 0 to "
                          f"{len(layers) - 1} of them (at least one must train)")
    if n == 0:
        return model
    for layer in layers[:n]:
        layer.requires_grad_(False)
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is emb.weight
    if not tied:
        emb.weight.requires_grad_(False)
    # Detaching here is what makes the frozen layers cheap: no activation below layer n then
    # needs a gradient, so autograd records nothing for them.
    emb.register_forward_hook(lambda _m, _inp, out: out.detach())
    return model


def add_dropout(model: torch.nn.Module, p: float) -> torch.nn.Module:
    """Dropout `p` on the token embeddings' output and the attention probabilities (train mode
    only; eval and generation are unchanged). Returns the model (in place)."""
    if not 0 <= p < 1:
        raise ConfigError(f"sft.dropout={p}: must be in [0, 1)")
    if p == 0:
        return model
    if hasattr(model.config, "attention_dropout"):
        model.config.attention_dropout = p
        for layer in decoder_layers(model):
            attn = getattr(layer, "self_attn", None)
            if attn is not None and hasattr(attn, "attention_dropout"):
                attn.attention_dropout = p
    emb = model.get_input_embeddings()
    emb.register_forward_hook(lambda m, _inp, out: F.dropout(out, p, training=m.training))
    return model
