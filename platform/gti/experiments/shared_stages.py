"""What every arm run of an experiment inherits: the shared stages and their run folders.

What it is for: `SHARED_STAGES` (ingest..pairs, run once and linked into each arm or trial
run folder by `adopt_shared`), `ArmRun` (one arm x seed run of `gti compare`: its config,
folder and SID map) and `CompareError`; per SID map of a comparison (`gti compare --sid-seeds`)
its folders (`map_tag`, `map_dirs`), the config of its shared stages (`shared_config`) and the
stages run once per map (`run_shared`). Used by `gti.experiments.compare`, `records` and `tune`.

What it does not know: what the stages compute (it drives `gti.run.pipeline`), or how arm runs
are scheduled.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from gti import config as C
from gti.run import pipeline
from gti.config.io import apply_overrides
from gti.common.errors import GtiError
from gti.run.manifest import Manifest, ManifestError

SHARED_STAGES = ("ingest", "embed", "sid", "pairs")


class CompareError(GtiError):
    """A bad `gti compare` argument, or arm runs that failed (named)."""


@dataclass
class ArmRun:
    """One arm x seed run of `gti compare`; `sid_seed`: the SID map it trains on (`sid.seed`),
    None where the comparison has one map (its shared stages made with the run's seed)."""

    arm: str
    seed: int
    run_dir: Path
    cfg: C.RunConfig
    sid_seed: int | None = None

    @property
    def key(self) -> tuple:
        """(arm, seed), or (arm, seed, sid_seed) on one of several maps: unique in a plan."""
        return (self.arm, self.seed) if self.sid_seed is None else (self.arm, self.seed, self.sid_seed)

    @property
    def name(self) -> str:
        """'gti seed 1', or 'gti seed 1 on sid2' (map sid.seed=2), for messages."""
        return f"{self.arm} seed {self.seed}" + ("" if self.sid_seed is None else f" on {map_tag(self.sid_seed)}")


def map_tag(sid_seed: int) -> str:
    """The folder name of the SID map made with `sid.seed=sid_seed` (shared/, runs/, records/)."""
    return f"sid{sid_seed}"


def slug(arm: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", arm)


def link_tree(src: Path, dst: Path) -> None:
    """Hard-link every file of src into dst (copy where linking is impossible)."""

    def link(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    from gti.common.files import replace_dir

    tmp = dst.with_name(f".{dst.name}.linking")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, copy_function=link)
    replace_dir(tmp, dst)  # dst: a stage folder of this run (gti-made), never missing meanwhile


def adopt_shared(shared_dir: Path, run_dir: Path, stages: tuple[str, ...] = SHARED_STAGES) -> None:
    """Put `stages` of shared_dir into run_dir (unless the same ones are already there)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stage in stages:
        src = shared_dir / stage
        want = Manifest.read(src).fingerprint
        try:
            if Manifest.read(run_dir / stage).fingerprint == want:
                continue
        except ManifestError:
            pass
        link_tree(src, run_dir / stage)


# --------------------------------------------------------------------------- one folder per SID map
def map_overrides(sid_seed: int | None) -> list[str]:
    """`sid.seed=<m>` for one of several maps; nothing for the one map of a plain comparison."""
    return [] if sid_seed is None else [f"sid.seed={sid_seed}"]


def map_dirs(out: Path, sid_seed: int | None) -> tuple[Path, Path]:
    """(shared run folder, root of the arm runs) of one map: `shared/`, `runs/` for the one map
    of a plain comparison; `shared/sid<m>/`, `runs/sid<m>/` on one of several."""
    if sid_seed is None:
        return out / "shared", out / "runs"
    return out / "shared" / map_tag(sid_seed), out / "runs" / map_tag(sid_seed)


def shared_config(cfg: C.RunConfig, out: Path, sid_seed: int | None = None) -> C.RunConfig:
    """The config of one map's shared stages (`map_dirs`): the base config, its `sid.seed` set."""
    ov = [f"run_dir={map_dirs(out, sid_seed)[0]}"] + map_overrides(sid_seed)
    return C.validate(apply_overrides(cfg.model_dump(mode="json"), ov))


def run_shared(cfg: C.RunConfig, out: Path, maps: Sequence[int | None], report_only: bool,
               echo: Callable[[str], None]) -> dict[int | None, Path]:
    """Each map's shared folder, its stages run (or, `report_only`, checked to be there).
    Maps after the first take ingest and embed linked from the first map's folder: only
    `sid.seed` differs between them, so those stages are up to date and not made again."""
    dirs: dict[int | None, Path] = {}
    for m in maps:
        shared = shared_config(cfg, out, m)
        d = dirs[m] = shared.resolved_run_dir()
        if report_only:
            missing = [s for s in SHARED_STAGES if not (d / s / "_manifest.json").is_file()]
            if missing:
                raise CompareError(f"--report-only: shared stage(s) {', '.join(missing)} not run in {d}")
            continue
        first = dirs[maps[0]]
        if d != first and all((first / s / "_manifest.json").is_file() for s in ("ingest", "embed")):
            adopt_shared(first, d, ("ingest", "embed"))
        echo(f"shared stages ({', '.join(SHARED_STAGES)}) in {d}")
        pipeline.run(shared, to_stage=SHARED_STAGES[-1], echo=echo)
    return dirs
