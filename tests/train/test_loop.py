"""gti.train.loop: batch collation, the grounding hooks, and optimizer steps through the real
DeepSpeed engine in one process (old rows stay bit-identical with weight decay on)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gti.config import ModelConfig
from gti.config.train import GroundConfig
from gti.lm import models, new_rows
from gti.train.deepspeed_config import build_ds_config
from gti.train.ground_task import ground_trainable_state
from gti.train.engine import make_engine
from gti.train.loop import _manual_grad_norm


def _tiny_split_model(tied: bool, n_new: int = 12):
    cfg = ModelConfig(name="tiny", tiny_hidden=32, tiny_layers=1, tiny_heads=2, tiny_tied=tied)
    model, tok = models.build_tiny(cfg, seed=0)
    first = len(tok)
    d = model.config.hidden_size
    g = torch.Generator().manual_seed(1)
    new_rows.attach_new_rows(model, first, n_new, torch.randn(n_new, d, generator=g) * 0.02)
    new_rows.freeze_backbone(model)
    return model, first


@pytest.mark.parametrize(
    "stage,tied",
    [
        (2, True), (2, False), (0, True), (0, False), (3, True), (3, False),
    ],
)
def test_engine_steps_leave_old_rows_bit_identical(single_process_dist_env, stage, tied):
    """Three AdamW steps with weight decay through DeepSpeed (ZeRO `stage`): every frozen
    tensor (old embedding rows, old head, backbone) is bit-identical; the new rows moved."""
    model, first = _tiny_split_model(tied)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == (1 if tied else 2)
    tc = GroundConfig(zero_stage=stage, batch_size=2, lr=1e-2, weight_decay=0.5, steps=3)
    engine, _ = make_engine(model, trainable, tc, 1, use_gpu=False, bf16_weights=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, first + 12, (2, 10), generator=g)
        ids[:, -3:] = torch.randint(first, first + 12, (2, 3), generator=g)  # new tokens present
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
    after = dict(engine.module.named_parameters())
    with new_rows.gathered(list(after.values())):
        for n, p in after.items():
            if "new_rows" in n:
                assert not torch.equal(p.detach().float(), before[n].float()), n
            else:
                assert torch.equal(p.detach(), before[n]), f"{n} changed"
    state = ground_trainable_state(engine.module)
    assert sorted(state) == (["e_new"] if tied else ["e_new", "head_new"])
    assert state["e_new"].shape == (12, 32) and state["e_new"].dtype == torch.float32
    assert not torch.equal(state["e_new"], before["model.embed_tokens.new_rows"])


def test_manual_grad_norm_matches_torch():
    p1 = torch.nn.Parameter(torch.zeros(3))
    p2 = torch.nn.Parameter(torch.zeros(2))
    p1.grad = torch.tensor([3.0, 0.0, 0.0])
    p2.grad = torch.tensor([0.0, 4.0])
    assert _manual_grad_norm([p1, p2]) == pytest.approx(5.0)


# --------------------------------------------------------------------------- on Ray Train
# Each Ray Train run costs ~10 s of worker start-up on 2 cores; the step count is kept short.
STEPS, CKPT, LR = 20, 5, 5e-2
FAIL_AT = 12  # between the checkpoints at 10 and 15: the restart replays steps 11-12
FAIL_AGAIN = 17  # between 15 and 20: the retried worker group replays steps 16-17
def _loop_setup(problem: dict, fault=None, **ground_kw):
    from gti.config import RunConfig
    from gti.config.train import GroundConfig
    from gti.train.worker_config import WorkerConfig

    g = dict(steps=STEPS, batch_size=8, num_workers=2, lr=LR, zero_stage=2, checkpoint_every=CKPT,
             val_every=STEPS // 2, log_every=1)
    g.update(ground_kw)
    run_cfg = RunConfig(model=problem["model_cfg"], ground=GroundConfig(**g))
    config = WorkerConfig.build("ground", run_cfg, problem["pad_id"], ground=problem["ground"], val=problem["val"],
                                fault=fault)
    return run_cfg, config


def _fit(problem, storage, name, fault=None, **ground_kw):
    from gti.train.ray_train import train_dataset_from_parquet
    from gti.train.loop import fit

    run_cfg, config = _loop_setup(problem, fault, **ground_kw)
    ds = train_dataset_from_parquet(problem["pairs"], seed=run_cfg.seed)
    return fit(config, ds, run_cfg.ground, storage_path=storage, name=name, log=lambda m: None)


def _progress_steps(storage: Path, name: str) -> list[int]:
    import json

    return [json.loads(l)["step"] for l in (storage / f"{name}.progress.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(grounding_problem, ray_start_4_cpus, tmp_path_factory):
    storage = tmp_path_factory.mktemp("ray_train")
    return _fit(grounding_problem, storage, "plain"), storage


@pytest.mark.slow
@pytest.mark.ray
def test_grounding_two_workers_zero2_learns(uninterrupted, grounding_problem):
    """2 Ray Train workers, DeepSpeed ZeRO-2 on CPU: loss falls, constrained text->SID exact
    match on the grounded items ends far above chance (1/24 for 24 items; 0.29 measured at 20 steps)."""
    res, storage = uninterrupted
    assert res.steps_done == STEPS
    assert _progress_steps(storage, "plain") == list(range(1, STEPS + 1))
    loss = [v for _, v in res.history["loss"]]
    assert len(loss) == STEPS
    assert sum(loss[-5:]) / 5 < 0.6 * sum(loss[:5]) / 5
    em = res.history["val"]["val_exact_match"]
    assert [s for s, _ in em] == [STEPS // 2, STEPS]
    assert em[-1][1] >= 0.2 > 4 / grounding_problem["n_items"]
    assert res.metrics["val_exact_match"] == em[-1][1]
    assert res.metrics["grad_norm_new_rows"] > 0
    assert res.metrics["tokens_per_s"] > 0
    e_new = res.state_dict["e_new"]
    assert e_new.shape == (grounding_problem["ground"].n_new, 64)
    assert res.state_dict["head_new"].shape == e_new.shape  # untied head: its own new rows


@pytest.mark.slow
@pytest.mark.ray
def test_restart_resumes_and_a_worker_failure_is_retried_to_the_same_rows(uninterrupted, grounding_problem, tmp_path):
    """Both recoveries of the shared loop, on one run name (two Train runs instead of three):
    1. the run dies at step FAIL_AT (rank 0, no retries) and raises; re-creating the trainer
       with the same storage path and name (a driver rerun) continues from the checkpoint
       before it;
    2. in that second run worker rank 1 kills its own process at step FAIL_AGAIN
       (FailureConfig(max_failures=1)): Ray Train restarts the group from the latest
       checkpoint.
    The run ends with the same new rows and validation as the uninterrupted run."""
    import torch

    ref, _ = uninterrupted
    storage = tmp_path / "ray_train"
    from gti.train.worker_config import FaultInjection

    fail = FaultInjection(fail_at_step=FAIL_AT, fail_rank=0, fail_marker=str(tmp_path / "failed_once"))
    with pytest.raises(Exception):
        _fit(grounding_problem, storage, "resume", fail, max_failures=0)
    assert (tmp_path / "failed_once").exists()
    again = FaultInjection(fail_at_step=FAIL_AGAIN, fail_rank=1, fail_marker=str(tmp_path / "failed_again"))
    res = _fit(grounding_problem, storage, "resume", again, max_failures=1)
    assert (tmp_path / "failed_again").exists()
    steps = _progress_steps(storage, "resume")
    resumed_from, retried_from = FAIL_AT // CKPT * CKPT, FAIL_AGAIN // CKPT * CKPT
    assert steps == (list(range(1, FAIL_AT + 1)) + list(range(resumed_from + 1, FAIL_AGAIN + 1))
                     + list(range(retried_from + 1, STEPS + 1)))
    assert res.steps_done == STEPS
    assert [s for s, _ in res.history["loss"]] == list(range(1, STEPS + 1))
    for k in ("e_new", "head_new"):
        torch.testing.assert_close(res.state_dict[k], ref.state_dict[k], rtol=0, atol=1e-6)
    assert res.history["val"] == ref.history["val"]
    # A finished run re-created (a driver killed after training, before export) is the loop's
    # `_resume` handing back the final checkpoint: test_a_final_checkpoint_is_handed_back_untrained.


def test_a_final_checkpoint_is_handed_back_untrained(tmp_path, monkeypatch):
    """The latest checkpoint is the final one (a driver killed after training, before export,
    re-creates the run): the worker trains nothing more and returns the saved history; the
    engine is never touched (None here). One step short, it loads DeepSpeed's state instead
    (recorded here, absent: the one-line error)."""
    import json
    from contextlib import contextmanager
    from types import SimpleNamespace

    from gti.train import loop, ray_train

    saved = {"step": 4, "epoch": 0, "offset": 8, "history": {"loss": [[4, 1.5]], "val": {}, "tokens_per_s": []},
             "timing": {"loop_s": 1.0}, "precision": "fp32"}
    (tmp_path / loop.STATE_FILE).write_text(json.dumps(saved))

    @contextmanager
    def latest():
        yield tmp_path

    monkeypatch.setattr(ray_train, "latest_checkpoint", latest)
    state, done = loop._resume(SimpleNamespace(engine=None, tc=GroundConfig(steps=4), keeper=None))
    assert state == saved
    assert done == {"step": 4, "history": saved["history"], "timing": {"loop_s": 1.0}, "precision": "fp32"}
    loads = []
    monkeypatch.setattr(loop.safe_checkpoint, "load_checkpoint", lambda engine, d, tag, **kw: loads.append(d) or (None, None))
    with pytest.raises(RuntimeError, match="no DeepSpeed state"):
        loop._resume(SimpleNamespace(engine=None, tc=GroundConfig(steps=5), keeper=None))
    assert loads == [str(tmp_path / loop.DS_DIR)]


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_weights_train_with_fp32_master_weights(single_process_dist_env, stage):
    """model.dtype bfloat16: the module holds bf16 weights, DeepSpeed's bf16 mode keeps fp32
    master copies for AdamW, the labelled-position loss and bf16 autocast run on them, and the
    trained rows come back as full fp32 (from the master copy)."""
    import deepspeed

    from gti.train.loss import make_forward

    model, first = _tiny_split_model(True)
    model.to(torch.bfloat16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    tc = GroundConfig(zero_stage=stage, batch_size=2, lr=1e-2, steps=2)
    engine, opt, _, _ = deepspeed.initialize(
        model=model, model_parameters=trainable,
        config=build_ds_config(tc, 1, use_gpu=False, bf16_weights=True),
    )
    forward = make_forward(engine.module, "bf16", "cpu")
    g = torch.Generator().manual_seed(0)
    before = new_rows.new_rows_parameters(engine.module)[0].detach().float().clone()
    for _ in range(2):
        ids = torch.randint(first, first + 12, (2, 8), generator=g)
        loss = forward(engine, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
        assert loss.dtype == torch.float32 and torch.isfinite(loss)
        engine.backward(loss)
        engine.step()
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    state = ground_trainable_state(engine.module)
    assert state["e_new"].dtype == torch.float32
    assert not torch.equal(state["e_new"], before)
    # The fp32 master differs from its bf16 rounding: updates smaller than bf16's resolution
    # are kept, which is why the master copy exists.
    assert not torch.equal(state["e_new"], state["e_new"].to(torch.bfloat16).float())


def test_training_attention_auto_is_eager_on_cpu_and_same_loss():
    """attn_implementation auto: eager on CPU (faster backward there), untouched on GPU; the
    loss is the same as with SDPA."""
    from gti.config import ModelConfig
    from gti.lm import models
    from gti.train.loss import set_training_attention
    from gti.train.loss import labelled_loss

    model, _ = models.build_tiny(ModelConfig(name="tiny"), seed=0)
    ids = torch.randint(0, 300, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    model.set_attn_implementation("sdpa")
    ref = labelled_loss(model, ids, mask, labels)
    assert set_training_attention(model, "auto", use_gpu=True) is None
    assert model.config._attn_implementation == "sdpa"
    assert set_training_attention(model, "auto", use_gpu=False) == "eager"
    assert model.config._attn_implementation == "eager"
    assert torch.allclose(labelled_loss(model, ids, mask, labels), ref, atol=1e-5)
    assert set_training_attention(model, "sdpa", use_gpu=False) == "sdpa"
