"""gti.train.rl_task: its rows, and the RL task through the real shared loop and DeepSpeed engine
in one process (Ray Train's four calls replaced by an in-memory checkpoint store): the SFT model
is validated before the first step, the step statistics are reported, the best validation's
tensors are handed back (the SFT model's own when RL only made it worse) with an early stop,
and a run resumed from a mid-run checkpoint equals an uninterrupted one. `rl.updates_per_rollout`:
validated, mapped onto the loop's optimizer steps (one rollout per cycle and micro-batch slot),
and through the loop it moves the clip fraction off 0 (with 1 the ratio is exactly 1)."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

from gti import config as C
from gti.common.errors import DataError
from gti.train import loop, ray_train, rl_task
from gti.train.loss import IGNORE_INDEX
from gti.train.rl_task import STAT_KEYS, grpo_settings, rl_row, rollout_cycle, split_batch
from gti.train.shards import PadCollate
from gti.train.worker_config import RlStart, ValSet, WorkerConfig

VOCAB, FIRST_NEW, LEVELS, CODEBOOK = 100, 64, 3, 8
NEW_END = FIRST_NEW + LEVELS * CODEBOOK


def test_rows_pack_and_unpack():
    rows = [rl_row([5, 6, 7, 8], [64, 73, 82]), rl_row([9, 10, 11, 12, 13, 14], [65, 72, 80])]
    assert rows[0]["labels"] == [IGNORE_INDEX, 64, 73, 82]
    batch = PadCollate(0)({"input_ids": [r["input_ids"] for r in rows], "labels": [r["labels"] for r in rows]})
    prompts, targets = split_batch(batch, LEVELS)
    assert prompts == [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    assert targets == [(64, 73, 82), (65, 72, 80)]
    with pytest.raises(DataError, match="cannot carry a target SID of 3 tokens"):
        rl_row([5, 6], [64, 73, 82])
    bad = PadCollate(0)({"input_ids": [[5, 6, 7, 8]], "labels": [[IGNORE_INDEX] * 4]})
    with pytest.raises(DataError, match="no target SID"):
        split_batch(bad, LEVELS)


# --------------------------------------------------------------------------- the loop in one process
class _Shard:
    """A Ray Data shard's two iteration calls over in-memory rows (seeded order per epoch)."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def _order(self, seed: int) -> list[dict]:
        return [self.rows[i] for i in np.random.default_rng(seed).permutation(len(self.rows))]

    def iter_torch_batches(self, *, batch_size, collate_fn, drop_last, local_shuffle_seed, **_):
        rows = self._order(local_shuffle_seed)
        for lo in range(0, len(rows) - batch_size + 1, batch_size):
            part = rows[lo: lo + batch_size]
            yield collate_fn({"input_ids": [r["input_ids"] for r in part], "labels": [r["labels"] for r in part]})

    def iter_batches(self, *, batch_size, **_):
        for lo in range(0, len(self.rows), batch_size):
            part = self.rows[lo: lo + batch_size]
            yield {"input_ids": np.array([r["input_ids"] for r in part], dtype=object),
                   "labels": np.array([r["labels"] for r in part], dtype=object)}


class _Store:
    """Ray Train's report / latest checkpoint, kept in folders under `root`."""

    def __init__(self, root: Path, start: Path | None = None):
        self.root, self.dirs, self.start = root, [], start

    def report(self, metrics, checkpoint_dir=None):
        if checkpoint_dir is not None:
            dst = self.root / f"ckpt-{metrics['step']:04d}"
            shutil.copytree(checkpoint_dir, dst)
            self.dirs.append(dst)

    @contextmanager
    def latest(self):
        yield self.start


@pytest.fixture
def rl_problem(tmp_path):
    """A tiny Llama saved as the 'SFT model', a 12-item catalog, 8 training prompts whose target
    is item A, and 6 validation prompts."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2))
    model.save_pretrained(tmp_path / "sft_model", safe_serialization=True)
    g = torch.Generator().manual_seed(7)
    codes = torch.randperm(CODEBOOK ** LEVELS, generator=g)[:12]
    sids = torch.stack([FIRST_NEW + lv * CODEBOOK + (codes // CODEBOOK ** (LEVELS - 1 - lv)) % CODEBOOK
                        for lv in range(LEVELS)], dim=1)
    save_file({"sid_token_ids": sids.contiguous()}, str(tmp_path / "sids.safetensors"))
    prompts = [torch.randint(3, FIRST_NEW, (5 + i % 3,), generator=g).tolist() for i in range(14)]
    rows = [rl_row(p, sids[0].tolist()) for p in prompts[:8]]
    return tmp_path, sids, prompts[8:], rows


def _run(tmp, sids, val_prompts, rows, val_target: int, monkeypatch, *, start: Path | None = None,
         store_dir: str = "store", **rl):
    cfg = C.RunConfig.model_validate({"seed": 0, "model": {"dtype": "float32"}, "rl": {
        "enabled": True, "steps": 4, "batch_size": 2, "lr": 0.05, "group_size": 4, "kl_coef": 0.0,
        "val_every": 2, "checkpoint_every": 2, "precision": "fp32", "zero_stage": 2, "stop_margin": None,
        "group_by_length": False, **rl}})
    pl.DataFrame({"prompt": val_prompts, "target_row": [val_target] * len(val_prompts)},
                 schema={"prompt": pl.List(pl.Int32), "target_row": pl.Int64}).write_parquet(tmp / "val.parquet")
    start_cfg = RlStart(str(tmp / "sft_model"), str(tmp / "sids.safetensors"), FIRST_NEW, NEW_END, LEVELS)
    val = ValSet(str(tmp / "val.parquet"), str(tmp / "sids.safetensors"), FIRST_NEW, NEW_END, LEVELS,
                 k=4, beam_width=4, batch_users=8, mrr=True)
    config = WorkerConfig.build("rl", cfg, 0, rl=start_cfg, val=val)
    (tmp / store_dir).mkdir()
    store = _Store(tmp / store_dir, start)
    monkeypatch.setattr(rl_task, "_CONTEXT", {})  # a fresh worker process: no rollouts of an earlier run
    monkeypatch.setattr(ray_train, "worker_rank_world", lambda: (0, 1))
    monkeypatch.setattr(ray_train, "dataset_shard", lambda name="train": _Shard(rows))
    monkeypatch.setattr(ray_train, "report", store.report)
    monkeypatch.setattr(ray_train, "latest_checkpoint", store.latest)
    out = loop.train_loop_per_worker(config)
    from safetensors.torch import load_file

    return out, store, load_file(str(store.dirs[-1] / loop.TRAINABLE_FILE))


def _sft_state(tmp) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(tmp / "sft_model" / "model.safetensors"))


def test_rl_learns_the_rewarded_item_and_hands_back_its_best_step(rl_problem, single_process_dist_env,
                                                                   monkeypatch):
    tmp, sids, val_prompts, rows = rl_problem
    out, store, final = _run(tmp, sids, val_prompts, rows, 0, monkeypatch)
    h = out["history"]
    mrr = dict((s, v) for s, v in h["val"]["val_mrr"])
    assert sorted(mrr) == [0, 2, 4]  # the SFT model's own validation first
    assert mrr[4] > mrr[0]  # the rewarded item climbs for unseen prompts too
    assert set(STAT_KEYS) <= set(h["stats"]) and len(h["stats"]["reward_mean"]) == 4
    assert all(0.0 <= v <= 1.0 for _, v in h["stats"]["reward_mean"])
    best = h["best"]
    assert best["metric"] == "val_mrr" and best["start"] == mrr[0] and best["value"] == max(mrr.values())
    assert best["step"] == max(mrr, key=lambda s: (mrr[s], -s)) and best["step"] > 0
    assert "stopped_at" not in h and out["step"] == 4
    # One update per rollout (the default): on policy, ratio exactly 1, nothing ever clipped.
    assert [v for _, v in h["stats"]["ratio_mean"]] == [1.0] * 4
    assert [v for _, v in h["stats"]["clip_fraction"]] == [0.0] * 4
    sft = _sft_state(tmp)
    assert any(not torch.equal(final[n], sft[n]) for n in sft)  # trained tensors, not the start


def test_rl_that_only_hurts_exports_the_sft_model_and_stops(rl_problem, single_process_dist_env, monkeypatch):
    """Rewarded item A, validated on item B: validation MRR falls, so the best is step 0 (the
    SFT model, bit for bit) and stop_margin 0 stops the run at its first validation."""
    tmp, sids, val_prompts, rows = rl_problem
    from gti.eval.decode import score_all_sids
    from gti.train.sft_task import load_causal_lm

    model = load_causal_lm(tmp / "sft_model", C.RunConfig())
    b = int(score_all_sids(model, val_prompts[0], sids).argmax())  # the item the SFT model ranks first
    assert b != 0
    out, store, final = _run(tmp, sids, val_prompts, rows, b, monkeypatch, stop_margin=0.0)
    h = out["history"]
    assert h["best"]["step"] == 0 and h["stopped_at"] == 2 and out["step"] == 2
    assert h["val"]["val_mrr"][1][1] < h["val"]["val_mrr"][0][1]
    sft = _sft_state(tmp)
    assert sorted(final) == sorted(sft)
    for n in sft:
        assert torch.equal(final[n], sft[n]), n
    # A group restarted after that final checkpoint (stopped early) trains nothing more.
    from types import SimpleNamespace

    monkeypatch.setattr(ray_train, "latest_checkpoint", _Store(tmp, store.dirs[-1]).latest)
    _, done = loop._resume(SimpleNamespace(engine=None, tc=C.RunConfig().rl.model_copy(update={"steps": 4}), keeper=None))
    assert done is not None and done["step"] == 2


@pytest.mark.parametrize("updates_per_rollout", [1, 2])
def test_a_resumed_rl_run_equals_an_uninterrupted_one(rl_problem, single_process_dist_env, monkeypatch,
                                                       updates_per_rollout):
    """Sampling rollouts (seeded per micro-step): resuming from the step-2 checkpoint (its
    optimizer state, data position, history and best tensors) gives the same final tensors;
    with 2 updates per rollout the checkpoint falls on a cycle start, so the resumed worker
    (its rollouts gone with its process) rolls out exactly what the uninterrupted one did."""
    tmp, sids, val_prompts, rows = rl_problem
    rl = {"rollout": "sample", "updates_per_rollout": updates_per_rollout}
    ref_out, ref_store, ref_final = _run(tmp, sids, val_prompts, rows, 0, monkeypatch, **rl)
    mid = ref_store.dirs[0]
    assert mid.name == "ckpt-0002" and (mid / "best.safetensors").exists()
    out, _, final = _run(tmp, sids, val_prompts, rows, 0, monkeypatch, start=mid, store_dir="resumed", **rl)
    for k in ("reward_mean", "kl", "clip_fraction", "ratio_mean"):
        got, want = out["history"]["stats"][k], ref_out["history"]["stats"][k]
        assert [s for s, _ in got] == [s for s, _ in want] == [1, 2, 3, 4]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-6)
    assert out["history"]["best"] == ref_out["history"]["best"]
    assert out["history"]["val"] == ref_out["history"]["val"]
    for n in ref_final:
        torch.testing.assert_close(final[n], ref_final[n], rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- updates per rollout
def test_updates_per_rollout_is_a_validated_rl_field():
    cfg = C.RunConfig()
    assert cfg.rl.updates_per_rollout == 1 and grpo_settings(cfg).updates_per_rollout == 1
    assert "updates_per_rollout" in C.RunConfig.model_fields["rl"].annotation.model_fields
    cfg = C.RunConfig.model_validate({"rl": {"updates_per_rollout": 5}})  # checkpoint_every 10
    assert grpo_settings(cfg).updates_per_rollout == 5
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        C.RunConfig.model_validate({"rl": {"updates_per_rollout": 0}})
    with pytest.raises(ValueError, match=r"checkpoint_every \(10\) must be a multiple of rl.updates_per_rollout \(4\)"):
        C.RunConfig.model_validate({"rl": {"updates_per_rollout": 4}})
    ok = C.RunConfig.model_validate({"rl": {"updates_per_rollout": 4, "checkpoint_every": 8}})
    assert (ok.rl.updates_per_rollout, ok.rl.checkpoint_every) == (4, 8)


def test_rollout_cycles_count_optimizer_steps():
    """grad_accum 2, 3 updates per rollout: optimizer steps 0-2 are cycle 0 (update 0 rolls
    out), 3-5 cycle 1; each micro-step keeps its slot, so slot i reuses slot i's rollout."""
    got = [rollout_cycle(m, 2, 3) for m in range(12)]
    assert got == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1),
                   (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1), (1, 2, 0), (1, 2, 1)]
    assert [rollout_cycle(m, 1, 1) for m in range(3)] == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_several_updates_per_rollout_through_the_loop_clip(rl_problem, single_process_dist_env, monkeypatch,
                                                          grad_accum):
    """rl.steps 4 optimizer steps, 2 updates per rollout: steps 1 and 3 roll out (one rollout per
    micro-batch slot) and update on policy (ratio exactly 1, clip fraction 0); steps 2 and 4
    reuse those rollouts, roll nothing out, and their ratio to the rollout policy is clipped."""
    tmp, sids, val_prompts, rows = rl_problem
    from gti.rl import step as rl_step

    calls = []
    real = rl_step.grpo_rollout

    def counted(*a, **k):
        calls.append(k["seed"])
        return real(*a, **k)

    monkeypatch.setattr(rl_step, "grpo_rollout", counted)
    out, _, _ = _run(tmp, sids, val_prompts, rows, 0, monkeypatch, rollout="sample", updates_per_rollout=2,
                     grad_accum=grad_accum, reward={"hit": 1.0, "prefix": 0.5})
    h = out["history"]
    assert out["step"] == 4 and len(calls) == 2 * grad_accum == len(set(calls))
    st = {k: dict((s, v) for s, v in pts) for k, pts in h["stats"].items()}
    assert [st["ratio_mean"][s] for s in (1, 3)] == [1.0, 1.0]
    assert [st["clip_fraction"][s] for s in (1, 3)] == [0.0, 0.0]
    assert all(st["ratio_mean"][s] != 1.0 for s in (2, 4))
    assert max(st["clip_fraction"][s] for s in (2, 4)) > 0.0, st["clip_fraction"]
    assert all(st["rollout_s"][s] > 0 for s in (1, 3)) and all(st["rollout_s"][s] == 0.0 for s in (2, 4))
    assert st["reward_mean"][2] == st["reward_mean"][1] and st["reward_mean"][4] == st["reward_mean"][3]
