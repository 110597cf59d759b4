"""The one Ray Train driver, and the few Ray calls a training worker makes.

What it is for: `run_trainer(worker_fn, loop_config, datasets, spec)` is the only place that
builds a `TorchTrainer` and turns a typed worker config into Ray Train's `train_loop_config`.
The worker side (`worker_rank_world`, `latest_checkpoint`, `report`, `dataset_shard`,
`torch_device`, `prepare_ddp`) serves the training loops (`gti.train.loop` for grounding, SFT
and RL, `gti.train.rqvae_task` for the RQ-VAE), so no other module under `gti/train/` imports
Ray. `train_dataset_from_parquet` / `read_parquet_dataset` are the Ray Data side of the pairs
and SFT rows (the runners `gti.train.ground_run` / `sft_run` call them).

What it does not know: what a worker trains, what a checkpoint holds, or which stage called it.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator


@dataclass
class TrainerSpec:
    """Where and how a Ray Train run goes (one per call of `run_trainer`)."""

    name: str  # deterministic: a rerun with the same storage_path and name resumes
    storage_path: Path
    num_workers: int
    use_gpu: bool = False
    resources_per_worker: dict[str, float] | None = None
    max_failures: int = 0
    backend: str | None = None  # torch.distributed backend; None = Ray's default (gloo / nccl)
    env: dict[str, str] = field(default_factory=dict)  # the same in every worker
    preserve_order: bool = False  # order-preserving shards (resume == uninterrupted)
    callbacks: list = field(default_factory=list)  # e.g. Tune's TuneReportCallback


# Where a stage keeps its Ray Train storage (checkpoints, progress file) inside its work dir.
STORAGE_DIR = "ray_train"


# --------------------------------------------------------------------------- driver side
def progress_path(storage_path: str | Path, name: str) -> Path:
    """Rank 0's progress file of the Train run `name` (one JSON line of metrics per step)."""
    return Path(storage_path) / f"{name}.progress.jsonl"


def registered_checkpoint_step(progress_file: str | Path) -> int | None:
    """The step of the latest checkpoint Ray Train's controller has registered for the run
    whose rank-0 progress file is `progress_file` (None: none yet, or no snapshot readable).

    Read from the controller's checkpoint-manager snapshot beside the run's checkpoints (a
    Ray-internal file, hence here, the one module that knows Ray). A worker reports a
    checkpoint into a queue that the controller drains on its health-check poll; until then a
    crash loses it, so fault injection waits for this before dying to make the resume point
    deterministic."""
    import json

    pf = Path(progress_file)
    snap = pf.parent / pf.name.removesuffix(".progress.jsonl") / "checkpoint_manager_snapshot.json"
    try:
        latest = json.loads(snap.read_text()).get("latest_checkpoint_result") or {}
        step = (latest.get("metrics") or {}).get("step")
        return None if step is None else int(step)
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _train_loop_config(loop_config: Any, progress_file: Path) -> dict[str, Any]:
    """Ray Train's `train_loop_config` (a dict) with `progress_file` set. A dataclass (the
    shared loop's `gti.train.worker_config.WorkerConfig`) becomes the dict of its top-level
    fields, which its worker entry rebuilds (`from_loop_dict`); a dict (the RQ-VAE's) is copied."""
    if dataclasses.is_dataclass(loop_config):
        typed = dataclasses.replace(loop_config, progress_file=str(progress_file))
        return {f.name: getattr(typed, f.name) for f in dataclasses.fields(typed)}
    return {**loop_config, "progress_file": str(progress_file)}


def run_trainer(
    worker_fn: Callable[[Any], Any], loop_config: Any, datasets: dict[str, Any], spec: TrainerSpec,
    read: Callable[[Path], Any], *, progress: Callable[[dict], None] | None = None,
) -> tuple[Any, dict[str, Any], str]:
    """Run `worker_fn(loop_config)` on `spec.num_workers` workers; returns (`read(final
    checkpoint dir)`, the last reported metrics, the run's path).

    The trainer's ScalingConfig (workers, GPUs, resources per worker), RunConfig (run name and
    storage path, so a run re-created with both resumes from its latest checkpoint: Ray Train V2
    has no `Trainer.restore`), FailureConfig (worker failures retried from the latest
    checkpoint), CheckpointConfig (two kept) and the workers' environment come from `spec`. A
    `GtiError` raised in a worker comes back as itself (`gti.common.errors.user_error`), so the
    CLI prints its one line.

    `loop_config` is a dict or a dataclass with a `progress_file` field (the one boundary where
    a typed config becomes Ray's dict: `_train_loop_config`). Its progress file is set to
    `<storage_path>/<name>.progress.jsonl`; with `progress`, every JSON line a worker appends
    there is handed to it on the driver while the run goes. RuntimeError when the run ends
    without a checkpoint.
    """
    import ray.train
    from ray.data import ExecutionOptions
    from ray.train.torch import TorchConfig, TorchTrainer

    from gti.common import ledger
    from gti.common.errors import user_error
    from gti.common.progress import JsonlFollower

    storage = Path(spec.storage_path)
    storage.mkdir(parents=True, exist_ok=True)
    path = progress_path(storage, spec.name)
    extra: dict[str, Any] = {}
    if spec.backend is not None:
        extra["torch_config"] = TorchConfig(backend=spec.backend)
    if spec.preserve_order:
        extra["dataset_config"] = ray.train.DataConfig(execution_options=ExecutionOptions(preserve_order=True))
    run_kw: dict[str, Any] = {}
    if spec.env:
        run_kw["worker_runtime_env"] = {"env_vars": dict(spec.env)}
    trainer = TorchTrainer(
        worker_fn,
        train_loop_config=_train_loop_config(loop_config, path),
        scaling_config=ray.train.ScalingConfig(
            num_workers=spec.num_workers, use_gpu=spec.use_gpu,
            resources_per_worker=spec.resources_per_worker,
        ),
        run_config=ray.train.RunConfig(
            name=spec.name,
            storage_path=str(storage),
            failure_config=ray.train.FailureConfig(max_failures=spec.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
            callbacks=list(spec.callbacks),
            **run_kw,
        ),
        datasets=datasets,
        **extra,
    )
    follow = JsonlFollower(path, progress, poll_s=2.0) if progress is not None else nullcontext()
    ledger.note("train", spec.name)
    try:
        with follow:
            result = trainer.fit()
    except Exception as err:  # noqa: BLE001 - user errors keep their one-line message
        user = user_error(err)
        if user is not None:
            raise user from None
        raise
    if result.checkpoint is None:
        raise RuntimeError(f"training run {spec.name} finished without a checkpoint")
    with result.checkpoint.as_directory() as d:
        got = read(Path(d))
    return got, dict(result.metrics or {}), str(result.path)


def train_dataset_from_parquet(path: str | Path, seed: int, split: str = "train"):
    """Ray Dataset of the `split` rows of a pairs-style parquet file: columns input_ids,
    labels; globally shuffled once with `seed` (the same order every epoch and every run) and
    materialised, so later epochs replay it from the object store instead of re-running the
    read and the all-to-all shuffle (seconds per epoch otherwise)."""
    import pyarrow.compute as pc
    import ray

    def keep(t):
        return t.filter(pc.equal(t["split"], split)).select(["input_ids", "labels"])

    ds = ray.data.read_parquet(str(path), columns=["split", "input_ids", "labels"])
    return ds.map_batches(keep, batch_format="pyarrow").random_shuffle(seed=seed).materialize()


def read_parquet_dataset(path: str | Path, columns: list[str], materialize: bool = False):
    """A Ray Dataset of `columns` of a parquet file or folder (materialised on request)."""
    import ray

    ds = ray.data.read_parquet(str(path), columns=columns)
    return ds.materialize() if materialize else ds


# --------------------------------------------------------------------------- worker side
def worker_rank_world() -> tuple[int, int]:
    """(world rank, world size) of this training worker."""
    import ray.train

    ctx = ray.train.get_context()
    return ctx.get_world_rank(), ctx.get_world_size()


@contextmanager
def latest_checkpoint() -> Iterator[Path | None]:
    """The directory of the checkpoint this (restarted) run resumes from, or None."""
    import ray.train

    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        yield None
        return
    with ckpt.as_directory() as d:
        yield Path(d)


def report(metrics: dict[str, Any], checkpoint_dir: str | Path | None = None) -> None:
    """Report metrics (and a checkpoint directory; every rank reports its own, Ray merges them).
    A barrier: every rank must call it the same number of times."""
    import ray.train
    from ray.train import Checkpoint

    ckpt = Checkpoint.from_directory(str(checkpoint_dir)) if checkpoint_dir is not None else None
    ray.train.report(metrics, checkpoint=ckpt)


def dataset_shard(name: str = "train"):
    """This worker's shard of the dataset passed as `datasets[name]`."""
    import ray.train

    return ray.train.get_dataset_shard(name)


def torch_device():
    """The torch device Ray Train gave this worker."""
    import ray.train.torch

    return ray.train.torch.get_device()


def prepare_ddp(model):
    """`model` moved to this worker's device and wrapped in DDP when the world has > 1 rank."""
    import ray.train.torch

    return ray.train.torch.prepare_model(model)
