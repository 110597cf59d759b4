"""The grounding task: its model, trainable tensors, validation and export, as loop hooks.

What it is for: `HOOKS` for `gti.train.loop` (task "ground"): `build_ground_model` (the base
model with new rows initialised from `config.ground.init_path`, backbone and old rows
frozen), `ground_trainable_state` (the new rows, full fp32) and `validate_ground` (exact match
of constrained greedy text->SID generation on held-out pairs); `load_base_model` (the model
before vocabulary extension, identical in every process) and `export_grounded` (the model with
the trained rows merged, as the stage writes it). Parallel to `gti.train.sft_task`.

What it does not know: how pairs were rendered, Ray, or where the stage writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gti.train.task import TaskHooks, full_fp32_cpu, load_trie, rank_share, register

if TYPE_CHECKING:
    from gti.train.worker_config import WorkerConfig


def load_base_model(cfg: Any):
    """The pretrained model before vocabulary extension, identical in every process (safetensors
    weights, or the tiny model, which `gti.lm.models` always builds with the same seed)."""
    from gti.lm import models

    model, _ = models.load_model_and_tokenizer(cfg.model)
    return model


def build_ground_model(config: "WorkerConfig", cfg: Any) -> torch.nn.Module:
    """Base model + new rows [first_new_id, first_new_id + n_new) of `config.ground` initialised
    from its init_path (safetensors: e_new [V_new, d], head_new for untied heads); backbone and
    old rows frozen, only the new rows trainable."""
    from safetensors.torch import load_file

    from gti.lm import new_rows

    g = config.ground
    model = load_base_model(cfg)
    init = load_file(g.init_path)
    new_rows.attach_new_rows(model, int(g.first_new_id), int(g.n_new), init["e_new"], init.get("head_new"))
    new_rows.freeze_backbone(model)
    return model


def ground_trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{"e_new": [V_new, d]} (+ "head_new" untied), full fp32 (see `full_fp32_cpu`)."""
    from gti.lm import new_rows

    params = new_rows.new_rows_parameters(module)
    return {name: full_fp32_cpu(p) for name, p in zip(["e_new", "head_new"], params)}


def validate_ground(module: torch.nn.Module, config: "WorkerConfig", rank: int,
                    world: int) -> dict[str, tuple[float, float]]:
    """Exact match of greedy text->SID generation constrained to catalog SIDs.

    config.val (a `ValSet`): `path` a parquet with `prompt` list<int> (chat prompt + any forced
    answer prefix such as <sid_start>) and `target` list<int> (the L SID token ids), `sids_path`
    safetensors `sid_token_ids` [N_items, L], `new_start`/`new_end`, `levels`, `batch_users`;
    prompts padded with config.pad_id. Rank r takes rows r*ceil(n/world) ... (wrapping, padded
    rows not counted), so every rank runs the same number of forward passes.
    """
    v = config.val
    if v is None:
        return {}
    import pyarrow.parquet as pq

    from gti.eval.decode import constrained_beam_search

    table = pq.read_table(v.path)
    n = table.num_rows
    if n == 0:
        return {}
    rows, valid = rank_share(n, rank, world)
    prompts_all = table.column("prompt").to_pylist()
    targets_all = table.column("target").to_pylist()
    trie = load_trie(v.sids_path, int(v.new_start), int(v.new_end))
    res = constrained_beam_search(
        module, [prompts_all[i] for i in rows], trie,
        beam_width=1, k=1, levels=int(v.levels), pad_id=int(config.pad_id), batch_users=int(v.batch_users),
    )
    target = torch.tensor([targets_all[i] for i in rows], dtype=torch.long)
    hit = (res.sid_ids[:, 0, :].cpu() == target).all(dim=1) & valid
    return {"val_exact_match": (float(hit.sum()), float(valid.sum()))}


def export_grounded(model: torch.nn.Module, tokenizer, first: int, init: dict[str, torch.Tensor],
                    final: dict[str, torch.Tensor], out_dir, meta: dict[str, Any]) -> None:
    """The base model with the new rows attached, set to `final` and merged: a standard HF
    folder with the extended tokenizer and `gti_meta.json` (`meta`)."""
    from gti.lm import new_rows

    new_rows.attach_new_rows(model, first, int(init["e_new"].shape[0]), init["e_new"], init.get("head_new"))
    new_rows.load_new_rows_state_dict(model, final)
    new_rows.export_model(model, tokenizer, out_dir, meta)


HOOKS = register("ground", TaskHooks(
    build_model=build_ground_model,
    trainable_state=ground_trainable_state,
    validate=validate_ground,
    grad_norm_key="grad_norm_new_rows",
))
