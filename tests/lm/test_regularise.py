"""gti.lm.regularise: frozen lower layers stay as they were and cost no backward; dropout acts
in train mode only."""

import copy

import pytest
import torch

from gti import config as C
from gti.common.errors import ConfigError
from gti.lm.models import build_tiny
from gti.lm.regularise import add_dropout, decoder_layers, freeze_lower_layers


def tiny(layers=3, tie=True):
    model, _ = build_tiny(C.ModelConfig(name="tiny", tiny_hidden=32, tiny_layers=layers, tiny_heads=2), seed=0)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if not tie:
        model.get_output_embeddings().weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    return model


def one_step(model):
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def test_frozen_layers_keep_their_weights_and_get_no_gradient():
    model = tiny()
    before = copy.deepcopy(model.state_dict())
    freeze_lower_layers(model, 2)
    one_step(model)
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        grads = [p.grad for p in layer.parameters()]
        if i < 2:
            assert all(g is None for g in grads), f"layer {i} is frozen but got a gradient"
        else:
            assert any(g is not None and g.abs().sum() > 0 for g in grads), f"layer {i} should train"
    after = model.state_dict()
    for name, t in before.items():
        same = torch.equal(t, after[name])
        if name.startswith("model.layers.0.") or name.startswith("model.layers.1."):
            assert same, f"{name} changed though its layer is frozen"
    assert not torch.equal(before["model.layers.2.mlp.down_proj.weight"], after["model.layers.2.mlp.down_proj.weight"])


def test_tied_embeddings_still_train_through_the_head_untied_input_is_frozen():
    tied = tiny(tie=True)
    w0 = tied.get_input_embeddings().weight.detach().clone()
    freeze_lower_layers(tied, 1)
    one_step(tied)
    assert not torch.equal(w0, tied.get_input_embeddings().weight), "tied rows must learn through the head"

    untied = tiny(tie=False)
    w0 = untied.get_input_embeddings().weight.detach().clone()
    freeze_lower_layers(untied, 1)
    one_step(untied)
    assert torch.equal(w0, untied.get_input_embeddings().weight)


def test_freeze_zero_is_the_identity_and_bounds_are_named():
    model = tiny()
    freeze_lower_layers(model, 0)
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(ConfigError, match="freeze_layers=3.*3 decoder layers"):
        freeze_lower_layers(tiny(), 3)


def test_dropout_acts_in_train_mode_only():
    ref = tiny()
    model = add_dropout(copy.deepcopy(ref), 0.3)
    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(2))
    model.eval()
    ref.eval()
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, ref(input_ids=ids).logits)
        model.train()
        a, b = model(input_ids=ids).logits, model(input_ids=ids).logits
    assert not torch.allclose(a, b), "train mode must drop"
    assert model.config.attention_dropout == 0.3
    with pytest.raises(ConfigError, match="dropout=1"):
        add_dropout(tiny(), 1.0)
