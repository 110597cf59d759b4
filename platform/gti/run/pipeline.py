"""The one ordered list of stages, and the driver that runs a slice of it.

What it is for: deciding which stages run, giving each a `StageContext`, and making the result
atomic: a stage writes into `run_dir/.<stage>.partial/` (which a rerun reuses, so training
checkpoints inside it survive a killed driver), and its manifest written, the directory is
swapped into `run_dir/<stage>/`. A stage is skipped when its manifest fingerprint (its config
sections, the seed, its own input files and its upstream stages' fingerprints) equals the one it
would have now, so a change invalidates exactly the stages downstream.

What it does not know: what a stage computes. Stage modules are imported lazily, so importing
the pipeline imports neither ray nor torch.
"""

from __future__ import annotations

import importlib
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

from gti import config as C
from gti.config.io import redact
from gti.common.errors import GtiError
from gti.run.contract import StageContext, StageResult, StageSpec
from gti.run.manifest import MANIFEST_NAME, Manifest, ManifestError, stable_hash
from gti.common.files import atomic_write_bytes


STAGES: list[StageSpec] = [
    StageSpec("ingest", "gti.stages.ingest", (), ("data",), "validate catalog + interactions, split"),
    StageSpec("embed", "gti.stages.embed", ("ingest",), ("embed",), "content embeddings"),
    StageSpec("sid", "gti.stages.sid", ("embed",), ("sid",), "RQ-VAE semantic IDs"),
    StageSpec("pairs", "gti.stages.pairs", ("ingest", "sid"), ("model", "pairs"), "grounding pairs"),
    StageSpec(
        "ground", "gti.stages.ground", ("ingest", "sid", "pairs"), ("model", "init", "ground"),
        "extend vocab, initialise, ground new rows",
    ),
    StageSpec("sft", "gti.stages.sft", ("ingest", "sid", "pairs", "ground"), ("sft",), "full SFT"),
    StageSpec("rl", "gti.stages.rl", ("ingest", "sid", "sft"), ("rl",), "GRPO after SFT (rl.enabled; off: nothing)"),
    StageSpec("evaluate", "gti.stages.evaluate", ("ingest", "sid", "sft", "rl"), ("eval",), "metrics"),
    StageSpec(
        "report", "gti.stages.report", ("sid", "ground", "sft", "evaluate"), ("report",),
        "diagnostics + HTML report",
    ),
]
STAGE_NAMES = [s.name for s in STAGES]


class PipelineError(GtiError):
    """A user-facing pipeline problem (unknown stage, missing upstream); one line."""


def spec(name: str) -> StageSpec:
    for s in STAGES:
        if s.name == name:
            return s
    raise PipelineError(f"unknown stage '{name}' (stages: {', '.join(STAGE_NAMES)})")


def stage_module(s: StageSpec):
    return importlib.import_module(s.module)


def _input_files(s: StageSpec, cfg: C.RunConfig) -> dict[str, str]:
    mod = stage_module(s)
    fn: Callable[[C.RunConfig], dict[str, str]] | None = getattr(mod, "input_fingerprints", None)
    return fn(cfg) if fn else {}


def fingerprint(s: StageSpec, cfg: C.RunConfig, run_dir: Path) -> tuple[str, dict[str, str]]:
    """Fingerprint of stage `s` given the current config and upstream manifests."""
    inputs: dict[str, str] = {}
    for dep in s.depends:
        try:
            inputs[f"stage:{dep}"] = Manifest.read(run_dir / dep).fingerprint
        except ManifestError:
            raise PipelineError(
                f"stage '{s.name}' needs stage '{dep}', which has not completed in {run_dir}"
            ) from None
    inputs.update(_input_files(s, cfg))
    dumped = cfg.model_dump(mode="json")
    payload = {
        "stage": s.name,
        "seed": cfg.seed,
        "sections": {k: dumped[k] for k in s.sections},
        "inputs": inputs,
    }
    return stable_hash(payload), inputs


def is_complete(s: StageSpec, cfg: C.RunConfig, run_dir: Path) -> bool:
    try:
        m = Manifest.read(run_dir / s.name)
        fp, _ = fingerprint(s, cfg, run_dir)
    except (ManifestError, PipelineError):
        return False
    return m.fingerprint == fp


def _select(from_stage: str | None, to_stage: str | None) -> tuple[int, int]:
    lo = STAGE_NAMES.index(spec(from_stage).name) if from_stage else 0
    hi = STAGE_NAMES.index(spec(to_stage).name) if to_stage else len(STAGES) - 1
    if lo > hi:
        raise PipelineError(f"--from {from_stage} comes after --to {to_stage}")
    return lo, hi


def check_stage_folder(run_dir: Path, name: str) -> None:
    """PipelineError when `<run_dir>/<name>` is a non-empty folder that is not a stage folder
    (no manifest: e.g. a user's own `report/` in a run_dir set to an existing folder). Stages
    replace their folder whole, so gti must never take one it did not make."""
    from gti.common.files import UnsafeReplaceError, check_replaceable_dir

    try:
        check_replaceable_dir(run_dir / name, is_ours=lambda p: (p / MANIFEST_NAME).is_file(),
                              protected={}, what=f"stage '{name}' folder",
                              ours=f"a gti stage folder (no {MANIFEST_NAME})", force_hint="a run_dir of its own")
    except UnsafeReplaceError as err:
        raise PipelineError(str(err)) from None


def run_stage(s: StageSpec, cfg: C.RunConfig, run_dir: Path) -> Manifest:
    """Run one stage into its partial dir, write its manifest, swap it into place (an old
    complete folder is exchanged for the new one: `<stage>/` is never missing)."""
    from gti.common.files import replace_dir

    check_stage_folder(run_dir, s.name)
    fp, inputs = fingerprint(s, cfg, run_dir)
    work = run_dir / f".{s.name}.partial"
    marker = work / "_fingerprint"
    # A partial dir from an interrupted attempt with the same fingerprint is reused, so that
    # checkpoints inside it let the stage resume; one from a different config is discarded.
    if work.exists() and (not marker.is_file() or marker.read_text().strip() != fp):
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(marker, fp.encode())
    ctx = StageContext(spec=s, cfg=cfg, run_dir=run_dir, work_dir=work, fingerprint=fp)
    t0 = time.time()
    result: StageResult = stage_module(s).run(ctx)
    dumped = redact(cfg.model_dump(mode="json"))
    manifest = Manifest(
        stage=s.name,
        fingerprint=fp,
        config={"seed": cfg.seed, **{k: dumped[k] for k in s.sections}},
        inputs=inputs,
        facts=result.facts,
        outputs=result.outputs,
        duration_s=round(time.time() - t0, 3),
    )
    missing = [n for n, rel in result.outputs.items() if not (work / rel).exists()]
    if missing:
        raise PipelineError(f"stage '{s.name}' declared outputs it did not write: {missing}")
    manifest.write(work)
    # The whole resolved config sits beside every artifact (litgpt style).
    atomic_write_bytes(work / "config.yaml", C.dump(cfg).encode())
    final = run_dir / s.name
    old = run_dir / f".{s.name}.old"  # left by an older gti interrupted mid-swap
    if old.exists():
        shutil.rmtree(old)
    check_stage_folder(run_dir, s.name)
    replace_dir(work, final)
    (final / "_fingerprint").unlink(missing_ok=True)
    return manifest


def run_detached(name: str, cfg: C.RunConfig, work_dir: Path, **extras: Any) -> StageResult:
    """Run stage `name` of `cfg`'s run dir into `work_dir`, outside the run's own stage folders.

    For drivers above the pipeline that run one stage many times beside the real one (a
    `gti tune` trial grounds into `run_dir/tune/trials/<name>/ground/`): the upstream stages
    must be complete in the run dir (PipelineError otherwise), the stage reads them as usual,
    and `extras` go to the stage's `run(ctx, **extras)` (a trial's `run_name` and Tune
    `callbacks`). No manifest is written and nothing is swapped into place: what the stage
    left in `work_dir` and the returned result are the caller's.
    """
    s = spec(name)
    run_dir = cfg.resolved_run_dir()
    fp, _ = fingerprint(s, cfg, run_dir)
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    ctx = StageContext(spec=s, cfg=cfg, run_dir=run_dir, work_dir=work_dir, fingerprint=fp)
    return stage_module(s).run(ctx, **extras)


def run(
    cfg: C.RunConfig,
    from_stage: str | None = None,
    to_stage: str | None = None,
    force: bool = False,
    echo: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
) -> dict[str, Manifest]:
    """Run stages [from_stage, to_stage]. Stages before from_stage must already be complete.

    Stages in the slice whose fingerprint matches their manifest are skipped unless `force`
    (or unless they are `from_stage` itself, which the user asked to rerun).
    """
    from gti.run.runlock import RunLock

    run_dir = cfg.resolved_run_dir()
    lo, hi = _select(from_stage, to_stage)
    for s in STAGES[lo: hi + 1]:  # before anything is written: a folder gti may not replace stops it
        check_stage_folder(run_dir, s.name)
    # One writer per run folder: a second command is refused here, naming this one.
    with RunLock(run_dir):
        return _run_locked(cfg, run_dir, lo, hi, from_stage, force, echo)


def _run_locked(cfg: C.RunConfig, run_dir: Path, lo: int, hi: int, from_stage: str | None, force: bool,
                echo: Callable[[str], None]) -> dict[str, Manifest]:
    atomic_write_bytes(run_dir / "config.yaml", C.dump(cfg).encode())
    done: dict[str, Manifest] = {}
    for i, s in enumerate(STAGES[: hi + 1]):
        if i < lo:
            if not (run_dir / s.name / MANIFEST_NAME).is_file():
                raise PipelineError(
                    f"--from {STAGE_NAMES[lo]} needs stage '{s.name}' to have completed in {run_dir}"
                )
            continue
        rerun_requested = force or (from_stage is not None and i == lo)
        if not rerun_requested and is_complete(s, cfg, run_dir):
            echo(f"[{i + 1}/{hi + 1}] {s.name}: up to date, skipped")
            done[s.name] = Manifest.read(run_dir / s.name)
            continue
        echo(f"[{i + 1}/{hi + 1}] {s.name}: {s.summary} ...")
        t0 = time.time()
        done[s.name] = run_stage(s, cfg, run_dir)
        echo(f"[{i + 1}/{hi + 1}] {s.name}: done in {time.time() - t0:.1f}s -> {run_dir / s.name}")
    return done
