"""Experiment tracking: scalars written as TensorBoard event files (and optionally to MLflow).

What it is for: stage code on the driver calls `Tracker.scalar(tag, value, step)` /
`Tracker.scalars(metrics, step)`; with `tracking.tensorboard: true` (the default) the values go
to event files under `<run_dir>/tensorboard/<name>/`, with `tracking.mlflow: true` also to an
MLflow run (docs/tracking.md). Nothing here opens a network connection unless the user points
`mlflow_uri` at a server. Tracking is not essential: a failed write warns once and turns that
sink off, never failing a run; a missing package fails before work starts (`check_available`).

What it does not know: Ray, training, which stage calls it. It imports tensorboardX / mlflow
only when a sink is enabled.
"""

from __future__ import annotations

import importlib.util
import math
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from gti.common.errors import GtiError

TB_DIR = "tensorboard"
_SKIP_KEYS = {"step", "epoch", "trial_id", "training_iteration", "wall_time"}


class TrackingError(GtiError):
    """A tracking key that cannot work here (its package is missing); one line."""


def check_available(cfg) -> None:
    """TrackingError naming the key when an enabled sink's package is not installed."""
    t = cfg.tracking
    if t.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise TrackingError(
            "tracking.tensorboard: true needs the tensorboardX package (pip install tensorboardX==2.6.5), "
            "or set tracking.tensorboard: false"
        )
    if t.mlflow and importlib.util.find_spec("mlflow") is None:
        raise TrackingError(
            "tracking.mlflow: true needs the mlflow package, which is not installed "
            "(pip install mlflow), or set tracking.mlflow: false"
        )


def metric_tags(metrics: dict[str, Any], prefix: str = "train") -> dict[str, float]:
    """{report key: value} -> {tag: float}: `val_*` keys -> `val/*`, other numeric keys ->
    `train/*` (step and epoch are the x axis, not tags), lists (per-level SID utilisation) ->
    `<tag>/l<i>`; tags cleaned by `clean_tag`; non-numbers dropped."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if k in _SKIP_KEYS:
            continue
        tag = f"val/{k[4:]}" if k.startswith("val_") else f"{prefix}/{k}"
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[tag] = float(v)
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            for i, x in enumerate(v):
                out[f"{tag}/l{i}"] = float(x)
    return out


def eval_tags(metrics: dict[str, Any]) -> dict[str, float]:
    """The evaluate stage's metrics.json -> {tag: value}: `eval/<split>/<metric@k>` for the
    model, `eval/<split>/<baseline>/<metric@k>` for MostPop/Markov, exact-rank metrics under
    `eval/<split>/`, `eval/<split>/cold/...` for the cold-item slice, `eval/invalid_sid_rate`."""
    tags: dict[str, float] = {}

    def block(prefix: str, table: dict | None) -> None:
        for m, v in (table or {}).items():
            val = v.get("value") if isinstance(v, dict) else v
            if isinstance(val, (int, float)) and not isinstance(val, bool):
                tags[f"{prefix}/{m}"] = float(val)

    for split, table in metrics.get("splits", {}).items():
        block(f"eval/{split}", table)
    for name, per_split in metrics.get("baselines", {}).items():
        for split, table in per_split.items():
            block(f"eval/{split}/{name}", table)
    for split, table in metrics.get("ranks", {}).items():
        block(f"eval/{split}", table)
    cold = metrics.get("slices", {}).get("cold", {})
    for split, sl in cold.items():
        if split != "definition" and isinstance(sl, dict):
            block(f"eval/{split}/cold", sl.get("model"))
    if isinstance(metrics.get("invalid_sid_rate"), (int, float)):
        tags["eval/invalid_sid_rate"] = float(metrics["invalid_sid_rate"])
    return tags


def clean_tag(tag: str) -> str:
    """The tag as written: TensorBoard (tensorboardX) and MLflow both refuse '@', so
    `recall@10` becomes `recall_at_10`; anything else outside [A-Za-z0-9_-./] becomes '_'."""
    return re.sub(r"[^A-Za-z0-9_\-./]", "_", tag.replace("@", "_at_"))


mlflow_key = clean_tag


class Tracker:
    """The sinks of one stage (or trial) of one run. Use as a context manager, or call close().

    run_dir: the run's directory; name: sub-folder under `tensorboard/` ("ground", "tune/x"),
    so `tensorboard --logdir <run_dir>` shows a whole run and `--logdir <compare out>` (arm
    runs live under `<out>/runs/<arm>/seed<s>/`) compares arms. MLflow: tracking URI
    `tracking.mlflow_uri` (default a local file store `<run_dir>/mlruns`), experiment
    `tracking.mlflow_experiment`, run name `<run_dir name>/<name>`. A failed write (disk full, a
    broken MLflow store) warns once on stderr and turns that sink off.
    fresh: remove earlier event files of `name` first, so a rerun of a stage (which replays
    its whole history, resumed steps included) does not draw every curve twice.
    """

    def __init__(self, cfg, run_dir: str | Path, name: str, fresh: bool = True) -> None:
        self.name = name
        self.logdir = Path(run_dir) / TB_DIR / name
        self._tb = None
        self._mlflow = None
        self._warned: set[str] = set()
        t = cfg.tracking
        if t.tensorboard:
            try:
                if fresh and self.logdir.exists():
                    shutil.rmtree(self.logdir)
                self.logdir.mkdir(parents=True, exist_ok=True)
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(logdir=str(self.logdir), flush_secs=10)
            except ImportError:
                raise TrackingError(
                    "tracking.tensorboard: true needs the tensorboardX package (pip install "
                    "tensorboardX==2.6.5), or set tracking.tensorboard: false"
                ) from None
            except OSError as err:
                self._warn("tensorboard", err)
        if t.mlflow:
            self._mlflow = self._start_mlflow(t, Path(run_dir))

    # ----------------------------------------------------------------- sinks
    def _start_mlflow(self, t, run_dir: Path):
        if importlib.util.find_spec("mlflow") is None:
            raise TrackingError(
                "tracking.mlflow: true needs the mlflow package, which is not installed "
                "(pip install mlflow), or set tracking.mlflow: false"
            )
        try:
            import mlflow

            uri = t.mlflow_uri or (run_dir / "mlruns").resolve().as_uri()
            client = mlflow.tracking.MlflowClient(tracking_uri=uri)
            exp = client.get_experiment_by_name(t.mlflow_experiment)
            exp_id = exp.experiment_id if exp is not None else client.create_experiment(t.mlflow_experiment)
            run = client.create_run(exp_id, run_name=f"{run_dir.name}/{self.name}",
                                    tags={"gti.run_dir": str(run_dir), "gti.stage": self.name})
            return client, run.info.run_id
        except Exception as err:  # noqa: BLE001 - a broken store must not fail the run
            self._warn("mlflow", err)
            return None

    def _warn(self, sink: str, err: BaseException) -> None:
        if sink not in self._warned:
            self._warned.add(sink)
            from gti.common.redact import redact_text  # the error may quote tracking.mlflow_uri

            first = redact_text((str(err).strip() or type(err).__name__).splitlines()[0])
            print(f"gti: warning: tracking ({sink}, {self.logdir}): {first}; "
                  f"{sink} logging is off for the rest of this stage", file=sys.stderr, flush=True)

    # ----------------------------------------------------------------- writing
    def scalar(self, tag: str, value: float, step: int) -> None:
        value = float(value)
        if not math.isfinite(value):
            return
        tag = clean_tag(tag)
        if self._tb is not None:
            try:
                self._tb.add_scalar(tag, value, int(step))
            except Exception as err:  # noqa: BLE001 - see the failure policy above
                self._warn("tensorboard", err)
                self._tb = None
        if self._mlflow is not None:
            client, run_id = self._mlflow
            try:
                client.log_metric(run_id, tag, value, step=int(step))
            except Exception as err:  # noqa: BLE001
                self._warn("mlflow", err)
                self._mlflow = None

    def scalars(self, values: dict[str, float], step: int) -> None:
        for tag, v in values.items():
            self.scalar(tag, v, step)

    def report(self, metrics: dict[str, Any], step: int | None = None, prefix: str = "train") -> None:
        """One training report (loss, lr, grad norm, tokens/s, val_*): see `metric_tags`.
        Flushed at once: a Tune trial that ASHA stops is ended without a chance to close."""
        self.scalars(metric_tags(metrics, prefix), int(metrics.get("step", 0) if step is None else step))
        self.flush()

    def flush(self) -> None:
        if self._tb is not None:
            try:
                self._tb.flush()
            except Exception as err:  # noqa: BLE001
                self._warn("tensorboard", err)
                self._tb = None

    def text(self, tag: str, text: str) -> None:
        if self._tb is not None:
            try:
                self._tb.add_text(tag, text, 0)
            except Exception as err:  # noqa: BLE001
                self._warn("tensorboard", err)
                self._tb = None

    def close(self) -> None:
        if self._tb is not None:
            try:
                self._tb.close()
            except Exception as err:  # noqa: BLE001
                self._warn("tensorboard", err)
            self._tb = None
        if self._mlflow is not None:
            client, run_id = self._mlflow
            try:
                client.set_terminated(run_id)
            except Exception as err:  # noqa: BLE001
                self._warn("mlflow", err)
            self._mlflow = None

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_tracker(ctx_or_cfg, name: str | None = None, run_dir: str | Path | None = None) -> Tracker:
    """Tracker for a pipeline StageContext (name = the stage, run_dir = the run's), or for a
    config plus explicit `name` and `run_dir`."""
    cfg = getattr(ctx_or_cfg, "cfg", ctx_or_cfg)
    if run_dir is None:
        run_dir = getattr(ctx_or_cfg, "run_dir", None) or cfg.resolved_run_dir()
    return Tracker(cfg, run_dir, name or ctx_or_cfg.name)


# --------------------------------------------------------------------------- reading (tests, doctor)
def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All scalars in the event files under `logdir` (recursively): {tag: [(step, value)]}.

    Reads the TFRecord framing directly (8-byte length, 4-byte CRC, payload, 4-byte CRC) and
    decodes payloads with tensorboardX's Event proto, so no TensorFlow/TensorBoard is needed.
    """
    import struct

    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for f in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        data = f.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            payload = data[pos + 12 : pos + 12 + n]
            pos += 12 + n + 4
            ev = event_pb2.Event.FromString(payload)
            for v in ev.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, []).append((int(ev.step), float(v.simple_value)))
    return out
