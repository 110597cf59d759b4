"""The NaN/inf stop of the training loop: a step whose loss or gradient norm is not finite ends
training with one line naming the section and the step.

What it is for: `gti.train.loop` calls `check_step(config, rank, step, loss, grad_norm,
bad_ranks)` after every optimizer step, on values all-reduced over the ranks (so every rank
stops at the same step, before that step's checkpoint: no NaN row is ever exported).
`check_finite` is the pure test (`NonFiniteError`, a `GtiError`: the CLI prints it as one line,
`gti.common.errors.user_error` finds it inside Ray Train's failure); `mark` / `raise_if_marked`
stop a worker group Ray Train restarts within the same `fit` call at once.

What it does not know: DeepSpeed, Ray, the model or the task.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from typing import TYPE_CHECKING

from gti.common.errors import NonFiniteError

if TYPE_CHECKING:
    from gti.train.worker_config import WorkerConfig


def check_finite(section: str, step: int, loss: float, grad_norm: float | None, bad_ranks: float = 0.0) -> None:
    """NonFiniteError naming the step when the step's loss or gradient norm is NaN or infinite
    (`bad_ranks`: how many ranks saw a non-finite local gradient norm, all-reduced). A NaN loss
    poisons the trained rows, which would export as NaN and evaluate as zeros hours later."""
    what = []
    if not math.isfinite(loss):
        what.append(f"loss is {loss}")
    if grad_norm is not None and not math.isfinite(grad_norm):
        what.append(f"gradient norm is {grad_norm}")
    elif bad_ranks > 0:
        what.append(f"gradient norm is not finite on {int(bad_ranks)} worker(s)")
    if what:
        raise NonFiniteError(
            f"{section}: training stopped at step {step}: {' and '.join(what)} (lower {section}.lr, "
            f"set {section}.max_grad_norm, or check the data; nothing of this run was exported)")


def check_step(config: "WorkerConfig", rank: int, step: int, loss: float, grad_norm: float | None,
               bad_ranks: float = 0.0) -> None:
    """`check_finite` for the loop's step, recording a stop for restarted workers (`mark`)."""
    try:
        check_finite(config.task, step, loss,
                     None if grad_norm is None else float(grad_norm), bad_ranks)
    except NonFiniteError as err:
        mark(config, rank, str(err))
        raise


def marker_path(config: "WorkerConfig") -> Path | None:
    """`<storage>/<name>.nonfinite.json` beside the run's progress file (None without one)."""
    pf = config.progress_file
    return Path(pf).with_name(Path(pf).name.replace(".progress.jsonl", "") + ".nonfinite.json") if pf else None


def mark(config: "WorkerConfig", rank: int, message: str) -> None:
    """Rank 0 records the NonFiniteError of this `fit` call, so that a worker group Ray Train
    restarts (train.max_failures) fails at once with the same line instead of replaying the
    steps since the last checkpoint into the same NaN."""
    marker = marker_path(config)
    if rank == 0 and marker is not None and config.fit_id:
        try:
            marker.write_text(json.dumps({"fit_id": config.fit_id, "message": message}))
        except OSError:
            pass


def raise_if_marked(config: "WorkerConfig") -> None:
    """NonFiniteError when an earlier attempt of this same `fit` call stopped on a NaN/inf
    (a later `fit`, e.g. a rerun of the stage, has another fit_id and trains afresh)."""
    marker = marker_path(config)
    if marker is None or not config.fit_id or not marker.is_file():
        return
    try:
        saved = json.loads(marker.read_text())
    except (OSError, ValueError):
        return
    if saved.get("fit_id") == config.fit_id:
        raise NonFiniteError(str(saved.get("message")))
