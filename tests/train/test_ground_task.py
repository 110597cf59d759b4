"""gti/train/ground_task.py: the grounding model trains only the new rows, and its export
merges them back into a standard model."""

from __future__ import annotations

import torch

from gti import config as C
from gti.train.ground_task import HOOKS, build_ground_model, export_grounded, ground_trainable_state
from gti.train.worker_config import GroundRows, WorkerConfig


def test_only_new_rows_train_and_export_merges_them(tmp_path):
    from safetensors.torch import save_file

    from gti.lm import models, new_rows

    cfg = C.RunConfig(model={"name": "tiny"})
    base, tok = models.build_tiny(cfg.model)
    first, end = new_rows.extend_tokenizer(tok, [f"<a_{i}>" for i in range(4)])
    d = base.get_input_embeddings().weight.shape[1]
    init = {"e_new": torch.randn(end - first, d, generator=torch.Generator().manual_seed(0))}
    save_file(init, str(tmp_path / "init.safetensors"))
    config = WorkerConfig.build("ground", cfg, 0, ground=GroundRows(str(tmp_path / "init.safetensors"), first, end - first))
    model = build_ground_model(config, cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == init["e_new"].numel()
    state = ground_trainable_state(model)
    assert torch.equal(state["e_new"], init["e_new"]) and HOOKS.grad_norm_key == "grad_norm_new_rows"
    final = {"e_new": init["e_new"] + 1.0}
    export_grounded(models.build_tiny(cfg.model)[0], tok, first, init, final, tmp_path / "model", {"sid_map_hash": "h"})
    assert new_rows.read_meta(tmp_path / "model")["sid_map_hash"] == "h"
    from transformers import AutoModelForCausalLM

    out = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"), use_safetensors=True)
    torch.testing.assert_close(out.get_input_embeddings().weight[first:end], final["e_new"])
