"""Stage `ground` (gti/stages/ground.py) on a small hand-made run directory (ingest + sid
manifests, then the real `pairs` stage): the plain init arm (no training) and grounding with
2 Ray Train workers + DeepSpeed ZeRO-2; outputs and facts as docs/ARCHITECTURE.md's `ground` row."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gti import config as C
from gti.run.manifest import Manifest

N_ITEMS, LEVELS, K, CODE_DIM = 24, 2, 4, 8


BASE = ["model.name=tiny", "model.tiny_hidden=32", "model.tiny_layers=1", "model.tiny_heads=2", "ray_num_cpus=2",
        "pairs.max_len=64", "pairs.val_fraction=0.25"]


def _write_ingest_and_sid(run) -> None:
    """The ingest and sid outputs (items, SID map, codebooks) with their manifests."""
    from safetensors.torch import save_file

    ing, sid = run / "ingest", run / "sid"
    ing.mkdir(parents=True)
    sid.mkdir()
    ids = [f"it{i:03d}" for i in range(N_ITEMS)]
    pq.write_table(pa.table({
        "item_id": ids,
        "title": [f"Glass beaker {i} ml" for i in range(N_ITEMS)],
        "description": ["" if i % 5 == 0 else f"A sturdy lab beaker number {i}." for i in range(N_ITEMS)],
        "category": ["Lab > Glass"] * N_ITEMS,
        "attributes_text": ["brand: Pyrex"] * N_ITEMS,
        "text_is_pseudo": [False] * N_ITEMS,
    }), ing / "items.parquet")
    codes = [[i % K, (i // K) % (K + 2)] for i in range(N_ITEMS)]
    sizes = [K, K + 2]
    pq.write_table(pa.table({
        "item_id": ids,
        "codes": pa.array(codes, type=pa.list_(pa.int32())),
        "sid": [f"<a_{a}><b_{b}>" for a, b in codes],
    }), sid / "sid_map.parquet")
    g = torch.Generator().manual_seed(0)
    save_file({f"level_{i}": torch.randn(k, CODE_DIM, generator=g) for i, k in enumerate(sizes)},
              str(sid / "codebooks.safetensors"))
    Manifest("ingest", "fp-ingest", {}, facts={"n_items": N_ITEMS}, outputs={"items": "items.parquet"}).write(ing)
    Manifest("sid", "fp-sid", {}, facts={
        "levels": LEVELS, "codebook_sizes": sizes, "token_format": "<{level}_{code}>", "sid_map_hash": "h123",
    }, outputs={"sid_map": "sid_map.parquet", "codebooks": "codebooks.safetensors"}).write(sid)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory, ray_start_4_cpus):
    """run_dir with ingest + sid written by hand and `pairs` run for real; returns (run, base
    overrides)."""
    from gti.run import pipeline

    run = tmp_path_factory.mktemp("ground_stage") / "run"
    base = [f"run_dir={run}", *BASE]
    _write_ingest_and_sid(run)
    pipeline.run_stage(pipeline.spec("pairs"), C.load(None, base), run)
    return run, base


def _run_ground(run, base, overrides):
    from gti.run import pipeline

    cfg = C.load(None, base + overrides)
    return cfg, pipeline.run_stage(pipeline.spec("ground"), cfg, run)


def _base_rows(cfg):
    from gti.lm import models

    model, _ = models.load_model_and_tokenizer(cfg.model)
    return model.get_input_embeddings().weight.detach().clone()


def _check_export(run, cfg, facts, expect_new: torch.Tensor):
    """The exported folder loads with plain transformers; rows [first, end) hold `expect_new`,
    every old row is the base model's, gti_meta.json names the SID map and the id range."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = run / "ground" / "model"
    model = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True)
    tok = AutoTokenizer.from_pretrained(folder)
    first, end = facts["new_token_ids"]
    assert len(tok) == end
    w = model.get_input_embeddings().weight.detach()
    assert w.shape[0] == end
    assert torch.equal(w[first:end], expect_new)
    assert torch.equal(w[:first], _base_rows(cfg)[:first])
    meta = json.loads((folder / "gti_meta.json").read_text())
    assert meta["sid_map_hash"] == "h123" and meta["new_token_ids"] == [first, end]
    assert not (run / "ground" / "ray_train").exists()


@pytest.mark.slow
@pytest.mark.ray
def test_plain_init_arm_extends_initialises_and_exports(upstream):
    from safetensors.torch import load_file

    run, base = upstream
    cfg, m = _run_ground(run, base, ["ground.enabled=false", "init.method=description"])
    f = m.facts
    assert f["steps_done"] == 0 and f["grounded"] is False and f["arm"] == "description"
    first, end = f["new_token_ids"]
    assert end - first == K + K + 2 and f["sid_token_ids"] == [first, end]
    assert f["trainable_params"] == (end - first) * 32
    init = load_file(str(run / "ground" / "e_new_init.safetensors"))["e_new"]
    ground = load_file(str(run / "ground" / "e_new_ground.safetensors"))["e_new"]
    assert init.shape == (end - first, 32) and torch.equal(init, ground)
    # description arm: rows differ by code (items carrying different codes have different text)
    assert not torch.allclose(init[0], init[1])
    assert f["rows"]["moved_mean"] == 0.0  # not grounded: nothing moved
    _check_export(run, cfg, f, init)


# --------------------------------------------------------------------------- no Ray: the stage as the runner's caller
GROUND_FACTS = {"init_method", "grounded", "arm", "new_token_ids", "sid_token_ids", "sid_map_hash", "trainable_params",
                "steps_done", "final_loss", "val_exact_match", "first_loss", "tokens_per_s_median", "train_pairs",
                "val_prompts", "num_workers", "zero_stage", "precision", "precision_setting", "timing", "rows"}


def _write_pairs_by_hand(run, cfg) -> tuple[int, int]:
    """The pairs stage's outputs without Ray: the tiny tokenizer extended with the SID tokens,
    one title->SID pair per item (every fourth held out) and the facts the ground stage reads."""
    from gti.lm import models, new_rows
    from gti.sid.codec import SidCodec

    d = run / "pairs"
    d.mkdir()
    _, tok = models.build_tiny(cfg.model)
    n_before = len(tok)
    codec = SidCodec.from_facts(Manifest.read(run / "sid").facts)
    first, end = new_rows.extend_tokenizer(tok, codec.tokens())
    tok.save_pretrained(d / "tokenizer")
    codes = torch.tensor(pq.read_table(run / "sid" / "sid_map.parquet")["codes"].to_pylist())
    rows = {k: [] for k in ("item_id", "task", "split", "input_ids", "labels", "prompt_ids", "answer_ids")}
    for i, ans in enumerate(codec.token_ids(codes, tok).tolist()):
        prompt = tok.encode(f"Glass beaker {i} ml")
        for k, v in (("item_id", f"it{i:03d}"), ("task", "title2sid"), ("split", "val" if i % 4 == 0 else "train"),
                     ("input_ids", prompt + ans), ("labels", [-100] * len(prompt) + ans), ("prompt_ids", prompt),
                     ("answer_ids", ans)):
            rows[k].append(v)
    pq.write_table(pa.table(rows), d / "pairs.parquet")
    Manifest("pairs", "fp-pairs", {}, facts={"new_token_ids": [first, end], "vocab_size_before": n_before,
                                             "sid_map_hash": "h123"},
             outputs={"tokenizer": "tokenizer", "pairs": "pairs.parquet"}).write(d)
    return first, end


def test_a_killed_grounding_is_finished_in_its_partial_dir_with_the_same_run(tmp_path, monkeypatch):
    """No Ray (`fit` faked, testkit): the stage's first attempt dies in training and keeps its
    partial dir; the stage again hands the runner's `fit` the same storage path, run name,
    typed worker config and rows (what makes the loop resume it), and records the runner's
    facts with the same keys as ever."""
    from safetensors.torch import load_file
    from testkit import FailOnceFit, WorkerDied, fake_data, finished_fit, no_ray

    from gti.run import pipeline
    from gti.train import loop
    from gti.train.worker_config import GroundRows

    run = tmp_path / "run"
    _write_ingest_and_sid(run)
    cfg = C.load(None, [f"run_dir={run}", *BASE, "init.method=mean", "ground.steps=4", "ground.batch_size=4",
                        "ground.num_workers=1", "ground.val_samples=3"])
    first, end = _write_pairs_by_hand(run, cfg)
    fit = FailOnceFit(finished_fit)
    monkeypatch.setattr(loop, "fit", fit)
    data, rays = fake_data(monkeypatch), no_ray(monkeypatch)
    with pytest.raises(WorkerDied):
        pipeline.run_stage(pipeline.spec("ground"), cfg, run)
    work = run / ".ground.partial"
    assert (work / "e_new_init.safetensors").is_file() and not (run / "ground").exists()
    m = pipeline.run_stage(pipeline.spec("ground"), cfg, run)

    fit.assert_same_run()
    call = fit.calls[0]
    assert (call["storage_path"], call["name"]) == (str(work / "ray_train"), "ground")
    c = call["config"]
    assert c.task == "ground" and c.ground == GroundRows(str(work / "e_new_init.safetensors"), first, end - first)
    assert (c.val.path, c.val.levels, c.val.new_start, c.val.new_end) == (str(work / "val_prompts.parquet"), LEVELS,
                                                                          first, end)
    assert len(rays) == 2 and data[0] == ("pairs", str(run / "pairs" / "pairs.parquet"), cfg.seed)
    f = m.facts
    assert set(f) == GROUND_FACTS
    assert f["grounded"] is True and f["steps_done"] == 4 and (f["train_pairs"], f["val_prompts"]) == (18, 3)
    assert f["val_exact_match"] == [{"step": 4, "value": 0.5}] and f["precision"] == "fp32"
    init = load_file(str(run / "ground" / "e_new_init.safetensors"))
    assert torch.equal(load_file(str(run / "ground" / "e_new_ground.safetensors"))["e_new"], init["e_new"] + 1.0)
