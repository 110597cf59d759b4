"""gti/run/contract.py: what a stage reads through its context (upstream outputs and facts)."""

from __future__ import annotations

import pytest

from gti import config as C
from gti.run.contract import StageContext, StageResult, StageSpec
from gti.run.manifest import Manifest, ManifestError


def test_context_reads_upstream_outputs_and_facts_from_manifests(tmp_path, capsys):
    up = tmp_path / "up"
    up.mkdir()
    (up / "x.parquet").write_text("x")
    Manifest(stage="up", fingerprint="f", config={}, facts={"n": 3}, outputs={"x": "x.parquet"}).write(up)
    spec = StageSpec("down", "some.module", ("up",), ("data",), "test")
    ctx = StageContext(spec=spec, cfg=C.RunConfig(), run_dir=tmp_path, work_dir=tmp_path / ".down.partial",
                       fingerprint="fp")
    assert ctx.name == "down" and ctx.input("up", "x") == up / "x.parquet"
    assert ctx.manifest("up").facts["n"] == 3
    with pytest.raises(ManifestError):
        ctx.manifest("missing")
    ctx.log("hello")
    assert "[down] hello" in capsys.readouterr().err
    assert StageResult().outputs == {} and StageResult().facts == {}
