"""Helpers shared by several test folders (tests/ is on sys.path through tests/conftest.py;
import them as `from testkit import ...`, never `from conftest import ...`, which would run
the conftest a second time).

`adopt_tiny_upstream(upstream, run_dir)` puts the session's shared tiny stages (the
`tiny_upstream` fixture of tests/conftest.py) into a run folder.

`load_bench("<topic>/<script>")` imports bench/<topic>/<script>.py as a module (bench/ is not a
package; `load_bench("common")` is the scripts' shared module).

`walk_sequences(items, n_users, seed, max_train)` makes ingest's sequences for users walking the
catalog in steps of +1 (the next item is learnable from the history).

`stage_manifest(run_dir, stage, outputs, facts)` writes a fixture stage's `_manifest.json` (a
finished upstream stage without running it) and returns the stage folder.

`FailOnceFit` stands in for `gti.train.loop.fit`: it records every call (the typed worker
config, the training rows in order, the train config, storage path and run name) and raises on the first,
as a run killed before its first step would end; later calls go to the real `fit`. A module
that trains through the shared loop resumes a killed run only by calling `fit` again with the
same storage path, run name, config and rows (the loop's own resume, worker and driver killed,
is proven for real in tests/train/test_loop.py and tests/e2e/test_multinode.py), so
`assert_same_run` is that module's whole resume contract, checked without a second Train run.

Without Ray at all (unit tests of the runners and their callers): `FailOnceFit(finished_fit)`
returns, on its second call, what `fit` returns for a finished run (`finished_fit`: the task's
tensors, a short falling history), and `fake_data(monkeypatch)` puts pyarrow readers in place
of the driver's two Ray Data readers (`RowsDataset`: the rows in order, `take_all` as
`dataset_rows` reads them); `no_ray(monkeypatch)` makes `ensure_ray` a recorded no-op.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(script: str) -> ModuleType:
    """bench/<script>.py (e.g. "serve/serve") imported as module `bench_<file stem>`; the script
    puts bench/ on sys.path itself for its `import common`."""
    path = BENCH / f"{script}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def adopt_tiny_upstream(upstream: Path, run_dir: Path) -> Path:
    """Hard-link the shared tiny stages (ingest..pairs) into run_dir; returns run_dir."""
    from gti.experiments.shared_stages import adopt_shared

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

    def __call__(self, config, train_ds, train_cfg, **kw):
        self.calls.append({"config": config, "rows": dataset_rows(train_ds), "train_cfg": train_cfg,
                           "storage_path": str(kw["storage_path"]), "name": kw["name"]})
        if len(self.calls) == 1:
            raise WorkerDied("training worker died before its first step (test)")
        return self.real(config, train_ds, train_cfg, **kw)

    def assert_same_run(self) -> None:
        """The second call hands the loop exactly the run the first one started."""
        assert len(self.calls) == 2, f"{len(self.calls)} fit calls"
        a, b = self.calls
        assert a["storage_path"] == b["storage_path"], (a["storage_path"], b["storage_path"])
        assert a["name"] == b["name"], (a["name"], b["name"])
        assert a["train_cfg"] == b["train_cfg"]
        assert_same_config(a["config"], b["config"])
        assert len(a["rows"]) > 0 and a["rows"] == b["rows"]


def assert_same_config(a, b) -> None:
    """Two typed worker configs (`gti.train.worker_config.WorkerConfig`) are equal; the message
    names the fields that differ."""
    from dataclasses import fields

    from gti.train.worker_config import WorkerConfig

    assert isinstance(a, WorkerConfig) and isinstance(b, WorkerConfig), (type(a), type(b))
    assert a == b, sorted(f.name for f in fields(a) if getattr(a, f.name) != getattr(b, f.name))


# --------------------------------------------------------------------------- no Ray (unit tests)
class RowsDataset:
    """Stands in for a Ray Dataset: the rows ({column: list}), in training order."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def take_all(self) -> list[dict]:
        return list(self.rows)


def fake_data(monkeypatch) -> list[tuple]:
    """`gti.train.ray_train`'s Ray Data readers replaced by pyarrow ones (RowsDataset). The pairs
    reader keeps the "train" rows in a seeded order, as the real one shuffles them with its
    seed. Returns the calls: ("pairs", path, seed) / ("parquet", path, columns, materialize)."""
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from gti.train import ray_train

    calls: list[tuple] = []

    def train_pairs(path, seed, split="train"):
        calls.append(("pairs", str(path), seed))
        t = pq.read_table(str(path), columns=["split", "input_ids", "labels"])
        rows = t.filter(pc.equal(t["split"], split)).select(["input_ids", "labels"]).to_pylist()
        return RowsDataset([rows[i] for i in np.random.default_rng(seed).permutation(len(rows))])

    def read(path, columns, materialize=False):
        calls.append(("parquet", str(path), list(columns), materialize))
        return RowsDataset(pq.read_table(str(path), columns=list(columns)).to_pylist())

    monkeypatch.setattr(ray_train, "train_dataset_from_parquet", train_pairs)
    monkeypatch.setattr(ray_train, "read_parquet_dataset", read)
    return calls


def no_ray(monkeypatch) -> list:
    """`gti.ray_start.ensure_ray` as a no-op that records its calls (the callers import it
    inside their functions, so the module attribute is what they get)."""
    import gti.ray_start as ray_helper

    calls: list = []
    monkeypatch.setattr(ray_helper, "ensure_ray", lambda cfg: calls.append(cfg))
    return calls


def finished_fit(config, train_ds, train_cfg, **kw):
    """What `gti.train.loop.fit` returns for a finished run, without Ray: the task's trained
    tensors (grounding: the initial rows + 1; SFT: every parameter of the start model, + 0.01),
    a history of `train_cfg.steps` steps whose loss falls, one validation point at the end."""
    from safetensors.torch import load_file

    from gti import config as C
    from gti.train.loop import FitResult

    if config.task == "ground":
        state = {k: v + 1.0 for k, v in load_file(config.ground.init_path).items()}
        metric = "val_exact_match"
    else:
        from gti.train.sft_task import load_causal_lm

        model = load_causal_lm(config.sft.model_dir, C.validate(config.run_config))
        state = {n: p.detach().float() + 0.01 for n, p in model.named_parameters()}
        metric = "val_recall@10"
    steps = int(train_cfg.steps)
    history = {"loss": [[s, 3.0 - 0.1 * s] for s in range(1, steps + 1)],
               "val": {metric: [[steps, 0.5]]} if config.val is not None else {},
               "tokens_per_s": [[s, 100.0 * s] for s in range(1, steps + 1)]}
    return FitResult(state_dict=state, history=history, steps_done=steps, metrics={"step": steps},
                     path=str(Path(kw["storage_path"]) / kw["name"]), timing={"loop_s": 1.0}, precision="fp32")


def stage_manifest(run_dir: Path, stage: str, outputs: dict, facts: dict) -> Path:
    """run_dir/<stage>/ with a manifest of these outputs and facts (fingerprint `fp-<stage>`)."""
    from gti.run.manifest import Manifest

    d = Path(run_dir) / stage
    d.mkdir(parents=True, exist_ok=True)
    Manifest(stage=stage, fingerprint=f"fp-{stage}", config={}, outputs=outputs, facts=facts).write(d)
    return d


def walk_sequences(items: list[str], n_users: int, seed: int, max_train: int) -> list[dict]:
    """Rows of sequences.parquet: user u starts at a seeded item and walks +1 around the catalog,
    3..max_train-1 training items, then its valid and test items."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for u in range(n_users):
        start, n = int(rng.integers(0, len(items))), int(rng.integers(3, max_train))
        walk = [items[(start + j) % len(items)] for j in range(n + 2)]
        rows.append({"user_id": f"u{u}", "train_items": walk[:n], "valid_item": walk[n], "test_item": walk[n + 1]})
    return rows
