"""Tests of gti/stages/report.py against fixture upstream stages written with the documented
names, keys and shapes (docs/ARCHITECTURE.md), run through gti.run.pipeline.run_stage."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from testkit import stage_manifest

from gti import config
from gti.run import pipeline
from gti.run.manifest import Manifest
from gti.stages import report as R
from gti.common.errors import DataError

SIZES = [8, 8]
D, N_OLD = 16, 40


def make_upstream(run_dir, grounded=True, markers=2):
    """Fake sid/ground/sft/evaluate outputs: GTI-like (spread, code-aligned) after grounding."""
    g = torch.Generator().manual_seed(0)
    n_tok = sum(SIZES)
    codes = [torch.randn(k, 4, generator=g) for k in SIZES]
    tokens = [f"<{c}_{i}>" for c, k in zip("ab", SIZES) for i in range(k)]
    d = stage_manifest(run_dir, "sid", {"codebooks": "codebooks.safetensors"},
                  {"levels": 2, "codebook_sizes": SIZES, "new_tokens": tokens})
    save_file({f"level_{i}": c for i, c in enumerate(codes)}, str(d / "codebooks.safetensors"))
    old = torch.randn(N_OLD, D, generator=g)
    mean_init = old.mean(0, keepdim=True).repeat(n_tok + markers, 1)
    proj = torch.randn(4, D, generator=g)
    grounded_rows = torch.cat([torch.cat(codes) @ proj, torch.randn(markers, D, generator=g)])
    sft_rows = grounded_rows + 0.1 * torch.randn(grounded_rows.shape, generator=g)
    d = stage_manifest(run_dir, "ground",
                  {"model": "model", "init_embeddings": "e_new_init.safetensors",
                   "ground_embeddings": "e_new_ground.safetensors"},
                  {"new_token_ids": [N_OLD, N_OLD + n_tok + markers], "steps_done": 6 if grounded else 0})
    save_file({"e_new": mean_init}, str(d / "e_new_init.safetensors"))
    save_file({"e_new": grounded_rows if grounded else mean_init}, str(d / "e_new_ground.safetensors"))
    (d / "model").mkdir()
    full = torch.cat([old, grounded_rows])
    save_file({"model.embed_tokens.weight": full.to(torch.bfloat16), "model.norm.weight": torch.ones(D)},
              str(d / "model" / "model.safetensors"))
    d = stage_manifest(run_dir, "sft", {"model": "model", "sft_embeddings": "e_new_sft.safetensors"},
                  {"steps_done": 6})
    save_file({"e_new": sft_rows}, str(d / "e_new_sft.safetensors"))
    (d / "model").mkdir()
    save_file({"model.embed_tokens.weight": torch.cat([old, sft_rows])}, str(d / "model" / "model.safetensors"))
    metrics = {
        "splits": {"test": {"recall@5": {"value": 0.2, "ci": [0.1, 0.3]},
                            "ndcg@5": {"value": 0.1, "ci": [0.05, 0.15]}}},
        "baselines": {"mostpop": {"test": {"recall@5": {"value": 0.05, "ci": [0.0, 0.1]}}}},
        "invalid_sid_rate": 0.0,
    }
    d = stage_manifest(run_dir, "evaluate", {"metrics": "metrics.json"}, {})
    (d / "metrics.json").write_text(json.dumps(metrics))


def _cfg(tmp_path, *overrides):
    return config.load(None, [f"run_dir={tmp_path / 'run'}", "model.name=tiny", *overrides])


def test_report_stage_writes_report_and_facts(tmp_path):
    cfg = _cfg(tmp_path, "report.text_sample=16")
    run_dir = cfg.resolved_run_dir()
    make_upstream(run_dir)
    m = pipeline.run_stage(pipeline.spec("report"), cfg, run_dir)
    out = run_dir / "report"
    for name in ("report_html", "report_json", "report_csv", "plots"):
        assert (out / m.outputs[name]).exists()
    er = m.facts["effective_rank"]
    assert set(er) == {"init", "ground", "sft"}
    assert er["init"] == pytest.approx(1.0, abs=1e-4)  # mean init: one point
    assert er["ground"] > 3 and er["sft"] > 3
    # grounded rows are a linear image of the code vectors: strong RSA; init: undefined
    assert m.facts["rsa"]["init"]["pearson"] is None
    assert m.facts["rsa"]["ground"]["pearson"] > 0.5
    assert m.facts["label"] == "gti"
    assert {"spectra.png", "sid_sid_init.png", "sid_sid_sft.png", "sid_text_sft.png"} <= set(m.facts["plots"])
    doc = json.loads((out / "report.json").read_text())
    assert doc["arms"] == ["gti"]
    assert doc["runs"][0]["diagnostics"]["sft"]["shape"] == [sum(SIZES) + 2, D]
    assert "mean_cosine_new_text" in doc["runs"][0]["diagnostics"]["init"]
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(m.facts["plots"])
    assert "recall@5" in page


def test_report_stage_without_grounding_leaves_ground_phase_out(tmp_path):
    cfg = _cfg(tmp_path, "ground.enabled=false", "sft.multitask=true", "report.text_sample=0")
    run_dir = cfg.resolved_run_dir()
    make_upstream(run_dir, grounded=False)
    m = pipeline.run_stage(pipeline.spec("report"), cfg, run_dir)
    assert set(m.facts["effective_rank"]) == {"init", "sft"}
    assert m.facts["label"] == "mean+multitask"
    assert not any(p.startswith("sid_text") for p in m.facts["plots"])


def test_inconsistent_sid_manifest_is_a_data_error(tmp_path):
    cfg = _cfg(tmp_path)
    run_dir = cfg.resolved_run_dir()
    make_upstream(run_dir)
    m = Manifest.read(run_dir / "sid")
    m.facts["codebook_sizes"] = [8, 9]
    m.write(run_dir / "sid")
    with pytest.raises(DataError, match="codebook_sizes"):
        pipeline.run_stage(pipeline.spec("report"), cfg, run_dir)


def test_arm_label():
    assert R.arm_label(config.load(None, ["init.method=random", "ground.enabled=false"])) == "random"
    assert R.arm_label(config.load(None, ["sft.multitask=true"])) == "gti+multitask"
    assert R.arm_label(config.load(None, ["report.label=x"])) == "x"


def test_text_rows_reads_a_slice(tmp_path):
    full = torch.arange(50 * 3, dtype=torch.float32).reshape(50, 3)
    (tmp_path / "m").mkdir()
    save_file({"model.embed_tokens.weight": full}, str(tmp_path / "m" / "model.safetensors"))
    rows = R.text_rows(tmp_path / "m", 10, 4)
    assert rows.shape == (4, 3)
    assert np.allclose(rows[0], full[0].numpy()) and np.allclose(rows[-1], full[9].numpy())
    assert R.text_rows(tmp_path / "missing", 10, 4) is None
