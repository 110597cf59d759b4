"""The stage contract: what the pipeline hands a stage and what a stage hands back.

What it is for: `StageSpec` (a stage's name, module, upstream stages, fingerprinted config
sections), `StageContext` (the config, the run dir, the work dir the stage writes into, its
upstream outputs and facts) and `StageResult` (named outputs and facts). `gti.run.pipeline`
builds the contexts and the stages read them; a stage imports this module, never the
pipeline that drives it.

What it does not know: which stages exist or in what order (that is `gti.run.pipeline.STAGES`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gti import config as C
from gti.run.manifest import Manifest


@dataclass(frozen=True)
class StageSpec:
    name: str
    module: str  # exposes run(ctx) -> StageResult and optionally input_fingerprints(cfg) -> dict[str, str]
    depends: tuple[str, ...]
    sections: tuple[str, ...]  # config sections whose values enter the fingerprint
    summary: str


@dataclass
class StageResult:
    """What a stage returns: named output paths (relative to its dir) and derived facts."""

    outputs: dict[str, str] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass
class StageContext:
    spec: StageSpec
    cfg: C.RunConfig
    run_dir: Path
    work_dir: Path  # write outputs here; it becomes run_dir/<stage>/ on success
    fingerprint: str

    @property
    def name(self) -> str:
        return self.spec.name

    def stage_dir(self, stage: str) -> Path:
        return self.run_dir / stage

    def manifest(self, stage: str) -> Manifest:
        return Manifest.read(self.stage_dir(stage))

    def input(self, stage: str, output: str) -> Path:
        """Absolute path of output `output` of upstream stage `stage` (from its manifest)."""
        return self.manifest(stage).output(self.stage_dir(stage), output)

    def log(self, msg: str) -> None:
        from gti.common.redact import redact_text  # a data URI's credentials never reach the log

        print(f"[{self.name}] {redact_text(msg)}", file=sys.stderr, flush=True)
