"""gti.train.safe_checkpoint through the loop's real resume (`gti.train.loop._resume`) on a
single-process DeepSpeed engine: DeepSpeed's own checkpoints (ZeRO 0-3, fp32 and bf16) load
with weights_only=True, and a pickle planted in the checkpoint folder is never executed."""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gti.config import ModelConfig
from gti.config.train import GroundConfig
from gti.lm import models, new_rows
from gti.train import loop, ray_train, safe_checkpoint
from gti.train.engine import make_engine


class _Payload:
    """Unpickling this writes `marker`: what a hostile file in a shared run_dir would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def _engine(stage: int, bf16: bool):
    cfg = ModelConfig(name="tiny", tiny_hidden=32, tiny_layers=1, tiny_heads=2, tiny_tied=False)
    model, tok = models.build_tiny(cfg, seed=0)
    first = len(tok)
    new_rows.attach_new_rows(model, first, 8, torch.randn(8, 32, generator=torch.Generator().manual_seed(1)) * 0.02)
    new_rows.freeze_backbone(model)
    if bf16:
        model.to(torch.bfloat16)
    tc = GroundConfig(zero_stage=stage, batch_size=2, lr=1e-2, steps=4)
    engine, _ = make_engine(model, [p for p in model.parameters() if p.requires_grad], tc, 1,
                            use_gpu=False, bf16_weights=bf16)
    ids = torch.randint(first, first + 8, (2, 6), generator=torch.Generator().manual_seed(0))
    out = engine(input_ids=ids, labels=ids)
    engine.backward(out.loss)
    engine.step()
    return engine, tc


def _saved(tmp_path: Path, engine) -> Path:
    """A checkpoint folder as the loop writes it (ds/ + gti_state.json at step 1)."""
    d = tmp_path / "ckpt"
    engine.save_checkpoint(str(d / loop.DS_DIR), tag=loop.CKPT_TAG, client_state={"step": 1},
                           exclude_frozen_parameters=True)
    (d / loop.STATE_FILE).write_text('{"step": 1, "epoch": 0, "offset": 2, "history": {}}')
    return d


def _resume(monkeypatch, engine, tc, d: Path):
    @contextmanager
    def latest():
        yield d

    monkeypatch.setattr(ray_train, "latest_checkpoint", latest)
    return loop._resume(SimpleNamespace(engine=engine, tc=tc, keeper=None))


@pytest.mark.parametrize("stage,bf16", [(0, False), (2, True), (3, False)])
def test_deepspeed_checkpoints_resume_with_weights_only(single_process_dist_env, tmp_path, monkeypatch,
                                                        stage, bf16):
    """The allow-list covers what DeepSpeed writes: the resume restores the trained rows."""
    engine, tc = _engine(stage, bf16)
    d = _saved(tmp_path, engine)
    want = {k: v.clone() for k, v in engine.module.state_dict().items() if "new_rows" in k}
    with torch.no_grad(), new_rows.gathered(list(engine.module.parameters())):
        for p in new_rows.new_rows_parameters(engine.module):
            p.zero_()
    state, done = _resume(monkeypatch, engine, tc, d)
    assert done is None and state["step"] == 1 and state["offset"] == 2
    assert isinstance(engine.checkpoint_engine, safe_checkpoint._engine_class())
    with new_rows.gathered(list(engine.module.parameters())):
        got = {k: v for k, v in engine.module.state_dict().items() if "new_rows" in k}
        for k in want:
            if want[k].numel():  # ZeRO-3 holds partitioned (empty) placeholders outside gather
                torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def test_planted_pickle_is_never_executed(single_process_dist_env, tmp_path, monkeypatch):
    """A hostile model-states file stops the resume with one line naming it; an extra pickle
    DeepSpeed does not read for our tag is ignored; the payload never runs."""
    engine, tc = _engine(1, False)
    d = _saved(tmp_path, engine)
    marker = tmp_path / "marker"
    blob = pickle.dumps({"module": _Payload(marker)})
    pickle.loads(blob)  # the payload is live: plain unpickling runs it
    assert marker.exists()
    marker.unlink()

    stray = d / loop.DS_DIR / loop.CKPT_TAG / "evil.pt"
    torch.save({"x": _Payload(marker)}, stray)
    state, done = _resume(monkeypatch, engine, tc, d)  # ignored: not a file DeepSpeed reads
    assert done is None and state["step"] == 1 and not marker.exists()

    target = d / loop.DS_DIR / loop.CKPT_TAG / "mp_rank_00_model_states.pt"
    torch.save({"module": _Payload(marker)}, target)
    with pytest.raises(safe_checkpoint.UnsafeCheckpointError) as ei:
        _resume(monkeypatch, engine, tc, d)
    msg = str(ei.value)
    assert "\n" not in msg and str(target) in msg and "a pickled 'exec'" in msg
    assert not marker.exists()

    target.write_bytes(blob)  # legacy (non-zip) pickle format: refused the same way
    with pytest.raises(safe_checkpoint.UnsafeCheckpointError):
        _resume(monkeypatch, engine, tc, d)
    assert not marker.exists()


def test_safe_torch_load_refuses_a_pickle_outside_the_allow_list(tmp_path):
    marker = tmp_path / "marker"
    f = tmp_path / "optim.pt"
    torch.save({"state": torch.ones(2), "bad": _Payload(marker)}, f)
    with pytest.raises(safe_checkpoint.UnsafeCheckpointError, match=r"optim\.pt: holds a pickled 'exec'"):
        safe_checkpoint.safe_torch_load(str(f))
    assert not marker.exists()
    g = tmp_path / "ok.pt"
    torch.save({"state": torch.ones(2), "n": 3}, g)
    assert safe_checkpoint.safe_torch_load(str(g))["n"] == 3


def test_other_torch_loads_are_held_to_weights_only_while_resuming(tmp_path):
    """A `torch.load(weights_only=False)` elsewhere in DeepSpeed's load path is forced to
    weights_only while the resume runs, and only then."""
    marker = tmp_path / "marker"
    f = tmp_path / "zero_state.pt"
    torch.save({"bad": _Payload(marker)}, f)
    with safe_checkpoint._forced_weights_only():
        with pytest.raises(pickle.UnpicklingError):
            torch.load(f, weights_only=False)
    assert not marker.exists()
    torch.load(f, weights_only=False)  # outside the resume: the caller's choice again
    assert marker.exists()
