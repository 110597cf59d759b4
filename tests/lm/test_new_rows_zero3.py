"""Vocabulary surgery under DeepSpeed ZeRO-3 (gti/lm/new_rows.py): partitioned old rows stay
bit-identical, new rows train, export gathers and writes a plain HF folder."""

from __future__ import annotations

import pytest
import torch

from gti.lm import new_rows as V
from gti.lm.models import build_tiny


@pytest.mark.slow
def test_zero3_train_gather_and_export(tmp_path, tiny_model_cfg, single_process_dist_env):
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    model, tok = build_tiny(tiny_model_cfg(tiny_tied=False, tiny_pad_vocab_to=400))
    first, end = V.extend_tokenizer(tok, [f"<a_{i}>" for i in range(8)], markers=False)
    V.attach_new_rows(model, first, end - first, torch.randn(end - first, 32) * 0.1)
    V.freeze_backbone(model)
    old = V.old_rows(model).clone()
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
    }
    opt = torch.optim.AdamW(V.new_rows_parameters(model), lr=1e-2, weight_decay=0.5)
    try:
        eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
        emb, _ = V.split_modules(eng.module)
        assert hasattr(emb.old_weight, "ds_id") and emb.old_weight.numel() == 0  # partitioned
        e0 = V.new_rows_state_dict(eng.module)
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            ids = torch.randint(0, end, (2, 10), generator=g)
            ids[:, ::2] = torch.randint(first, end, (2, 5), generator=g)
            loss = eng(input_ids=ids, labels=ids).loss
            eng.backward(loss)
            eng.step()
        e1 = V.new_rows_state_dict(eng.module)
        assert not torch.equal(e0["e_new"], e1["e_new"]) and not torch.equal(e0["head_new"], e1["head_new"])
        assert torch.equal(V.old_rows(eng.module), old)
        with V.gathered(list(eng.module.parameters())):
            out = V.export_model(eng.module, tok, tmp_path / "model", {"sid_map_hash": "h"})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    re_model = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True)
    w = re_model.get_input_embeddings().weight
    assert torch.equal(w[first:end], e1["e_new"]) and torch.equal(w[:first], old[:first])
    assert torch.equal(re_model.get_output_embeddings().weight[first:end], e1["head_new"])
