"""gti/experiments/shared_stages.py: the shared stages linked into an arm's run folder."""

from __future__ import annotations

import os

from gti.experiments.shared_stages import SHARED_STAGES, adopt_shared, slug
from gti.run.manifest import Manifest


def _stage(root, name, fp):
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "out.txt").write_text(f"{name}-{fp}")
    Manifest(stage=name, fingerprint=fp, config={}, outputs={"out": "out.txt"}).write(d)


def test_adopt_links_every_shared_stage_once_and_replaces_stale_ones(tmp_path):
    shared, run = tmp_path / "shared", tmp_path / "run"
    for s in SHARED_STAGES:
        _stage(shared, s, "v1")
    adopt_shared(shared, run)
    for s in SHARED_STAGES:
        assert os.path.samefile(shared / s / "out.txt", run / s / "out.txt")  # hard-linked
    _stage(shared, "sid", "v2")
    adopt_shared(shared, run)
    assert Manifest.read(run / "sid").fingerprint == "v2" and (run / "sid" / "out.txt").read_text() == "sid-v2"
    assert slug("gti+multitask") == "gti_multitask"
