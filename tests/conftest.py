"""Shared fixtures. Test folders mirror platform/gti/; put folder-specific fixtures in that
folder's own conftest.py."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "jobs" / "configs"

# Same environment the Makefile sets, so `pytest` run by hand behaves like `make test`.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray Train's controller polls its workers every 2 s by default; each short test run then
# idles seconds at start and end. Every Ray the tests start (in-process, `ray start` heads and
# the local cluster script) inherits this.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# Serve's proxy ready check, as a local gti Ray sets it (gti.ray_start): Ray's 5 s killed the
# proxy on the loaded 2-core CI machine, and serve.start failed on it.
from gti.ray_start import LOCAL_SERVE_PROXY_READY_S, SERVE_PROXY_READY_ENV  # noqa: E402

os.environ.setdefault(SERVE_PROXY_READY_ENV, LOCAL_SERVE_PROXY_READY_S)

# What the slow suite may start in one session (tests/run_budget.py; issue 27). Counted, not
# timed: each Ray Train run costs ~25-35 s of worker start-up on the 2-core machine and each Ray
# instance ~3-5 s. Set from the measured suite (bench/test-suite/RESULTS.md "Test suite", issue 27): 23
# Train runs (39 before), 24 with the rl stage's (tests/stages/test_rl.py; the RL loop's
# resume and best-checkpoint rules run in one process, tests/train/test_rl_task.py), 23 since the
# two-node job test trains no SFT; Ray: one session Ray per xdist worker, two gti commands' own and the
# three nodes of the cluster that runs the Ray-job test (tests/e2e/test_multinode.py). A new test
# reuses what exists (the session's Ray, the shared tiny upstream in tests/conftest.py,
# one CLI run serving several assertions) or raises these here, where a reviewer sees it.
# 24 since the learnability gate's third walk (the sequence SFT objective, one SFT run).
BUDGET = {"train": 24, "ray": 7}

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_budget  # noqa: E402 - needs the path above (tests/ is not a package)
from run_budget import (  # noqa: E402,F401 - the budget's hooks, registered from this conftest
    pytest_runtest_protocol, pytest_sessionfinish, pytest_terminal_summary)

run_budget.install(BUDGET)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `make test` runs each half of the suite on two pytest-xdist workers, a whole file per worker
# at a time (`--dist loadfile`: module fixtures, such as one `gti vocab ground` run serving four
# tests, stay in one process), in collection order (`--no-loadscope-reorder`). The longest
# slow files go first, so that neither worker is left with a long file when the other is done
# (durations: runs/ci/slow-durations.txt, bench/test-suite/RESULTS.md "Test suite"). Order only: a file
# missing here still runs, after these.
LONGEST_FIRST = [
    "tests/e2e/test_multinode.py", "tests/train/test_loop.py", "tests/experiments/test_tune.py",
    "tests/e2e/test_learnability.py", "tests/refresh/test_command.py",
    "tests/experiments/test_compare.py", "tests/stages/test_sid.py", "tests/stages/test_sft.py",
    "tests/stages/test_ground.py", "tests/stages/test_pairs.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {f: i for i, f in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(it.nodeid.split("::", 1)[0], len(rank)))  # stable


@pytest.fixture
def tiny_cfg(tmp_path):
    """The tiny pipeline config (jobs/configs/tiny.yaml) with its run_dir in tmp_path."""
    from gti import config

    return config.load(CONFIGS / "tiny.yaml", [f"run_dir={tmp_path / 'run'}"])


@pytest.fixture(scope="session")
def ray_start_4_cpus():
    """A local Ray with 4 logical CPUs (oversubscribes a 2-core machine on purpose: Ray Train
    workers and Ray Data tasks need slots at the same time). Shared by the whole session."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    _init_ray_4_cpus()
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_upstream(tmp_path_factory, ray_start_4_cpus) -> Path:
    """jobs/configs/tiny.yaml's shared stages (ingest -> embed -> sid -> pairs), built once per
    session. Stage fingerprints do not hash `run_dir`, so a test puts them into its own run
    folder with `testkit.adopt_tiny_upstream` (hard links, `gti.experiments.shared_stages.adopt_shared`) and the
    pipeline finds them up to date, for any overrides that leave those stages' keys alone.
    Treat the folder as read-only: stages replace their outputs by renaming, never in place."""
    from gti import config
    from gti.run import pipeline

    run = tmp_path_factory.mktemp("tiny_upstream") / "run"
    pipeline.run(config.load(CONFIGS / "tiny.yaml", [f"run_dir={run}"]), to_stage="pairs", echo=lambda m: None)
    return run


@pytest.fixture
def tiny_run_dir(tiny_upstream, tmp_path) -> Path:
    """tmp_path/"run" holding the shared tiny stages (ingest..pairs) up to date."""
    from testkit import adopt_tiny_upstream

    return adopt_tiny_upstream(tiny_upstream, tmp_path / "run")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed (or timed-out) test on the shared Ray may leave trials, Train worker groups or
    placement groups holding its CPUs, and every later Ray test would then wait for resources
    until its own timeout. Restart the shared Ray right after such a failure."""
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and rep.when in ("setup", "call") and "ray_start_4_cpus" in item.fixturenames:
        import ray

        if ray.is_initialized():
            ray.shutdown()
            _init_ray_4_cpus()


def _init_ray_4_cpus() -> None:
    """Started like gti's own local Ray (gti.ray_start): one retry when the start times out,
    which Ray's raylet can do on a loaded machine."""
    import time

    import ray

    try:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    except Exception:  # noqa: BLE001 - e.g. "The current node timed out during startup"
        ray.shutdown()
        time.sleep(5)
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    from gti.common import ledger

    ledger.note("ray", "tests:ray_start_4_cpus")


@pytest.fixture
def single_process_dist_env(monkeypatch):
    """Env vars DeepSpeed needs in one process without a launcher."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    yield
    _reset_distributed()


def _reset_distributed() -> None:
    """Leave no process group behind: the next test may use another port, and DeepSpeed caches
    a clone of the world group (`groups._WORLD_GROUP`) that outlives a destroyed group."""
    import sys

    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if "deepspeed.utils.groups" in sys.modules:
        from deepspeed.utils import groups

        for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP",
                     "_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP"):
            if hasattr(groups, name):
                setattr(groups, name, None)


class DamagedFiles:
    """Builders of damaged inputs (issue 18): truncated compressed files, parquet parts with a
    corrupt data page or zero bytes. Every builder returns the path it wrote."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def truncated_gzip(self, name: str, text: str, cut: int = 40) -> Path:
        """`text` gzip-compressed with its last `cut` bytes cut off (the stream's end and CRC)."""
        import gzip

        p = self.root / name
        data = gzip.compress(text.encode())
        p.write_bytes(data[: len(data) - cut])
        return p

    @staticmethod
    def items_csv(n: int, start: int = 0) -> str:
        return "item_id,title\n" + "".join(f"{i},Item number {i} of the damaged-file corpus\n"
                                           for i in range(start, start + n))

    @staticmethod
    def items_jsonl(n: int, start: int = 0) -> str:
        import json

        return "".join(json.dumps({"item_id": str(i), "title": f"Item number {i}"}) + "\n"
                       for i in range(start, start + n))

    def parquet_parts(self, folder: str, n_parts: int = 3, rows: int = 1000, row_group: int = 250,
                      damage: tuple[int, int] | None = None) -> Path:
        """`n_parts` parquet files part-<k>.parquet of `rows` items each (ids k*rows + i); with
        damage=(part, row group), that row group's first page header is overwritten (footer
        intact, so the file opens and only reading that row group fails)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        d = self.root / folder
        d.mkdir(parents=True, exist_ok=True)
        for k in range(n_parts):
            ids = [str(k * rows + i) for i in range(rows)]
            pq.write_table(pa.table({"item_id": ids, "title": [f"Item {i}" for i in ids]}),
                           d / f"part-{k}.parquet", row_group_size=row_group)
        if damage is not None:
            part, rg = damage
            p = d / f"part-{part}.parquet"
            col = pq.ParquetFile(p).metadata.row_group(rg).column(0)
            off = col.dictionary_page_offset or col.data_page_offset
            b = bytearray(p.read_bytes())
            b[off : off + 40] = b"\xff" * 40
            p.write_bytes(bytes(b))
        return d

    @staticmethod
    def interactions_csv(path: Path, n_users: int, n_items: int, per_user: int = 6) -> Path:
        path.write_text("user_id,item_id,ts\n" + "".join(
            f"u{u},{(u * 7 + j) % n_items},{j}\n" for u in range(n_users) for j in range(per_user)))
        return path


@pytest.fixture
def damaged(tmp_path):
    """DamagedFiles writing under tmp_path."""
    return DamagedFiles(tmp_path)
