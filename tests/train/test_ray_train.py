"""gti/train/ray_train.py: the one Ray Train driver. Fast: importing it starts nothing and a
spec's defaults are the ones the RQ-VAE relies on (no order-preserving shards, no retries);
slow: a trivial worker through run_trainer, and a worker's GtiError coming back as itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gti.train.ray_train import TrainerSpec


def test_import_is_lazy_and_spec_defaults():
    out = subprocess.run([sys.executable, "-c", "import sys, gti.train.ray_train; print('ray' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    spec = TrainerSpec(name="x", storage_path=Path("/tmp/x"), num_workers=2)
    assert (spec.preserve_order, spec.max_failures, spec.backend, spec.env, spec.callbacks) == (False, 0, None, {}, [])


def test_registered_checkpoint_step_reads_the_snapshot_and_tolerates_its_absence(tmp_path):
    import json

    from gti.train.ray_train import progress_path, registered_checkpoint_step

    pf = progress_path(tmp_path, "run")
    assert registered_checkpoint_step(pf) is None  # no snapshot yet
    (tmp_path / "run").mkdir()
    snap = tmp_path / "run" / "checkpoint_manager_snapshot.json"
    snap.write_text("{not json")
    assert registered_checkpoint_step(pf) is None  # half-written
    snap.write_text(json.dumps({"latest_checkpoint_result": None}))
    assert registered_checkpoint_step(pf) is None  # no checkpoint registered
    snap.write_text(json.dumps({"latest_checkpoint_result": {"metrics": {"step": 40, "loss": 1.0}}}))
    assert registered_checkpoint_step(pf) == 40


def _worker(config):
    import json
    import tempfile

    from gti.common.errors import DataError
    from gti.train import ray_train

    if config.get("fail"):
        raise DataError("bad.parquet: row 3")
    rank, world = ray_train.worker_rank_world()
    with open(config["progress_file"], "a") as fh:
        fh.write(json.dumps({"rank": rank}) + "\n")
    with tempfile.TemporaryDirectory() as d:
        Path(d, "state.json").write_text(json.dumps({"world": world}))
        ray_train.report({"done": 1, "step": 3}, checkpoint_dir=d)


@pytest.mark.slow
@pytest.mark.ray
def test_run_trainer_reads_the_final_checkpoint_and_unwraps_user_errors(tmp_path, ray_start_4_cpus):
    import json

    import ray

    from gti.common.errors import DataError
    from gti.train.ray_train import progress_path, registered_checkpoint_step, run_trainer

    seen = []
    spec = TrainerSpec(name="t", storage_path=tmp_path, num_workers=1)
    got, metrics, _ = run_trainer(_worker, {}, {"train": ray.data.range(4)}, spec,
                                  lambda d: json.loads((d / "state.json").read_text()), progress=seen.append)
    assert got == {"world": 1} and metrics["done"] == 1 and seen == [{"rank": 0}]
    # The controller's snapshot, as Ray writes it, names the registered checkpoint's step.
    assert registered_checkpoint_step(progress_path(tmp_path, "t")) == 3
    with pytest.raises(DataError, match="bad.parquet: row 3"):
        run_trainer(_worker, {"fail": True}, {"train": ray.data.range(4)},
                    TrainerSpec(name="f", storage_path=tmp_path, num_workers=1), lambda d: None)
