"""Tests of gti/experiments/compare.py: arm overrides, shared stages built once, resume, one report.

The unit tests drive the real pipeline and the real `report` stage with fast fake modules for
the other stages (writing the documented outputs), so the harness logic is tested without
training. `test_compare_tiny_end_to_end` runs the real tiny pipeline (slow, starts Ray).
"""

from __future__ import annotations

import json
import shutil
import types
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from gti import config
from gti.run import pipeline
from gti.run.contract import StageResult
from gti.common.errors import ConfigError
from gti.experiments import compare as CMP
from gti.experiments.records import RECORD_FORMAT, config_diff, load_record, read_record, record_path, run_facts
from gti.experiments.shared_stages import SHARED_STAGES, CompareError

ROOT = Path(__file__).resolve().parents[2]
SIZES = [6, 6]


def _base_cfg(tmp_path, *ov):
    return config.load(None, [f"run_dir={tmp_path / 'base'}", "model.name=tiny", "ground.steps=7",
                              "sft.steps=5", "report.text_sample=0", "report.bootstrap=50",
                              "compare.parallel=false", *ov])


# --------------------------------------------------------------------------- arm logic

class _HungArmRay:
    """Stands in for `ray` in `compare.execute`: the arm run of `hung` never finishes, the others
    finish at once. A ray.wait without a timeout would block for ever: it fails the test."""

    def __init__(self, monkeypatch, hung: str, cpus: float = 4.0) -> None:
        import ray

        from gti import ray_start

        self.waits: list[float] = []
        self.cancelled: list[tuple[str, bool]] = []
        monkeypatch.setattr(ray_start, "ensure_ray", lambda cfg: None)
        monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": cpus})
        monkeypatch.setattr(ray, "remote", lambda **opts: lambda fn: types.SimpleNamespace(
            remote=lambda cfg_json, cwd: (cfg_json["report"]["label"], cfg_json["seed"])))
        monkeypatch.setattr(ray, "get", lambda ref: {"skipped": False, "seconds": 1.0})
        monkeypatch.setattr(ray, "cancel", lambda ref, force=False: self.cancelled.append((ref[0], force)))
        self.hung = hung
        monkeypatch.setattr(ray, "wait", self.wait)

    def wait(self, refs, num_returns=1, timeout=None):
        import time

        assert timeout is not None and timeout >= 0, "ray.wait without a timeout would wait for ever"
        self.waits.append(timeout)
        ready = [r for r in refs if r[0] != self.hung][:num_returns]
        if not ready:
            time.sleep(timeout)
        return ready, [r for r in refs if r not in ready]


def test_a_hung_arm_run_is_cancelled_after_arm_timeout_s(tmp_path, monkeypatch):
    """compare's ray.wait is bounded: an arm run still not finished compare.arm_timeout_s after
    its submission is cancelled (force) and counted as failed in one line naming the key; the
    others finish and are kept."""
    fake = _HungArmRay(monkeypatch, hung="gti")
    cfg = _base_cfg(tmp_path, "compare.parallel=true", "compare.max_parallel=2", "compare.arm_timeout_s=0.2")
    runs = CMP.plan(cfg, ["mean", "gti", "random"], 1, tmp_path / "out")
    kept, lines = [], []
    failures = CMP.execute(runs, cfg, echo=lines.append, on_done=lambda r: kept.append(r.arm))
    assert sorted(kept) == ["mean", "random"]
    assert list(failures) == [("gti", cfg.seed)] and fake.cancelled == [("gti", True)]
    assert failures[("gti", cfg.seed)].startswith("compare.arm_timeout_s: not finished 0.2s after its submission")
    assert all(0 <= t <= CMP.WAIT_POLL_S for t in fake.waits)
    assert any(ln.startswith("gti seed") and "FAILED: compare.arm_timeout_s" in ln for ln in lines)


def test_arm_tasks_that_could_never_be_scheduled_are_refused(tmp_path, monkeypatch):
    _HungArmRay(monkeypatch, hung="", cpus=2.0)
    cfg = _base_cfg(tmp_path, "compare.parallel=true", "compare.max_parallel=2", "compare.arm_num_cpus=3")
    with pytest.raises(CompareError, match=r"^compare.arm_num_cpus 3 exceeds the cluster's 2 CPUs$"):
        CMP.execute(CMP.plan(cfg, ["mean", "gti"], 1, tmp_path / "out"), cfg, echo=lambda m: None)


@pytest.mark.parametrize("value", ["0", "-5", str(400 * 86400)])
def test_arm_timeout_s_is_bounded(tmp_path, value):
    with pytest.raises(ConfigError, match="'compare.arm_timeout_s'"):
        _base_cfg(tmp_path, f"compare.arm_timeout_s={value}")


def test_arm_override_table_and_equal_budget(tmp_path):
    cfg = _base_cfg(tmp_path, "sft.multitask=true", "rl.enabled=true")  # base settings must not leak into arms
    got = {}
    for arm in CMP.ARMS:
        c = CMP.arm_config(cfg, arm, 3, tmp_path / arm)
        got[arm] = (c.init.method, c.ground.enabled, c.sft.multitask, c.rl.enabled, c.sft.steps, c.seed,
                    c.report.label)
        assert c.resolved_run_dir() == (tmp_path / arm).resolve()
    assert got == {
        "mean": ("mean", False, False, False, 12, 3, "mean"),
        "random": ("random", False, False, False, 12, 3, "random"),
        "description": ("description", False, False, False, 12, 3, "description"),
        "gti": ("mean", True, False, False, 5, 3, "gti"),
        "gti+multitask": ("mean", True, True, False, 5, 3, "gti+multitask"),
        "gti+rl": ("mean", True, False, True, 5, 3, "gti+rl"),  # RL steps on top of gti's budget
        "lcrec": ("mean", False, True, False, 12, 3, "lcrec"),
        "mean_noise": ("mean_noise", False, False, False, 12, 3, "mean_noise"),
        "codebook": ("codebook", False, False, False, 12, 3, "codebook"),
    }
    off = _base_cfg(tmp_path, "compare.equal_budget=false")
    assert CMP.arm_config(off, "mean", 0, tmp_path / "m").sft.steps == 5


@pytest.mark.parametrize("equal_budget", ["true", "false"])
def test_gti_rl_arm_is_gti_plus_rl_and_every_arm_sets_the_same_keys(tmp_path, equal_budget):
    cfg = _base_cfg(tmp_path, f"compare.equal_budget={equal_budget}")
    keys = {arm: [o.split("=", 1)[0] for o in CMP.arm_overrides(cfg, arm) if not o.startswith("sft.steps=")]
            for arm in CMP.ARMS}
    assert all(k == keys["gti"] for k in keys.values()) and "rl.enabled" in keys["gti"]
    gti, rl = CMP.arm_overrides(cfg, "gti"), CMP.arm_overrides(cfg, "gti+rl")
    flip = {"rl.enabled=false": "rl.enabled=true", "report.label=gti": "report.label=gti+rl"}
    assert rl == [flip.get(o, o) for o in gti]
    assert CMP.arm_config(cfg, "gti+rl", 0, tmp_path / "r").rl.trains
    assert not any(CMP.arm_config(cfg, a, 0, tmp_path / "r").rl.enabled for a in CMP.ARMS if a != "gti+rl")


def test_parse_arms_and_seeds_errors(tmp_path):
    assert CMP.parse_arms("mean, gti+multitask") == ["mean", "gti+multitask"]
    assert CMP.parse_arms("gti,gti+rl") == ["gti", "gti+rl"]
    with pytest.raises(CompareError, match="unknown arm 'gtii'"):
        CMP.parse_arms("mean,gtii")
    with pytest.raises(CompareError, match="twice"):
        CMP.parse_arms("mean,mean")
    with pytest.raises(CompareError, match="empty"):
        CMP.parse_arms(" , ")
    cfg = _base_cfg(tmp_path, "seed=10")
    assert CMP.seeds_for(cfg, 3) == [10, 11, 12]
    with pytest.raises(CompareError, match="--seeds"):
        CMP.seeds_for(cfg, 0)
    runs = CMP.plan(cfg, ["mean", "gti+multitask"], 2, tmp_path / "out")
    assert [(r.arm, r.seed, r.run_dir.name, r.run_dir.parent.name) for r in runs] == [
        ("mean", 10, "seed10", "mean"), ("gti+multitask", 10, "seed10", "gti_multitask"),
        ("mean", 11, "seed11", "mean"), ("gti+multitask", 11, "seed11", "gti_multitask"),
    ]
    # Seeds per arm: the protocol (3 mean, 3 gti, 1 random), still seed-major.
    assert CMP.parse_seeds("3,random=1", ["mean", "gti", "random"]) == {"mean": 3, "gti": 3, "random": 1}
    assert CMP.parse_seeds("2", ["mean", "gti"]) == {"mean": 2, "gti": 2}
    runs = CMP.plan(cfg, ["mean", "gti", "random"], "2,random=1", tmp_path / "out")
    assert [(r.arm, r.seed) for r in runs] == [("mean", 10), ("gti", 10), ("random", 10), ("mean", 11), ("gti", 11)]
    with pytest.raises(CompareError, match="'random=x' is not N or ARM=N"):
        CMP.parse_seeds("3,random=x", ["mean", "random"])
    with pytest.raises(CompareError, match="arm\\(s\\) gti that are not in --arms"):
        CMP.parse_seeds("3,gti=1", ["mean", "random"])
    with pytest.raises(CompareError, match="random=0"):
        CMP.parse_seeds("3,random=0", ["mean", "random"])


def test_auto_parallel_from_resources(tmp_path):
    cfg = _base_cfg(tmp_path, "ground.num_workers=2", "sft.num_workers=2")
    # 2 workers + 1 CPU of Ray Data headroom per run.
    assert CMP.auto_parallel(cfg, {"CPU": 8}) == 2
    assert CMP.auto_parallel(cfg, {"CPU": 9}) == 3
    assert CMP.auto_parallel(cfg, {"CPU": 1}) == 1
    gpu = _base_cfg(tmp_path, "sft.use_gpu=true", "ground.use_gpu=true")
    assert CMP.auto_parallel(gpu, {"CPU": 16, "GPU": 2}) == 2
    assert CMP.auto_parallel(gpu, {"CPU": 16}) == 1


# --------------------------------------------------------------------------- fake stages
class FakeStages:
    """Stage modules that write the documented outputs in milliseconds, counting calls."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def module(self, spec):
        if spec.name == "report":  # the real one
            import importlib

            return importlib.import_module(spec.module)
        return types.SimpleNamespace(run=getattr(self, spec.name))

    def rl(self, ctx):
        if not ctx.cfg.rl.trains:  # the real stage: disabled, it writes only its manifest
            from gti.stages import rl

            return rl.run(ctx)
        self._note(ctx)  # the gti+rl arm: a model folder and the facts a trained rl stage reports
        (ctx.work_dir / "model").mkdir(exist_ok=True)
        return StageResult({"model": "model"}, {
            "enabled": True, "steps_done": ctx.cfg.rl.steps, "stopped_at": None, "step_stats": {"reward_mean": 0.5},
            "best": {"metric": "val_mrr", "start": 0.2, "value": 0.25, "step": ctx.cfg.rl.steps}})

    def _note(self, ctx):
        self.calls.append((ctx.name, str(ctx.run_dir)))

    def ingest(self, ctx):
        self._note(ctx)
        (ctx.work_dir / "items.parquet").write_text("x")
        return StageResult({"items": "items.parquet"}, {"n_items": 3})

    def embed(self, ctx):
        self._note(ctx)
        return StageResult({}, {"dim": 4})

    def sid(self, ctx):
        self._note(ctx)
        g = torch.Generator().manual_seed(ctx.cfg.seed)
        save_file({f"level_{i}": torch.randn(k, 3, generator=g) for i, k in enumerate(SIZES)},
                  str(ctx.work_dir / "codebooks.safetensors"))
        tokens = [f"<{c}_{i}>" for c, k in zip("ab", SIZES) for i in range(k)]
        return StageResult({"codebooks": "codebooks.safetensors"},
                           {"codebook_sizes": SIZES, "new_tokens": tokens, "levels": 2})

    def pairs(self, ctx):
        self._note(ctx)
        return StageResult({}, {"new_token_ids": [100, 112]})

    def ground(self, ctx):
        self._note(ctx)
        g = torch.Generator().manual_seed(ctx.cfg.seed)
        init = torch.randn(1, 8, generator=g).repeat(12, 1)
        if ctx.cfg.init.method == "random":
            init = torch.randn(12, 8, generator=g)
        grounded = torch.randn(12, 8, generator=g) if ctx.cfg.ground.enabled else init
        save_file({"e_new": init}, str(ctx.work_dir / "e_new_init.safetensors"))
        save_file({"e_new": grounded}, str(ctx.work_dir / "e_new_ground.safetensors"))
        steps = ctx.cfg.ground.steps if ctx.cfg.ground.enabled else 0
        return StageResult(
            {"init_embeddings": "e_new_init.safetensors", "ground_embeddings": "e_new_ground.safetensors"},
            {"new_token_ids": [100, 112], "steps_done": steps},
        )

    def sft(self, ctx):
        self._note(ctx)
        e = torch.randn(12, 8, generator=torch.Generator().manual_seed(ctx.cfg.seed + 1))
        save_file({"e_new": e}, str(ctx.work_dir / "e_new_sft.safetensors"))
        return StageResult({"sft_embeddings": "e_new_sft.safetensors"},
                           {"steps_done": ctx.cfg.sft.steps})

    def evaluate(self, ctx):
        self._note(ctx)
        # metric encodes the run's budget and arm, so the test can see the overrides arrived
        v = 0.1 + 0.01 * ctx.cfg.sft.steps + (0.05 if ctx.cfg.ground.enabled else 0) + 0.001 * ctx.cfg.seed
        (ctx.work_dir / "metrics.json").write_text(json.dumps(
            {"splits": {"test": {"recall@5": {"value": v, "ci": [v - 0.02, v + 0.02]}}},
             "baselines": {}, "invalid_sid_rate": 0.0}))
        return StageResult({"metrics": "metrics.json"}, {})


@pytest.fixture
def fake_stages(monkeypatch):
    fake = FakeStages()
    monkeypatch.setattr(pipeline, "stage_module", fake.module)
    return fake


@pytest.mark.slow  # ~20 plots rendered by the real report stage
def test_compare_shares_stages_runs_arms_and_resumes(tmp_path, fake_stages, capsys):
    cfg = _base_cfg(tmp_path)
    out = tmp_path / "cmp"
    paths = CMP.compare(cfg, ["mean", "gti"], 2, out, echo=lambda m: None)
    shared = [c for c in fake_stages.calls if c[0] in SHARED_STAGES]
    assert [c[0] for c in shared] == list(SHARED_STAGES)  # built once, not per arm
    assert all(c[1] == str(out / "shared") for c in shared)
    arm_calls = [c for c in fake_stages.calls if c[0] == "ground"]
    assert len(arm_calls) == 4
    # shared stage files are the same inodes in every run folder (hard links)
    cb = out / "shared" / "sid" / "codebooks.safetensors"
    for arm in ("mean", "gti"):
        for seed in (0, 1):
            linked = out / "runs" / arm / f"seed{seed}" / "sid" / "codebooks.safetensors"
            assert linked.stat().st_ino == cb.stat().st_ino
    doc = json.loads(paths["json"].read_text())
    assert doc["arms"] == ["mean", "gti"] and doc["seeds_per_arm"] == {"mean": 2, "gti": 2}
    rows = {(r["arm"], r["name"]): r for r in doc["metrics"]}
    # equal budget: mean got 5 + 7 SFT steps, gti 5 SFT steps + grounding
    assert rows[("mean", "recall@5")]["mean"] == pytest.approx(0.1 + 0.12 + 0.0005)
    assert rows[("gti", "recall@5")]["mean"] == pytest.approx(0.1 + 0.05 + 0.05 + 0.0005)
    assert rows[("gti", "recall@5")]["lift"] == pytest.approx(0.2005 / 0.2205 - 1)
    er = {(r["arm"], r["group"]): r["mean"] for r in doc["diagnostics"] if r["name"] == "effective_rank"}
    assert er[("mean", "init")] == pytest.approx(1.0, abs=1e-5) and er[("gti", "ground")] > 3
    assert ("mean", "ground") not in er  # no grounding in the mean arm
    page = paths["html"].read_text()
    assert "<th>mean</th>" in page and "<th>gti</th>" in page
    assert page.count("data:image/png;base64,") >= 4
    assert json.loads((out / "compare.json").read_text())["seeds"] == {"mean": [0, 1], "gti": [0, 1]}

    # rerun: everything is up to date, no stage runs again
    fake_stages.calls.clear()
    CMP.compare(cfg, ["mean", "gti"], 2, out, echo=lambda m: None)
    assert fake_stages.calls == []
    # shared stages rebuilt (a later session): the finished arm runs are left alone
    shutil.rmtree(out / "shared")
    CMP.compare(cfg, ["mean", "gti"], 2, out, echo=lambda m: None)
    assert [c[0] for c in fake_stages.calls] == list(SHARED_STAGES)
    fake_stages.calls.clear()
    # a changed SFT budget reruns only the arm stages from sft on
    cfg2 = _base_cfg(tmp_path, "sft.steps=6")
    CMP.compare(cfg2, ["gti"], 1, out, echo=lambda m: None)
    assert [c[0] for c in fake_stages.calls] == ["sft", "evaluate"]


def test_records_stand_for_runs_elsewhere_and_are_refused_when_anything_differs(tmp_path, fake_stages):
    """A comparison resumed on another machine (fresh --out, records carried over): finished
    arm runs are taken from their records, never rerun; a changed config key or changed
    shared data makes the record stand for nothing (named), and that run goes again."""
    rec_dir = tmp_path / "records"
    cfg = _base_cfg(tmp_path, f"compare.records_dir={rec_dir}")
    msgs: list[str] = []
    first = CMP.compare(cfg, ["mean", "gti"], 1, tmp_path / "here", echo=msgs.append)
    assert sorted(p.relative_to(rec_dir).as_posix() for p in rec_dir.rglob("*.json")) == [
        "gti/seed0.json", "mean/seed0.json"]
    doc1 = json.loads(first["json"].read_text())

    fake_stages.calls.clear()
    msgs.clear()
    again = CMP.compare(cfg, ["mean", "gti"], 1, tmp_path / "elsewhere", echo=msgs.append)
    assert [c[0] for c in fake_stages.calls] == list(SHARED_STAGES)  # no arm stage ran
    assert sum("taken from" in m for m in msgs) == 2
    doc2 = json.loads(again["json"].read_text())
    key = lambda d: {(r["arm"], r["name"]): r["mean"] for r in d["metrics"]}
    assert key(doc2) == key(doc1) and doc2["seeds_per_arm"] == {"mean": 1, "gti": 1}
    assert json.loads((tmp_path / "elsewhere" / "compare.json").read_text())["runs"][0]["from_record"]

    # a config key that changes what a run computes: that record is refused, by key, and the
    # rerun with the other config does not overwrite it
    fake_stages.calls.clear()
    msgs.clear()
    kept = (rec_dir / "gti" / "seed0.json").read_text()
    cfg_lr = _base_cfg(tmp_path, f"compare.records_dir={rec_dir}", "sft.lr=1e-5")
    CMP.compare(cfg_lr, ["gti"], 1, tmp_path / "third", echo=msgs.append)
    assert "ground" in [c[0] for c in fake_stages.calls]
    assert any("record not used" in m and "sft.lr" in m for m in msgs)
    assert any("kept the existing record" in m and "sft.lr" in m for m in msgs)
    assert (rec_dir / "gti" / "seed0.json").read_text() == kept

    # other shared data (here: another catalog file content) refuses every record, named
    def other_ingest(ctx):
        (ctx.work_dir / "items.parquet").write_text("other catalog")
        return StageResult({"items": "items.parquet"}, {"n_items": 3})

    fake_stages.ingest = other_ingest
    msgs.clear()
    CMP.compare(_base_cfg(tmp_path, f"compare.records_dir={rec_dir}"), ["mean"], 1,
                tmp_path / "fourth", echo=msgs.append)
    assert any("record not used" in m and "ingest/items differ" in m for m in msgs)


def test_report_only_runs_nothing(tmp_path, fake_stages):
    cfg = _base_cfg(tmp_path)
    with pytest.raises(CompareError, match="--report-only: shared stage"):
        CMP.compare(cfg, ["mean"], 1, tmp_path / "o", echo=lambda m: None, report_only=True)
    CMP.compare(cfg, ["mean"], 1, tmp_path / "o", echo=lambda m: None)
    record = tmp_path / "o" / "records" / "mean" / "seed0.json"
    doc = json.loads(record.read_text())
    doc["written"] = "an earlier session"  # a rewrite would stamp it again
    record.write_text(json.dumps(doc))
    written = record.read_text()
    fake_stages.calls.clear()
    paths = CMP.compare(cfg, ["mean"], 1, tmp_path / "o", echo=lambda m: None, report_only=True)
    assert fake_stages.calls == [] and paths["html"].is_file()
    assert record.read_text() == written  # the record that stands for the run is not rewritten
    record.unlink()  # a finished run without its record gets one
    CMP.compare(cfg, ["mean"], 1, tmp_path / "o", echo=lambda m: None, report_only=True)
    assert json.loads(record.read_text())["record"] == json.loads(written)["record"]


def test_config_diff_and_records_validated_with_todays_defaults(tmp_path):
    assert config_diff({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}, "d": 0}) == ["a.c", "d"]
    assert config_diff({"a": [1, 2]}, {"a": [1, 2]}) == []
    cfg = _base_cfg(tmp_path)
    r = CMP.plan(cfg, ["mean"], 1, tmp_path / "o")[0]
    rdir = tmp_path / "rec"
    path = record_path(rdir, "mean", 0)
    path.parent.mkdir(parents=True)
    old_cfg = r.cfg.model_dump(mode="json")
    del old_cfg["compare"]["records_dir"]  # a key that did not exist when the record was made
    del old_cfg["sft"]["val_every"]        # ... counts at today's default
    body = {"format": RECORD_FORMAT, "shared": {"ingest/items": "h"}, "facts": {"x": 1},
            "record": {"arm": "mean", "seed": 0, "config": old_cfg}}
    path.write_text(json.dumps(body))
    old_cfg["sid"]["kmeans_iters"] = 1  # shared-stage settings count only through the hashes
    path.write_text(json.dumps(body))
    rec, facts, why = read_record(r, rdir, {"ingest/items": "h"})
    assert why == "" and rec.arm == "mean" and facts == {"x": 1}
    assert "ingest/items differ" in read_record(r, rdir, {"ingest/items": "other"})[2]
    body["record"]["config"]["sft"]["no_such_key"] = 1
    path.write_text(json.dumps(body))
    assert "does not validate today" in read_record(r, rdir, {"ingest/items": "h"})[2]
    path.write_text("{not json")
    assert "unreadable record" in read_record(r, rdir, {"ingest/items": "h"})[2]
    assert read_record(r, tmp_path / "none", {}) == (None, None, "")


def test_proof_config_arms_see_the_same_sft_examples(tmp_path, fake_stages):
    """The paper's protocol in the proof config: grounding on top, the same SFT examples in
    every arm (steps done x global batch, read back from each run's SFT manifest)."""
    cfg = config.load(ROOT / "jobs/configs/proof-smollm2.yaml", [f"run_dir={tmp_path / 'p'}"])
    assert cfg.compare.equal_budget is False
    runs = CMP.plan(cfg, ["mean", "gti", "random"], 2, tmp_path / "o")
    assert {(r.cfg.sft.steps, r.cfg.sft.batch_size, r.cfg.sft.grad_accum) for r in runs} == {
        (cfg.sft.steps, cfg.sft.batch_size, cfg.sft.grad_accum)}
    assert [r.cfg.ground.enabled for r in runs] == [False, True, False] * 2
    small = _base_cfg(tmp_path, "compare.equal_budget=false", "sft.batch_size=4", "rl.steps=3")
    paths = CMP.compare(small, ["mean", "gti", "random", "gti+rl"], 1, tmp_path / "f", echo=lambda m: None)
    doc = json.loads(paths["json"].read_text())
    seen = {r["arm"]: r["facts"]["sft_examples"] for r in doc["runs"]}
    assert seen == {"mean": 5 * 4, "gti": 5 * 4, "random": 5 * 4, "gti+rl": 5 * 4}
    # gti+rl: labelled so in the report, its run facts carry the rl stage's; the others have none
    assert "gti+rl" in doc["arms"] and {r["arm"] for r in doc["metrics"]} >= {"gti", "gti+rl"}
    rl_facts = {r["arm"]: r["facts"].get("rl") for r in doc["runs"]}
    assert rl_facts["gti+rl"] == {"enabled": True, "steps_done": 3, "stopped_at": None,
                                  "step_stats": {"reward_mean": 0.5},
                                  "best": {"metric": "val_mrr", "start": 0.2, "value": 0.25, "step": 3}}
    assert rl_facts["mean"] is rl_facts["gti"] is rl_facts["random"] is None
    assert "<th>gti+rl</th>" in paths["html"].read_text()
    kept = {a: json.loads((tmp_path / "f" / "records" / a / "seed0.json").read_text())["facts"]
            for a in ("gti_rl", "gti")}
    assert kept["gti_rl"]["rl"] == rl_facts["gti+rl"] and "rl" not in kept["gti"]


def test_cli_main_prints_report_path_and_reports_failed_arms(tmp_path, fake_stages, capsys, monkeypatch):
    args = Namespace(config=None, overrides=[f"run_dir={tmp_path / 'b'}", "model.name=tiny",
                                             "compare.parallel=false", "report.text_sample=0",
                                             "report.bootstrap=20"],
                     arms="mean,gti", seeds="1", out=str(tmp_path / "o"))
    assert CMP.cli_main(args) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "o" / "report.html")

    def broken(ctx):
        raise RuntimeError("sft exploded")

    monkeypatch.setattr(fake_stages, "sft", broken)
    args.overrides.append("sft.lr=1e-5")  # invalidates sft, so it reruns and fails
    with pytest.raises(CompareError, match=r"2 of 2 arm runs failed \(mean/seed0, gti/seed0\)"):
        CMP.cli_main(args)
    assert "sft exploded" in capsys.readouterr().err


# --------------------------------------------------------------------------- report inputs
def _write_run(r, *, new_fields=True, n_items=50):
    """The manifests/files write_report reads from one finished arm run (no stage runs)."""
    from gti.run.manifest import Manifest

    def manifest(stage, outputs=None, facts=None, duration=0.0):
        d = r.run_dir / stage
        d.mkdir(parents=True, exist_ok=True)
        Manifest(stage=stage, fingerprint="fp", config={}, outputs=outputs or {}, facts=facts or {},
                 duration_s=duration).write(d)
        return d

    d = manifest("report", {"report_json": "report.json"})
    (d / "report.json").write_text(json.dumps({"runs": [{"diagnostics": {}}]}))
    good = r.arm == "gti"
    rng = np.random.default_rng(r.seed)
    ranks = rng.integers(1, (10 if good else 40) + 1, size=60).astype(float)
    metrics = {"splits": {"test": {"recall@10": {"value": float((ranks <= 10).mean()), "ci": [0.0, 1.0]}}},
               "baselines": {}, "invalid_sid_rate": 0.0,
               "per_user": {"test": {"user_ids": [f"u{i}" for i in range(60)],
                                     "recall@10": (ranks <= 10).astype(float).tolist()}}}
    if new_fields:
        rr, pct = 1 / ranks, (ranks - 1) / (n_items - 1)
        metrics["ranks"] = {"test": {
            "mrr": {"value": float(rr.mean()), "ci": [0.0, 1.0]},
            "mean_percentile_rank": {"value": float(pct.mean()), "ci": [0.0, 1.0]},
            "median_rank": float(np.median(ranks)), "mean_rank": float(ranks.mean()),
            "n_users": 60, "n_items": n_items}}
        metrics["per_user"]["test"]["exact_rank"] = ranks.tolist()
        metrics["slices"] = {"cold": {
            "definition": {"max_sft_targets": 1, "n_cold_items": 7, "n_items": n_items},
            "test": {"n_users": 9, "model": {"recall@10": {"value": 0.3 if good else 0.1, "ci": [0.0, 0.5]}},
                     "baselines": {"mostpop": {"recall@10": {"value": 0.0, "ci": [0.0, 0.0]}}},
                     "ranks": {}}}}
    d = manifest("evaluate", {"metrics": "metrics.json"})
    (d / "metrics.json").write_text(json.dumps(metrics))
    if new_fields:
        manifest("ground", facts={"timing": {"compute_s": 30.0}} if good else {},
                 duration=40.0 if good else 2.0)
        val = {"val_loss": [{"step": s, "value": (2.0 if good else 2.5) - 0.1 * s / 5} for s in (5, 10)],
               "val_mrr": [{"step": s, "value": (0.2 if good else 0.1) + 0.01 * s} for s in (5, 10)]}
        manifest("sft", facts={"val_history": val, "timing": {"compute_s": 50.0}}, duration=60.0)
    else:  # an older run: only the Recall@10 curve, no stage durations
        manifest("ground")
        manifest("sft", facts={"val_recall@10": [{"step": 5, "value": 0.1}]})


def test_write_report_has_ranks_cold_curves_and_wall_time(tmp_path):
    cfg = _base_cfg(tmp_path)
    out = tmp_path / "cmp"
    runs = CMP.plan(cfg, ["mean", "gti"], 2, out)
    for r in runs:
        _write_run(r)
    rec = load_record(runs[1])  # gti seed 0 (seed-major order)
    assert rec.curves["val_mrr"] == [[5, pytest.approx(0.25)], [10, pytest.approx(0.3)]]
    assert rec.timing == {"grounding": True, "ground_s": 40.0, "ground_compute_s": 30.0,
                          "sft_s": 60.0, "sft_compute_s": 50.0}
    facts = run_facts(runs[1])
    assert facts["ground_s"] == 40.0 and facts["sft_s"] == 60.0 and facts["ground_steps"] == 7

    paths = CMP.write_report(runs, cfg, out, "T")
    doc = json.loads(paths["json"].read_text())
    rows = {(r["arm"], r["name"]): r for r in doc["metrics"]}
    assert rows[("gti", "mrr")]["lift"] > 0 and rows[("gti", "mrr")]["verdict"] == "better"
    assert rows[("gti", "mean_percentile_rank")]["lift"] < 0
    assert rows[("gti", "mean_percentile_rank")]["verdict"] == "better"
    assert "paired user bootstrap" in rows[("gti", "mrr")]["ci_method"]
    cold = {(r["arm"], r["name"]): r["mean"] for r in doc["cold"]["rows"]}
    assert cold == {("mean", "recall@10"): pytest.approx(0.1), ("gti", "recall@10"): pytest.approx(0.3)}
    assert doc["cold"]["definition"]["n_cold_items"] == 7
    assert doc["learning_curves"]["val_loss"]["gti"] == [[5, pytest.approx(1.9)], [10, pytest.approx(1.8)]]
    assert set(doc["learning_curves"]) == {"val_loss", "val_mrr"}
    assert (out / "plots" / "curve_val_loss.png").is_file() and (out / "plots" / "curve_val_mrr.png").is_file()
    assert doc["wall_time"]["gti"]["total_s"] == pytest.approx(100.0)
    assert doc["wall_time"]["mean"]["total_s"] == pytest.approx(62.0)
    assert doc["wall_time"]["gti"]["extra_vs_baseline_s"] == pytest.approx(38.0)
    page = paths["html"].read_text()
    assert "Learning curves" in page and "Cold-item slice" in page and "Wall time" in page
    assert page.count("data:image/png;base64,") == 2


def test_run_facts_and_timing_carry_rl_only_when_it_trained(tmp_path):
    from gti.run.manifest import Manifest

    cfg = _base_cfg(tmp_path, "rl.steps=4")
    gti, gti_rl = CMP.plan(cfg, ["gti", "gti+rl"], 1, tmp_path / "cmp")
    for r in (gti, gti_rl):
        _write_run(r)
    before = (run_facts(gti), load_record(gti).timing)
    trained = {"enabled": True, "steps_done": 4, "stopped_at": 3, "step_stats": {"reward_mean": 0.4, "kl": 0.01},
               "best": {"metric": "val_mrr", "start": 0.2, "value": 0.3, "step": 2},
               "trainable_params": 99, "timing": {"compute_s": 8.0}}
    for r, facts, secs in ((gti, {"enabled": False, "steps_done": 0}, 0.5), (gti_rl, trained, 9.0)):
        (r.run_dir / "rl").mkdir()
        Manifest(stage="rl", fingerprint="fp", config={}, facts=facts, duration_s=secs).write(r.run_dir / "rl")
    assert (run_facts(gti), load_record(gti).timing) == before  # rl disabled: as without the stage
    facts = run_facts(gti_rl)
    assert facts["rl"] == {k: trained[k] for k in ("enabled", "steps_done", "stopped_at", "step_stats", "best")}
    assert facts["rl_s"] == 9.0 and facts["sft_steps"] == 5
    timing = load_record(gti_rl).timing
    assert timing["rl_s"] == 9.0 and timing["rl_compute_s"] == 8.0


def test_write_report_on_old_runs(tmp_path):
    cfg = _base_cfg(tmp_path)
    out = tmp_path / "cmp"
    runs = CMP.plan(cfg, ["mean", "gti"], 1, out)
    for r in runs:
        _write_run(r, new_fields=False)
    assert load_record(runs[0]).timing == {}
    assert "ground_s" not in run_facts(runs[0])
    doc = json.loads(CMP.write_report(runs, cfg, out, "T")["json"].read_text())
    assert {r["name"] for r in doc["metrics"]} == {"recall@10", "invalid_sid_rate"}
    assert doc["cold"]["rows"] == [] and doc["wall_time"] == {}
    assert doc["learning_curves"] == {"val_recall@10": {"mean": [[5, 0.1]], "gti": [[5, 0.1]]}}


# --------------------------------------------------------------------------- the real thing
@pytest.mark.slow
@pytest.mark.ray
def test_compare_tiny_end_to_end(tmp_path, tiny_upstream, ray_start_4_cpus):
    """2 arms x 1 seed of the real tiny pipeline, arms as parallel Ray tasks: on 4 CPUs each
    arm holds 1 Train worker + 1 CPU of Ray Data headroom, so both run at once. The shared
    stages are the session's tiny ingest..pairs (found up to date in `<out>/shared`); that
    compare runs and links them itself is checked by the fake-stage test above."""
    from testkit import adopt_tiny_upstream

    # sft.steps=0: the gti arm grounds (what the geometry rows below need) and trains no SFT,
    # the mean arm gets the grounding steps as SFT steps (equal budget): 2 Train runs, not 3.
    cfg = config.load(ROOT / "jobs/configs/tiny.yaml", [f"run_dir={tmp_path / 'tiny'}", "sft.steps=0"])
    adopt_tiny_upstream(tiny_upstream, tmp_path / "cmp" / "shared")
    assert CMP.auto_parallel(cfg, {"CPU": 4.0}) == 2
    paths = CMP.compare(cfg, ["mean", "gti"], 1, tmp_path / "cmp")
    doc = json.loads(paths["json"].read_text())
    assert doc["arms"] == ["mean", "gti"]
    assert {r["arm"] for r in doc["metrics"]} == {"mean", "gti"}
    er = {(r["arm"], r["group"]): r["mean"] for r in doc["diagnostics"] if r["name"] == "effective_rank"}
    assert er[("mean", "init")] < 1.5  # mean init: (nearly) one point
    assert er[("gti", "ground")] > er[("gti", "init")]
    assert "<th>gti</th>" in paths["html"].read_text()


# --------------------------------------------------------------------------- several SID maps
def test_default_plan_is_one_map_in_todays_folders(tmp_path):
    """Without --sid-seeds nothing moves: one map (sid.seed unset), runs/<arm>/seed<s>,
    shared/, records/<arm>/seed<s>.json, run keys (arm, seed)."""
    cfg = _base_cfg(tmp_path)
    out = tmp_path / "out"
    runs = CMP.plan(cfg, ["mean", "gti"], 2, out)
    assert runs == CMP.plan(cfg, ["mean", "gti"], 2, out, n_maps=1)
    assert [(r.key, r.run_dir, r.sid_seed, r.cfg.sid.seed) for r in runs] == [
        ((a, s), out / "runs" / a / f"seed{s}", None, None) for s in (0, 1) for a in ("mean", "gti")]
    assert "seed" not in runs[0].cfg.model_dump(mode="json")["sid"]
    assert CMP.map_dirs(out, None) == (out / "shared", out / "runs")
    assert record_path(tmp_path / "rec", "gti", 1, runs[1].sid_seed) == tmp_path / "rec" / "gti" / "seed1.json"
    assert [r.name for r in runs[:2]] == ["mean seed 0", "gti seed 0"]


def test_plan_on_three_sid_maps(tmp_path):
    """--sid-seeds 3: three shared folders, every arm x seed on each map with that map's
    sid.seed in its config, seed-major then map; no two runs share a folder or a record."""
    from gti.experiments.shared_stages import shared_config

    cfg = _base_cfg(tmp_path, "seed=4")
    out = tmp_path / "out"
    runs = CMP.plan(cfg, ["mean", "gti"], 2, out, n_maps=3)
    assert len(runs) == 2 * 2 * 3
    assert [(r.seed, r.sid_seed, r.arm) for r in runs[:6]] == [
        (4, m, a) for m in (4, 5, 6) for a in ("mean", "gti")]
    for r in runs:
        assert r.cfg.sid.seed == r.sid_seed and r.cfg.seed == r.seed
        assert r.run_dir == out / "runs" / f"sid{r.sid_seed}" / r.arm / f"seed{r.seed}"
        assert r.cfg.resolved_run_dir() == r.run_dir.resolve()
    assert len({r.run_dir for r in runs}) == len(runs) == len({r.key for r in runs})
    rdir = tmp_path / "rec"
    assert len({record_path(rdir, r.arm, r.seed, r.sid_seed) for r in runs}) == len(runs)
    assert record_path(rdir, "gti", 4, 5) == rdir / "sid5" / "gti" / "seed4.json"
    shared = [shared_config(cfg, out, m) for m in (4, 5, 6)]
    assert [c.resolved_run_dir() for c in shared] == [(out / "shared" / f"sid{m}").resolve() for m in (4, 5, 6)]
    assert [c.sid.seed for c in shared] == [4, 5, 6] and {c.seed for c in shared} == {4}
    assert runs[1].name == "gti seed 4 on sid4"
    with pytest.raises(CompareError, match="--sid-seeds must be >= 1"):
        CMP.plan(cfg, ["mean"], 1, out, n_maps=0)


def test_compare_on_two_sid_maps_reports_each_map_and_the_mean(tmp_path, fake_stages):
    """The harness on 2 maps with fake stages: ingest and embed made once (linked into the
    second map's shared folder), sid and pairs once per map with its sid.seed, every arm on
    every map, records per map, and compare.json's `maps` summary over them."""
    from gti.experiments.sid_maps import HEADLINE

    def sid(ctx):  # codebooks from the map's seed, so the maps (and their hashes) differ
        fake_stages._note(ctx)
        g = torch.Generator().manual_seed(ctx.cfg.sid.seed)
        save_file({f"level_{i}": torch.randn(k, 3, generator=g) for i, k in enumerate(SIZES)},
                  str(ctx.work_dir / "codebooks.safetensors"))
        tokens = [f"<{c}_{i}>" for c, k in zip("ab", SIZES) for i in range(k)]
        return StageResult({"codebooks": "codebooks.safetensors"},
                           {"codebook_sizes": SIZES, "new_tokens": tokens, "levels": 2})

    def evaluate(ctx):  # per-user hits that depend on the arm and the map
        fake_stages._note(ctx)
        rng = np.random.default_rng([ctx.cfg.seed, ctx.cfg.sid.seed, ctx.cfg.ground.enabled])
        hit = (rng.random(30) < (0.3 if ctx.cfg.ground.enabled else 0.1) + 0.1 * ctx.cfg.sid.seed).astype(float)
        (ctx.work_dir / "metrics.json").write_text(json.dumps({
            "splits": {"test": {"recall@10": {"value": float(hit.mean()), "ci": [0.0, 1.0]}}},
            "baselines": {}, "per_user": {"test": {"user_ids": [f"u{i}" for i in range(30)],
                                                   "recall@10": hit.tolist()}}}))
        return StageResult({"metrics": "metrics.json"}, {})

    fake_stages.sid, fake_stages.evaluate = sid, evaluate
    out = tmp_path / "cmp"
    msgs: list[str] = []
    paths = CMP.compare(_base_cfg(tmp_path), ["mean", "gti"], 1, out, echo=msgs.append, n_maps=2)
    calls = [(c[0], Path(c[1]).relative_to(out).as_posix()) for c in fake_stages.calls if c[0] in SHARED_STAGES]
    assert calls == [("ingest", "shared/sid0"), ("embed", "shared/sid0"), ("sid", "shared/sid0"),
                     ("pairs", "shared/sid0"), ("sid", "shared/sid1"), ("pairs", "shared/sid1")]
    grounded = sorted(Path(c[1]).relative_to(out).as_posix() for c in fake_stages.calls if c[0] == "ground")
    assert grounded == ["runs/sid0/gti/seed0", "runs/sid0/mean/seed0", "runs/sid1/gti/seed0", "runs/sid1/mean/seed0"]
    for m in (0, 1):
        assert config.load(out / "runs" / f"sid{m}" / "gti" / "seed0" / "config.yaml").sid.seed == m
    assert sorted(p.relative_to(out / "records").as_posix() for p in (out / "records").rglob("*.json")) == [
        "sid0/gti/seed0.json", "sid0/mean/seed0.json", "sid1/gti/seed0.json", "sid1/mean/seed0.json"]
    plan_doc = json.loads((out / "compare.json").read_text())
    assert plan_doc["sid_seeds"] == [0, 1] and set(plan_doc["shared_run_dirs"]) == {"sid0", "sid1"}
    assert plan_doc["shared_identity"]["sid0"] != plan_doc["shared_identity"]["sid1"]
    assert [r["sid_seed"] for r in plan_doc["runs"]] == [0, 0, 1, 1]
    maps = plan_doc["maps"]
    fig = maps["mean"]["arms"]["gti"]["recall@10"]
    per_map = [maps["per_map"][t]["arms"]["gti"]["recall@10"]["value"] for t in ("sid0", "sid1")]
    assert fig["mean"] == pytest.approx(np.mean(per_map)) and fig["per_map"] == dict(zip(("sid0", "sid1"), per_map))
    assert set(maps["per_map"]["sid1"]["paired"]["gti - mean"]) == {"recall@10"} and HEADLINE[0] == "recall@10"
    assert all(Path(p).is_file() for p in maps["reports"].values()) and set(maps["reports"]) == {"sid0", "sid1"}
    doc = json.loads(paths["json"].read_text())
    assert doc["seeds_per_arm"] == {"mean": 2, "gti": 2} and "on 2 SID maps" in doc["title"]
    assert any(m.startswith("gti recall@10:") and "mean over 2 SID maps" in m for m in msgs)
    fake_stages.calls.clear()  # rerun: everything up to date
    CMP.compare(_base_cfg(tmp_path), ["mean", "gti"], 1, out, echo=lambda m: None, n_maps=2)
    assert fake_stages.calls == []
