"""gti/experiments/compare_report.py: which record stands for each planned run, and the report
over several SID maps (pooled, per map, compare.json's `maps`), from fake run folders."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gti import config
from gti.diagnostics.runs import RunRecord
from gti.experiments import compare as CMP
from gti.experiments.compare_report import gather, write_maps_report
from gti.run.manifest import Manifest

USERS = [f"u{i}" for i in range(30)]


def _cfg(tmp_path):
    return config.load(None, [f"run_dir={tmp_path / 'base'}", "model.name=tiny", "report.text_sample=0",
                              "report.bootstrap=50", "compare.parallel=false"])


def _finish(r) -> None:
    """The report and evaluate folders of a finished run (what `load_record` reads)."""
    def manifest(stage, outputs):
        d = r.run_dir / stage
        d.mkdir(parents=True, exist_ok=True)
        Manifest(stage=stage, fingerprint="fp", config={}, outputs=outputs).write(d)
        return d

    (manifest("report", {"report_json": "report.json"}) / "report.json").write_text(
        json.dumps({"runs": [{"diagnostics": {}}]}))
    rng = np.random.default_rng([r.seed, r.sid_seed or 0, r.arm == "gti"])
    hit = (rng.random(len(USERS)) < (0.4 if r.arm == "gti" else 0.2)).astype(float)
    (manifest("evaluate", {"metrics": "metrics.json"}) / "metrics.json").write_text(json.dumps({
        "splits": {"test": {"recall@10": {"value": float(hit.mean()), "ci": [0.0, 1.0]}}}, "baselines": {},
        "per_user": {"test": {"user_ids": USERS, "recall@10": hit.tolist()}}}))


def test_gather_takes_the_run_folder_then_the_stored_record_and_leaves_out_neither(tmp_path):
    runs = CMP.plan(_cfg(tmp_path), ["mean", "gti"], 2, tmp_path / "out", n_maps=2)
    _finish(runs[0])
    stored_rec = RunRecord(arm=runs[1].arm, seed=runs[1].seed)
    got, records, facts = gather(runs, {runs[1].key: (stored_rec, {"init": "x"})})
    assert got == runs[:2] and records[1] is stored_rec and facts[1] == {"init": "x"}
    assert records[0].arm == runs[0].arm and facts[0]["init"] == runs[0].cfg.init.method
    # the same arm x seed on the other map is another run: its record does not stand in
    assert runs[3].key == (runs[1].arm, runs[1].seed, 1) and runs[3] not in got


def test_maps_report_pools_the_maps_writes_one_per_map_and_the_summary(tmp_path):
    cfg = _cfg(tmp_path)
    out = tmp_path / "out"
    runs = CMP.plan(cfg, ["mean", "gti"], 2, out, n_maps=2)
    for r in runs:
        _finish(r)
    (out / "compare.json").write_text(json.dumps({"arms": {}, "runs": []}))
    lines: list[str] = []
    paths = write_maps_report(runs, cfg, out, "T", echo=lines.append)
    pooled = json.loads(paths["json"].read_text())
    assert pooled["seeds_per_arm"] == {"mean": 4, "gti": 4}  # 2 seeds x 2 maps
    doc = json.loads((out / "compare.json").read_text())
    assert doc["arms"] == {} and doc["runs"] == []  # the plan's keys are kept
    maps = doc["maps"]
    assert maps["reports"] == {t: str(out / "maps" / t / "report.json") for t in ("sid0", "sid1")}
    per_map = []
    for t in ("sid0", "sid1"):
        one = json.loads((out / "maps" / t / "report.json").read_text())
        row = next(x for x in one["metrics"] if x["arm"] == "gti" and x["name"] == "recall@10")
        assert row["mean"] == pytest.approx(maps["per_map"][t]["arms"]["gti"]["recall@10"]["value"])
        assert one["seeds_per_arm"] == {"mean": 2, "gti": 2}
        per_map.append(row["mean"])
    assert maps["mean"]["arms"]["gti"]["recall@10"]["mean"] == pytest.approx(np.mean(per_map))
    pooled_row = next(x for x in pooled["metrics"] if x["arm"] == "gti" and x["name"] == "recall@10")
    assert pooled_row["mean"] == pytest.approx(np.mean(per_map))  # equal seeds per map: the same mean
    assert len(lines) == 2 and lines[1].startswith("gti recall@10: ")
