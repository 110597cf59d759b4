"""gti/train/task.py: what the tasks' hooks share."""

from __future__ import annotations

import torch

from gti.train.task import TaskHooks, full_fp32_cpu, load_trie, rank_share


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
