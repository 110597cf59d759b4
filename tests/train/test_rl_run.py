"""gti.train.rl_run: RL prompts are sampled training windows (no valid or test item as target or
in a history), the step statistics' means, and the refusal of a validation set without MRR."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from gti import config as C
from gti.common.errors import ConfigError
from gti.train.loss import IGNORE_INDEX
from gti.train.rl_run import RlInputs, rl_prompt_rows, run_rl, step_stat_means, time_shares
from gti.train.worker_config import RlStart, ValSet


class _Renderer:
    """render_prompts as gti.lm.templates.RecRenderer's: here the history's first SID tokens."""

    def __init__(self, sid_ids):
        self.sid_ids = sid_ids

    def render_prompts(self, w):
        prompts = [[5] + [int(x) for h in hist for x in self.sid_ids[h]] for hist in w["history"]]
        return {"user_id": w["user_id"], "split": w["split"], "prompt_ids": prompts, "target": w["target"]}


def test_rl_prompts_are_sampled_training_windows_never_a_held_out_item():
    """Users whose valid and test items are items no one trains on: no RL prompt holds one, as
    target or in its history; the sample is seeded, of the size asked, each target's SID last."""
    from gti.train.sft_data import training_windows

    items = [f"it{i}" for i in range(12)]
    sid_ids = {it: np.array([64 + i % 4, 68 + i // 4, 72]) for i, it in enumerate(items)}
    seqs = pl.DataFrame({"user_id": [f"u{u}" for u in range(6)],
                         "train_items": [[items[(u + j) % 8] for j in range(5)] for u in range(6)],
                         "valid_item": [items[8 + u % 2] for u in range(6)],
                         "test_item": [items[10 + u % 2] for u in range(6)]})
    windows = training_windows(seqs, 3, seed=0)
    out = rl_prompt_rows(windows, _Renderer(sid_ids), sid_ids, 10, seed=1)
    assert out.height == 10 and out.equals(rl_prompt_rows(windows, _Renderer(sid_ids), sid_ids, 10, seed=1))
    assert not out.equals(rl_prompt_rows(windows, _Renderer(sid_ids), sid_ids, 10, seed=2))
    held_out = {tuple(sid_ids[it]) for it in items[8:]}
    for ids, labels in zip(out["input_ids"].to_list(), out["labels"].to_list()):
        target = tuple(labels[-3:])
        assert labels[:-3] == [IGNORE_INDEX] * (len(ids) - 3) and target not in held_out
        assert not any(tuple(ids[1 + 3 * k: 4 + 3 * k]) in held_out for k in range((len(ids) - 1) // 3))
    assert rl_prompt_rows(windows, _Renderer(sid_ids), sid_ids, 1000, seed=1).height == windows.height


def test_step_stat_means():
    h = {"stats": {"reward_mean": [[1, 0.0], [2, 0.5]], "kl": [[1, 0.1], [2, 0.3]]}}
    assert step_stat_means(h) == pytest.approx({"reward_mean": 0.25, "kl": 0.2})
    assert step_stat_means({"loss": []}) == {}


def test_time_shares_of_the_compute_time():
    h = {"stats": {"rollout_s": [[1, 1.0], [2, 2.0]], "reward_s": [[1, 0.25], [2, 0.25]]}}
    assert time_shares(h, 10.0, grad_accum=2) == pytest.approx({"rollout": 0.6, "reward": 0.1, "update": 0.3})
    assert time_shares(h, None, 1) is None and time_shares(h, 0.0, 1) is None


def test_a_validation_set_without_mrr_is_refused(tmp_path: Path):
    val = ValSet(str(tmp_path / "v.parquet"), str(tmp_path / "s.safetensors"), 64, 88, 3, mrr=False)
    inputs = RlInputs(C.RunConfig(), tmp_path / "rows.parquet", RlStart(str(tmp_path), "", 64, 88, 3), 0, val)
    with pytest.raises(ConfigError, match="val_mrr"):
        run_rl(inputs, storage_path=tmp_path, name="rl", start_ray=lambda: None, log=print)
