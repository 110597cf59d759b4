"""Fault injection for the reliability tests: a Train worker that kills its own process once.

What it is for: `maybe_fail(config, rank, ckpt_step)`, which the shared loop calls after the
step named by `config.fault` (`gti.train.worker_config.FaultInjection`), so a test can prove
that a worker group restarted from the latest checkpoint trains the same steps.

What it does not know: training, the task, or Ray (the checkpoint registry is read through
`gti.train.ray_train`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gti.train.worker_config import WorkerConfig


def maybe_fail(config: "WorkerConfig", rank: int, ckpt_step: int) -> None:
    """Rank `fail_rank` kills its own process once (guarded by the marker file `fail_marker`,
    created just before dying).

    It first waits (up to `fail_wait_s`, default 120 s) until the controller has registered
    the checkpoint of `ckpt_step` (the last one before this step): a checkpoint still queued
    when the worker dies is lost, so without the wait the resume point would depend on the
    controller's 2-s poll and the machine's load, and the tests could not name it."""
    fault = config.fault
    if fault is None or rank != fault.fail_rank:
        return
    marker = Path(fault.fail_marker)
    if marker.exists():
        return
    deadline = time.monotonic() + float(fault.fail_wait_s)
    pf = config.progress_file
    while ckpt_step > 0 and pf and time.monotonic() < deadline:
        from gti.train import ray_train

        got = ray_train.registered_checkpoint_step(pf)
        if got is not None and got >= ckpt_step:
            break
        time.sleep(0.2)
    marker.write_text(str(os.getpid()))
    os._exit(1)
