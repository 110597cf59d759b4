"""Grounding any new vocabulary (gti/vocab_ground.py) on a tiny model folder, end to end on Ray
Train + DeepSpeed: only the new rows change (old rows bit-identical under AdamW with weight
decay), the export round-trips through AutoModelForCausalLM, and the CLI entry works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from testkit import FailOnceFit, WorkerDied, fake_data, finished_fit, no_ray

TOKENS = [
    {"token": "<tool_search>", "descriptions": ["search the web for pages", "find documents online"],
     "eval_descriptions": ["look something up on the internet"]},
    {"token": "<tool_email>", "descriptions": ["send an email message", "write mail to a person"],
     "eval_descriptions": ["mail someone"]},
    {"token": "<tool_calc>", "descriptions": ["add and multiply numbers", "compute an arithmetic result"],
     "eval_descriptions": ["do the math"]},
    {"token": "<tool_weather>", "descriptions": ["current weather of a city", "rain and temperature forecast"],
     "eval_descriptions": ["will it rain tomorrow"]},
]

CONFIG = {
    "seed": 0,
    "init": {"method": "mean_noise", "noise_std": 0.5},
    "ground": {"steps": 8, "batch_size": 4, "lr": 0.05, "weight_decay": 0.1, "val_every": 4,
               "checkpoint_every": 4, "zero_stage": 2, "precision": "fp32", "num_workers": 1},
    "max_len": 64,
}


def tiny_model_folder(root: Path, tied: bool = False) -> Path:
    """A tiny random Llama + the tiny tokenizer, saved as a standard HF folder (safetensors)."""
    from gti.config import ModelConfig
    from gti.lm import models

    model, tok = models.build_tiny(ModelConfig(name="tiny", tiny_hidden=32, tiny_layers=1, tiny_heads=2,
                                               tiny_tied=tied))
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root, safe_serialization=True)
    tok.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def grounded(tmp_path_factory, ray_start_4_cpus):
    """The one `gti vocab ground` run of this file, through the CLI, serving every slow test.

    It is run the way a killed run is finished: the first command's training call dies before
    any step (a recording `fit` that raises once); the same command again completes it. The
    resume itself (same storage path and run name -> the latest checkpoint) is the shared
    loop's, proven for real in tests/train/test_loop.py; what this module owes the loop is the
    same storage path, run name, loop config and rows on the second call, and a work dir that
    survives the failure. Returns (base folder, result, stdout of the completing command,
    recorded fit calls, work-dir entries after the failed command)."""
    import contextlib
    import io

    import yaml

    import gti.train.loop as loop
    import gti.vocab_ground as vg
    from gti.cli import main

    root = tmp_path_factory.mktemp("vocab")
    base = tiny_model_folder(root / "base")
    tokens = root / "tokens.jsonl"
    tokens.write_text("".join(json.dumps(t) + "\n" for t in TOKENS))
    cfg = root / "vocab.yaml"
    cfg.write_text(yaml.safe_dump({**CONFIG, "init": {"method": "description"}}))
    out = root / "out"
    argv = ["vocab", "ground", "--model", str(base), "--tokens", str(tokens), "--out", str(out),
            "--config", str(cfg)]
    fit = FailOnceFit(loop.fit)
    results = []
    real_ground = vg.ground_vocabulary

    def recording_ground(*a, **kw):
        results.append(real_ground(*a, **kw))
        return results[-1]

    mp = pytest.MonkeyPatch()
    mp.setattr(loop, "fit", fit)
    mp.setattr(vg, "ground_vocabulary", recording_ground)
    capture = []
    try:
        with pytest.raises(WorkerDied):
            main(argv)
        work = root / ".out.work"
        after_failure = sorted(p.name for p in work.iterdir()) if work.is_dir() else []
        out_after_failure = out.exists()
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(argv)
        capture.append(buf.getvalue())
    finally:
        mp.undo()
    assert rc == 0, capture
    return base, results[-1], capture[0], fit, (after_failure, out_after_failure)


@pytest.mark.slow
@pytest.mark.ray
def test_only_new_rows_change_bit_identical_old_rows(grounded):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base_dir, res, *_ = grounded
    first, end = res.new_token_ids
    assert res.steps_done == 8 and res.val_split == "val"
    assert [v["step"] for v in res.val_exact_match] == [4, 8]
    base = AutoModelForCausalLM.from_pretrained(base_dir, use_safetensors=True)
    out = AutoModelForCausalLM.from_pretrained(res.out_dir, use_safetensors=True)
    sb, so = base.state_dict(), out.state_dict()
    assert set(sb) == set(so)
    for name, w in sb.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert so[name].shape[0] == end
            assert torch.equal(so[name][:first], w[:first]), name  # old rows bit-identical
        else:
            assert torch.equal(so[name], w), name  # backbone untouched
    init = load_file(str(res.out_dir / "e_new_init.safetensors"))
    ground = load_file(str(res.out_dir / "e_new_ground.safetensors"))
    assert set(ground) == {"e_new", "head_new"}  # untied head: its own new rows
    assert torch.equal(so["model.embed_tokens.weight"][first:end], ground["e_new"])
    assert torch.equal(so["lm_head.weight"][first:end], ground["head_new"])
    assert not torch.allclose(ground["e_new"], init["e_new"])  # the new rows did train
    assert not torch.allclose(ground["head_new"], init["head_new"])
    assert res.final_loss < res.first_loss


@pytest.mark.slow
@pytest.mark.ray
def test_export_round_trips_through_auto_classes(grounded):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, res, *_ = grounded
    tok = AutoTokenizer.from_pretrained(res.out_dir)
    model = AutoModelForCausalLM.from_pretrained(res.out_dir, use_safetensors=True)
    meta = json.loads((res.out_dir / "gti_meta.json").read_text())
    assert meta["tokens"] == res.token_ids and meta["stage"] == "vocab_ground"
    assert meta["new_token_ids"] == list(res.new_token_ids)
    for t, i in res.token_ids.items():
        assert tok.convert_tokens_to_ids(t) == i
        ids = tok(f"use {t} now", add_special_tokens=False)["input_ids"]
        assert i in ids and tok.decode([i]) == t  # one token each, decodes back
    assert len(tok) == res.new_token_ids[1] == model.config.vocab_size
    ids = torch.tensor([tok("search <tool_search>", add_special_tokens=False)["input_ids"]])
    logits = model(input_ids=ids).logits
    assert logits.shape[-1] == res.new_token_ids[1] and torch.isfinite(logits).all()


@pytest.mark.slow
@pytest.mark.ray
def test_example_script_scores_descriptions(grounded, capsys):
    """The tool-token example's evaluation script on the tiny export (figures printed; the
    tiny random backbone is not expected to beat chance, SmolLM2 is: jobs/examples/tool_tokens)."""
    import importlib.util

    root = Path(__file__).resolve().parents[1] / "jobs" / "examples" / "tool_tokens"
    spec = importlib.util.spec_from_file_location("tool_tokens_eval", root / "evaluate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _, res, *_ = grounded
    tokens = res.out_dir.parent / "tokens.jsonl"
    tokens.write_text("".join(json.dumps(t) + "\n" for t in TOKENS))
    figures = mod.main(["--model", str(res.out_dir), "--tokens", str(tokens), "--json"])
    text = capsys.readouterr().out
    assert "top-1" in text and "chance" in text
    for which in ("grounded", "init"):
        for split in ("train", "eval"):
            f = figures[which][split]
            assert f["n_tokens"] == 4 and f["chance_top1"] == 0.25
            assert f["n_prompts"] == (8 if split == "train" else 4)
            assert 0.0 <= f["top1"] <= 1.0


@pytest.mark.slow
@pytest.mark.ray
def test_cli_vocab_ground_on_a_tiny_folder(grounded, tmp_path, capsys):
    from gti.cli import main

    _, res, text, _, _ = grounded
    assert "grounded 4 tokens" in text and "exact match (held-out)" in text
    meta = json.loads((res.out_dir / "gti_meta.json").read_text())
    assert meta["steps_done"] == 8 and meta["init_method"] == "description"
    assert not (res.out_dir.parent / ".out.work").exists()  # the default work dir is removed
    # a token that already exists is one line naming it (refused before any training)
    tokens = res.out_dir.parent / "tokens.jsonl"
    rc = main(["vocab", "ground", "--model", str(res.out_dir), "--tokens", str(tokens), "--out", str(tmp_path / "o2")])
    assert rc == 2
    assert "'<tool_search>' is already in the tokenizer" in capsys.readouterr().err


def test_cli_bad_config_key_is_one_line(tmp_path, capsys):
    from gti.cli import main

    base = tiny_model_folder(tmp_path / "base")
    tokens = tmp_path / "t.jsonl"
    tokens.write_text(json.dumps(TOKENS[0]) + "\n")
    rc = main(["vocab", "ground", "--model", str(base), "--tokens", str(tokens), "--out", str(tmp_path / "o"),
               "ground.stepz=3"])
    assert rc == 2
    assert "unknown key 'ground.stepz'" in capsys.readouterr().err


def test_codebook_init_is_refused_before_training(tmp_path, capsys):
    from gti.cli import main

    base = tiny_model_folder(tmp_path / "base")
    tokens = tmp_path / "t.jsonl"
    tokens.write_text(json.dumps(TOKENS[0]) + "\n")
    rc = main(["vocab", "ground", "--model", str(base), "--tokens", str(tokens), "--out", str(tmp_path / "o"),
               "init.method=codebook"])
    assert rc == 2
    assert "init.method=codebook" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.ray
def test_killed_run_keeps_its_work_and_hands_the_loop_the_same_run(grounded):
    """A run that dies in training raises, keeps its work dir (pairs, initial rows) and writes
    no export; the same command again calls the loop with the same storage path, run name,
    loop config and rows, which is what makes the loop resume it (tests/train/test_loop.py)."""
    _, res, _, fit, (after_failure, out_after_failure) = grounded
    assert {"pairs.parquet", "e_new_init.safetensors"} <= set(after_failure), after_failure
    assert not out_after_failure
    fit.assert_same_run()
    assert res.steps_done == 8


def test_a_killed_run_is_finished_by_the_same_call_with_the_same_run_without_ray(tmp_path, monkeypatch):
    """Fast twin of the test above (no Ray: `fit` faked, testkit): the first call dies in
    training and keeps its work dir; the same call again hands the grounding runner's `fit` the
    same storage path, run name, typed worker config and rows, and exports its rows."""
    from safetensors.torch import load_file

    import gti.train.loop as loop
    import gti.vocab_ground as vg
    from gti.train.worker_config import GroundRows

    fit = FailOnceFit(finished_fit)
    monkeypatch.setattr(loop, "fit", fit)
    data, rays = fake_data(monkeypatch), no_ray(monkeypatch)
    base = tiny_model_folder(tmp_path / "base")
    cfg = vg.VocabGroundConfig.model_validate(CONFIG)
    out, work = tmp_path / "out", (tmp_path / ".out.work").resolve()
    with pytest.raises(WorkerDied):
        vg.ground_vocabulary(base, TOKENS, out, config=cfg, log=lambda m: None)
    assert (work / "pairs.parquet").is_file() and not out.exists()
    res = vg.ground_vocabulary(base, TOKENS, out, config=cfg, log=lambda m: None)

    fit.assert_same_run()
    call = fit.calls[0]
    assert (call["storage_path"], call["name"]) == (str(work / "ray_train"), "vocab_ground")
    first, end = res.new_token_ids
    c = call["config"]
    assert c.task == "ground" and c.ground == GroundRows(str(work / "e_new_init.safetensors"), first, end - first)
    assert (c.val.levels, c.val.new_start, c.val.new_end) == (1, first, end)
    assert len(rays) == 2 and data == [("pairs", str(work / "pairs.parquet"), 0)] * 2
    assert res.steps_done == 8 and res.val_split == "val" and res.n_train_pairs == 16
    assert res.first_loss == pytest.approx(2.9) and res.val_exact_match == [{"step": 8, "value": 0.5}]
    rows = {k: load_file(str(out / f"e_new_{k}.safetensors")) for k in ("init", "ground")}
    assert torch.equal(rows["ground"]["e_new"], rows["init"]["e_new"] + 1.0)
    assert not work.exists()  # the default work dir goes once the model is exported
