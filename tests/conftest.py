"""Shared fixtures. Test folders mirror platform/gti/; put folder-specific fixtures in that
folder's own conftest.py."""

from __future__ import annotations

import os
import socket
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


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
