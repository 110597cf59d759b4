"""gti/train/task.py: what the tasks' hooks share, and the registry the task modules fill."""

from __future__ import annotations

import importlib

import pytest
import torch

from gti.train.task import TASKS, TaskHooks, full_fp32_cpu, hooks_for, load_trie, rank_share, register


def test_rank_share_gives_every_rank_the_same_count_and_counts_each_row_once():
    n, world = 10, 4
    shares = [rank_share(n, r, world) for r in range(world)]
    assert {len(rows) for rows, _ in shares} == {3}
    counted = [i for rows, valid in shares for i, v in zip(rows, valid.tolist()) if v]
    assert sorted(counted) == list(range(n))


def test_full_fp32_copy_and_cached_trie(tmp_path):
    from safetensors.torch import save_file

    p = torch.nn.Parameter(torch.ones(2, 3, dtype=torch.bfloat16))
    full = full_fp32_cpu(p)
    assert full.dtype == torch.float32 and torch.equal(full, torch.ones(2, 3))
    save_file({"sid_token_ids": torch.tensor([[10, 12], [11, 13]])}, str(tmp_path / "s.safetensors"))
    trie = load_trie(str(tmp_path / "s.safetensors"), 10, 14)
    assert load_trie(str(tmp_path / "s.safetensors"), 10, 14) is trie
    assert TaskHooks(build_model=len, trainable_state=len).grad_norm_key == "grad_norm"


def test_every_task_name_resolves_to_the_hooks_its_module_registers():
    for name in TASKS:
        module = importlib.import_module(f"gti.train.{name}_task")
        assert hooks_for(name) is module.HOOKS and isinstance(module.HOOKS, TaskHooks), name
    assert hooks_for("rl").keep_best == "val_mrr" and hooks_for("ground").grad_norm_key == "grad_norm_new_rows"


def test_the_registry_refuses_a_name_that_is_not_a_task():
    with pytest.raises(ValueError, match="unknown training task 'dpo' \\(one of ground, sft, rl\\)"):
        hooks_for("dpo")
    with pytest.raises(ValueError, match="unknown training task 'dpo'"):
        register("dpo", TaskHooks(build_model=len, trainable_state=len))
