"""gti.train.rl_run: RL prompts come from SFT's sequence rows only (never the grounding pairs of
a multitask mix; SFT's windows hold no valid/test target, tests/train/test_sft_data.py), the
step statistics' means, and the refusal of a validation set without MRR."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from gti import config as C
from gti.errors import ConfigError
from gti.lm.templates import SEQ_TASK
from gti.train.loss import IGNORE_INDEX
from gti.train.rl_run import RlInputs, rl_rows_from_sft, run_rl, step_stat_means
from gti.train.worker_config import RlStart, ValSet


def test_rl_rows_are_the_sequence_rows_prompt_and_target_sid():
    rows = pl.DataFrame({
        "task": [SEQ_TASK, "sid2text", SEQ_TASK],
        "prompt_ids": [[5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        "answer_ids": [[64, 73, 82, 2], [30, 31], [65, 72, 80, 2]],
    })
    out = rl_rows_from_sft(rows, 3)
    assert out["input_ids"].to_list() == [[5, 6, 7], [12, 13, 14, 15]]
    assert out["labels"].to_list() == [[64, 73, 82], [IGNORE_INDEX, 65, 72, 80]]


def test_step_stat_means():
    h = {"stats": {"reward_mean": [[1, 0.0], [2, 0.5]], "kl": [[1, 0.1], [2, 0.3]]}}
    assert step_stat_means(h) == pytest.approx({"reward_mean": 0.25, "kl": 0.2})
    assert step_stat_means({"loss": []}) == {}


def test_a_validation_set_without_mrr_is_refused(tmp_path: Path):
    val = ValSet(str(tmp_path / "v.parquet"), str(tmp_path / "s.safetensors"), 64, 88, 3, mrr=False)
    inputs = RlInputs(C.RunConfig(), tmp_path / "rows.parquet", RlStart(str(tmp_path), "", 64, 88, 3), 0, val)
    with pytest.raises(ConfigError, match="val_mrr"):
        run_rl(inputs, storage_path=tmp_path, name="rl", start_ray=lambda: None, log=print)
