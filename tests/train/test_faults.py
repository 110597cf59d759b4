"""gti.train.faults: only the named rank dies, only once (the marker), and it dies for real."""

from __future__ import annotations

import subprocess
import sys

from gti.train.faults import maybe_fail
from gti.train.worker_config import FaultInjection, WorkerConfig


def _config(marker, rank=0):
    return WorkerConfig(task="sft", hooks=None, run_config={}, pad_id=0,
                        fault=FaultInjection(fail_at_step=3, fail_marker=str(marker), fail_rank=rank))


def test_other_ranks_and_a_second_time_do_not_die(tmp_path):
    marker = tmp_path / "died"
    maybe_fail(_config(marker, rank=1), rank=0, ckpt_step=0)  # not the failing rank
    marker.write_text("1")
    maybe_fail(_config(marker), rank=0, ckpt_step=0)  # already died once
    maybe_fail(WorkerConfig(task="sft", hooks=None, run_config={}, pad_id=0), rank=0, ckpt_step=0)


def test_the_failing_rank_writes_its_marker_and_exits(tmp_path):
    marker = tmp_path / "died"
    code = ("from gti.train.faults import maybe_fail; from gti.train.worker_config import FaultInjection, "
            f"WorkerConfig; maybe_fail(WorkerConfig(task='sft', hooks=None, run_config={{}}, pad_id=0, "
            f"fault=FaultInjection(3, {str(marker)!r})), 0, 0); print('survived')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "survived" not in out.stdout
    assert marker.read_text().strip().isdigit()
