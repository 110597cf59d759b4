"""Helpers shared by several test folders (tests/ is on sys.path through tests/conftest.py;
import them as `from testkit import ...`, never `from conftest import ...`, which would run
the conftest a second time).

`adopt_tiny_upstream(upstream, run_dir)` puts the session's shared tiny stages (the
`tiny_upstream` fixture of tests/conftest.py) into a run folder.

`load_bench(name)` imports bench/<name>.py as a module (bench/ is not a package).

`FailOnceFit` stands in for `gti.train.loop.fit`: it records every call (loop config, the
training rows in order, the train config, storage path and run name) and raises on the first,
as a run killed before its first step would end; later calls go to the real `fit`. A module
that trains through the shared loop resumes a killed run only by calling `fit` again with the
same storage path, run name, config and rows (the loop's own resume, worker and driver killed,
is proven for real in tests/train/test_loop.py and tests/e2e/test_multinode.py), so
`assert_same_run` is that module's whole resume contract, checked without a second Train run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py imported as module `bench_<name>`."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def adopt_tiny_upstream(upstream: Path, run_dir: Path) -> Path:
    """Hard-link the shared tiny stages (ingest..pairs) into run_dir; returns run_dir."""
    from gti.experiments.shared import adopt_shared

    adopt_shared(upstream, run_dir)
    return run_dir


class WorkerDied(RuntimeError):
    """What the first call raises."""


def dataset_rows(ds) -> list[str]:
    """A Ray dataset's rows, in order, as comparable strings (numpy arrays as lists)."""
    import numpy as np

    return [repr({k: np.asarray(v).tolist() for k, v in sorted(r.items())}) for r in ds.take_all()]


class FailOnceFit:
    def __init__(self, real: Callable[..., Any]) -> None:
        self.real = real
        self.calls: list[dict] = []

    def __call__(self, loop_config, train_ds, train_cfg, **kw):
        self.calls.append({"loop_config": loop_config, "rows": dataset_rows(train_ds), "train_cfg": train_cfg,
                           "storage_path": str(kw["storage_path"]), "name": kw["name"]})
        if len(self.calls) == 1:
            raise WorkerDied("training worker died before its first step (test)")
        return self.real(loop_config, train_ds, train_cfg, **kw)

    def assert_same_run(self) -> None:
        """The second call hands the loop exactly the run the first one started."""
        assert len(self.calls) == 2, f"{len(self.calls)} fit calls"
        a, b = self.calls
        assert a["storage_path"] == b["storage_path"], (a["storage_path"], b["storage_path"])
        assert a["name"] == b["name"], (a["name"], b["name"])
        assert a["train_cfg"] == b["train_cfg"]
        assert a["loop_config"] == b["loop_config"], sorted(
            k for k in set(a["loop_config"]) | set(b["loop_config"])
            if a["loop_config"].get(k) != b["loop_config"].get(k))
        assert len(a["rows"]) > 0 and a["rows"] == b["rows"]
