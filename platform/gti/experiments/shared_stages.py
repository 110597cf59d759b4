"""What every arm run of an experiment inherits: the shared stages and their run folders.

What it is for: `SHARED_STAGES` (ingest..pairs, run once and linked into each arm or trial
run folder by `adopt_shared`), `ArmRun` (one arm x seed run of `gti compare`: its config and
folder) and `CompareError`. Used by `gti.experiments.compare`, `records` and `tune`.

What it does not know: what the stages compute, or how runs are scheduled.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from gti import config as C
from gti.errors import GtiError
from gti.manifest import Manifest, ManifestError

SHARED_STAGES = ("ingest", "embed", "sid", "pairs")


class CompareError(GtiError):
    """A bad `gti compare` argument, or arm runs that failed (named)."""


@dataclass
class ArmRun:
    arm: str
    seed: int
    run_dir: Path
    cfg: C.RunConfig


def slug(arm: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", arm)


def link_tree(src: Path, dst: Path) -> None:
    """Hard-link every file of src into dst (copy where linking is impossible)."""

    def link(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    from gti.files import replace_dir

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
