"""Resuming a DeepSpeed checkpoint without running code from it.

What it is for: `load_checkpoint(engine, load_dir, tag, **kw)` is the one call through which the
training loop resumes DeepSpeed state. DeepSpeed's `TorchCheckpointEngine.load` (0.19) uses full
pickle (`torch.load(weights_only=False)`) on files under `run_dir`, which cluster configs put on
shared storage: anyone who can write there could run code as the user on the next resume. Here
every file is read with `torch.load(weights_only=True)` plus a small allow-list
(`allowed_globals`), and a file that needs anything else stops the resume with one line naming
the file and the global it asked for.

What it does not know: Ray, which task trains, what the loop state holds (JSON, read by the loop).
"""

from __future__ import annotations

import functools
import os
import pickle
import re
from contextlib import contextmanager
from typing import Any, Iterator

from gti.common.errors import GtiError


class UnsafeCheckpointError(GtiError):
    """A checkpoint file holds a pickled object outside the allow-list; it was not loaded."""


def allowed_globals() -> list:
    """The non-tensor types DeepSpeed's own checkpoints hold (optimizer-state files): what
    DeepSpeed itself writes for ZeRO 0-3 with and without bf16 (measured with
    `torch.serialization.get_unsafe_globals_in_checkpoint`), three inert DeepSpeed types."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


# torch's multi-line refusal names the global as "Unsupported global: GLOBAL posix.system ...".
_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def _refusal(path: str, err: Exception) -> UnsafeCheckpointError:
    m = _GLOBAL.search(str(err))
    what = f"a pickled '{m.group(1)}'" if m else "a pickled object"
    return UnsafeCheckpointError(
        f"{path}: holds {what}, which is outside the checkpoint allow-list; not loaded "
        "(resume reads tensors only: delete the run's checkpoints to start this stage afresh)"
    )


def safe_torch_load(path: str, map_location: Any = None) -> Any:
    """`torch.load(path, weights_only=True)` with the DeepSpeed allow-list; one-line error."""
    import torch

    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refusal(str(path), e) from None


@functools.lru_cache(maxsize=None)
def _engine_class():
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeCheckpointEngine(TorchCheckpointEngine):
        """DeepSpeed's torch checkpoint engine, loading with `weights_only=True` (saves unchanged)."""

        def load(self, path: str, map_location=None):
            return safe_torch_load(path, map_location=map_location)

    return SafeCheckpointEngine


@contextmanager
def _forced_weights_only() -> Iterator[None]:
    # torch reads this variable on every call, and it overrides an explicit weights_only=False.
    old = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = old


def load_checkpoint(engine, load_dir: str, tag: str, **kw: Any) -> tuple[Any, Any]:
    """`engine.load_checkpoint(load_dir, tag=tag, **kw)` reading tensors only.

    Two layers: the engine's checkpoint engine is replaced by `SafeCheckpointEngine` (names the
    file), and `TORCH_FORCE_WEIGHTS_ONLY_LOAD` is set while loading, so a `torch.load` elsewhere
    in DeepSpeed's load path is held to the same rule. Files DeepSpeed does not read for `tag`
    are never opened.

    Raises `UnsafeCheckpointError` (one line, naming the file) when a file DeepSpeed reads holds
    anything but tensors, plain values and the allow-list; nothing in it is executed."""
    import torch
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    if engine.load_universal_checkpoint():
        # Universal checkpoints are read by other code paths (whole-pickle torch.load calls).
        raise GtiError("DeepSpeed 'checkpoint.load_universal' is not supported: gti resumes its own checkpoints only")
    safe = _engine_class()
    current = engine.checkpoint_engine
    if not isinstance(current, safe):
        if type(current) is not TorchCheckpointEngine:
            raise GtiError(f"DeepSpeed checkpoint engine {type(current).__name__} is not supported for resume "
                           "(gti's DeepSpeed config never selects one)")
        # Saves are unchanged (the subclass inherits them), so it stays installed.
        engine.checkpoint_engine = safe(engine._config)
    try:
        with _forced_weights_only(), torch.serialization.safe_globals(allowed_globals()):
            return engine.load_checkpoint(load_dir, tag=tag, **kw)
    except pickle.UnpicklingError as e:  # a torch.load outside the checkpoint engine
        raise _refusal(str(load_dir), e) from None
