"""Tests of gti/stages/sft.py on fixture upstream stages (ingest sequences, a SID map, an
extended tiny tokenizer, a tiny "grounded" model), written with the names of
docs/ARCHITECTURE.md and run through gti.run.pipeline.run_stage:

- 2 Ray Train workers with DeepSpeed ZeRO-2 on CPU lower the loss, the exported folder loads
  with plain transformers and carries sid_map_hash, e_new has the new-row shape;
- a run that dies in training keeps its partial dir, and the same stage again hands the
  shared loop the same storage path, run name, loop config and rows (what makes the loop
  resume it; the loop's resume itself is proven in tests/train/test_loop.py);
- a stale SID map and impossible LoRA settings give one-line errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from testkit import FailOnceFit, WorkerDied, stage_manifest, walk_sequences

from gti import config
from gti.run import pipeline
from gti.run.contract import StageContext

N_ITEMS, SIZES, HASH = 24, [6, 4], "sidhash-test"
ROOT = Path(__file__).resolve().parents[2]


def make_upstream(run_dir, n_users: int = 48, seed: int = 0, model_hash: str = HASH):
    """Fixture ingest/sid/pairs/ground outputs. Users walk the catalog in steps of +1, so the
    next item is learnable from the history (the loss must fall)."""
    from gti.lm import models, new_rows
    from gti.sid.codec import SidCodec

    items = [f"it{i}" for i in range(N_ITEMS)]
    rows = walk_sequences(items, n_users, seed, max_train=9)
    d = stage_manifest(run_dir, "ingest", {"sequences": "sequences.parquet"}, {"n_users": n_users, "n_items": N_ITEMS})
    pl.DataFrame(rows).write_parquet(d / "sequences.parquet")

    codec = SidCodec(2, SIZES)
    codes = [[i // SIZES[1], i % SIZES[1]] for i in range(N_ITEMS)]
    facts = {"levels": 2, "codebook_sizes": SIZES, "token_format": "<{level}_{code}>",
             "new_tokens": codec.tokens(), "sid_map_hash": HASH, "n_items": N_ITEMS}
    d = stage_manifest(run_dir, "sid", {"sid_map": "sid_map.parquet"}, facts)
    pl.DataFrame(
        {"item_id": items, "codes": codes, "sid": [codec.to_string(c) for c in codes]},
        schema={"item_id": pl.Utf8, "codes": pl.List(pl.Int32), "sid": pl.Utf8},
    ).write_parquet(d / "sid_map.parquet")

    mcfg = config.ModelConfig(name="tiny")
    model, tok = models.build_tiny(mcfg, seed=seed)
    first, end = new_rows.extend_tokenizer(tok, codec.tokens())
    d = stage_manifest(run_dir, "pairs", {"tokenizer": "tokenizer", "pairs": "pairs.parquet"},
                  {"new_token_ids": [first, end], "sid_map_hash": HASH})
    tok.save_pretrained(d / "tokenizer")
    # A few grounding-style pairs (title ids -> SID ids) for the multitask mix.
    sid_ids = codec.token_ids(torch.tensor(codes), tok).tolist()
    prs = []
    for i, it in enumerate(items):
        prompt = tok.encode(f"Which item has the title: thing {i}?")
        ans = sid_ids[i] + [tok.eos_token_id]
        prs.append({"item_id": it, "task": "title2sid", "split": "train" if i % 6 else "val",
                    "input_ids": prompt + ans, "labels": [-100] * len(prompt) + ans,
                    "prompt_ids": prompt, "answer_ids": ans})
    lists = {c: pl.List(pl.Int32) for c in ("input_ids", "labels", "prompt_ids", "answer_ids")}
    pl.DataFrame(prs, schema_overrides=lists).write_parquet(d / "pairs.parquet")

    model.resize_token_embeddings(end, mean_resizing=False)
    with torch.no_grad():  # noise-initialised new rows, as after grounding
        g = torch.Generator().manual_seed(seed)
        model.get_input_embeddings().weight[first:end] = 0.02 * torch.randn(end - first, model.config.hidden_size, generator=g)
    d = stage_manifest(run_dir, "ground", {"model": "model"}, {"sid_map_hash": HASH, "new_token_ids": [first, end]})
    new_rows.export_model(model, tok, d / "model", {"sid_map_hash": model_hash, "new_token_ids": [first, end]})
    return first, end


def sft_cfg(run_dir, *overrides):
    return config.load(
        ROOT / "jobs" / "configs" / "tiny.yaml",
        [f"run_dir={run_dir}", "sft.steps=8", "sft.batch_size=8", "sft.num_workers=2",
         "sft.checkpoint_every=4", "sft.val_every=4", "sft.val_users=8", "sft.lr=3e-3",
         "sft.warmup_steps=1", "sft.zero_stage=2", "sft.max_len=160", "eval.beam_width=10", "eval.ks=[5,10]",
         "sft.val_mrr=true", *overrides],
    )


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, ray_start_4_cpus):
    """The stage, run the way a killed run is finished: the first attempt's training call dies
    before any step (`FailOnceFit`), `run_stage` again completes it in the same partial dir.
    Returns (run_dir, cfg, manifest, new-token range, the recorded fit, partial-dir entries
    after the failure)."""
    from gti.train import loop

    run_dir = tmp_path_factory.mktemp("sft") / "run"
    first, end = make_upstream(run_dir)
    cfg = sft_cfg(run_dir)
    fit = FailOnceFit(loop.fit)
    mp = pytest.MonkeyPatch()
    mp.setattr(loop, "fit", fit)
    try:
        with pytest.raises(WorkerDied):
            pipeline.run_stage(pipeline.spec("sft"), cfg, run_dir)
        kept = sorted(p.name for p in (run_dir / ".sft.partial").iterdir())
        m = pipeline.run_stage(pipeline.spec("sft"), cfg, run_dir)
    finally:
        mp.undo()
    return run_dir, cfg, m, (first, end), fit, kept


@pytest.mark.slow
@pytest.mark.ray
def test_sft_two_workers_deepspeed_lowers_loss_and_exports(sft_run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, cfg, m, (first, end), _, _ = sft_run
    f = m.facts
    assert f["steps_done"] == 8 and f["num_workers"] == 2 and f["zero_stage"] == 2
    first_losses = [x["value"] for x in f["loss_history"][:2]]
    last_losses = [x["value"] for x in f["loss_history"][-2:]]
    assert np.mean(last_losses) < 0.8 * np.mean(first_losses), f["loss_history"]
    assert [v["step"] for v in f["val_recall@10"]] == [4, 8]
    assert all(0.0 <= v["value"] <= 1.0 for v in f["val_recall@10"])
    from gti.common.devices import resolve_precision

    # precision: auto resolved in the worker and recorded; where the time went, too.
    assert f["precision_setting"] == "auto" and f["precision"] == resolve_precision("auto")
    assert f["timing"]["compute_s"] > 0 and f["timing"]["loop_s"] >= f["timing"]["compute_s"]
    curves = f["val_history"]
    assert sorted(curves) == ["val_loss", "val_mrr", "val_recall@10"]
    assert [v["step"] for v in curves["val_loss"]] == [4, 8] == [v["step"] for v in curves["val_mrr"]]
    assert all(v["value"] > 0 for v in curves["val_loss"])
    assert all(0.0 < v["value"] <= 1.0 for v in curves["val_mrr"])
    assert f["sid_map_hash"] == HASH and f["new_token_ids"] == [first, end]
    # All parameters trained: tied tiny model -> every parameter once.
    model = AutoModelForCausalLM.from_pretrained(run_dir / "sft" / "model", use_safetensors=True)
    assert f["trainable_params"] == sum(p.numel() for p in model.parameters())
    AutoTokenizer.from_pretrained(run_dir / "sft" / "model")
    meta = json.loads((run_dir / "sft" / "model" / "gti_meta.json").read_text())
    assert meta["sid_map_hash"] == HASH
    e_new = load_file(str(run_dir / "sft" / "e_new_sft.safetensors"))["e_new"]
    assert e_new.shape == (end - first, model.config.hidden_size)
    assert torch.equal(e_new, model.get_input_embeddings().weight[first:end].detach().float())
    # ... and moved away from the grounded rows.
    ground = AutoModelForCausalLM.from_pretrained(run_dir / "ground" / "model", use_safetensors=True)
    assert not torch.allclose(e_new, ground.get_input_embeddings().weight[first:end])
    assert f["n_train_rows"] == f["n_windows"] == f["tasks"]["seqrec"]
    # `tensorboard --logdir <run_dir>`: the SFT curves, one point per step although the first
    # attempt died (the two-node job test checked these until its SFT stopped training).
    from gti.common.tracking import read_scalars

    tb = read_scalars(run_dir / "tensorboard" / "sft")
    assert [s for s, _ in tb["train/loss"]] == list(range(1, 9)), tb["train/loss"]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "val/loss", "val/recall_at_10"} <= set(tb), sorted(tb)


@pytest.mark.slow
@pytest.mark.ray
def test_killed_sft_keeps_its_partial_dir_and_hands_the_loop_the_same_run(sft_run):
    """The first attempt died in training: its partial dir (prepared data) was kept, and the
    second attempt called the loop with the same storage path, run name, loop config and rows
    (the loop then resumes from its latest checkpoint: tests/train/test_loop.py), and finished."""
    run_dir, _, m, _, fit, kept = sft_run
    assert "data" in kept, kept  # the prepared windows (sft.DATA_DIR) survive the failure
    fit.assert_same_run()
    assert str(run_dir / ".sft.partial") in fit.calls[0]["storage_path"]
    assert m.facts["steps_done"] == 8 and not (run_dir / ".sft.partial").exists()


@pytest.mark.slow
@pytest.mark.ray
def test_data_preparation_multitask_mix_and_validation_users(tmp_path, ray_start_4_cpus, monkeypatch):
    """The stage's Ray Data preparation: every training window rendered once, grounding pairs
    (train split only) mixed in at sft.multitask_weight, validation prompts for sft.val_users
    users with the trie row of their valid item as target; reused on a rerun. A catalog of at
    most local_max_items items renders in this process, to the same rows, without Ray Data."""
    import polars as pl
    from transformers import AutoTokenizer

    from gti.sid.codec import SidCodec
    from gti.stages import sft
    from gti.lm import templates

    run_dir = tmp_path / "run"
    make_upstream(run_dir, n_users=20)
    # local_max_items=0: the windows rendered on Ray Data's actor pool, as for a large catalog.
    cfg = sft_cfg(run_dir, "sft.multitask=true", "sft.multitask_weight=0.25", "sft.val_users=5", "local_max_items=0")
    s = pipeline.spec("sft")
    work = run_dir / ".sft.partial"
    work.mkdir(parents=True)
    ctx = StageContext(spec=s, cfg=cfg, run_dir=run_dir, work_dir=work, fingerprint="x")
    tok = AutoTokenizer.from_pretrained(run_dir / "pairs" / "tokenizer")
    sid_map = pl.read_parquet(run_dir / "sid" / "sid_map.parquet")
    sid_ids = templates.sid_id_table(sid_map, SidCodec(2, SIZES), tok)
    stats = sft._prepare_data(ctx, tok, sid_ids, {"item_ids": sid_map["item_id"].to_list()})
    seqs = pl.read_parquet(run_dir / "ingest" / "sequences.parquet")
    n_windows = sum(len(t) - 1 for t in seqs["train_items"])
    assert stats["n_windows"] == n_windows == stats["tasks"]["seqrec"]
    assert stats["multitask"]["pairs_used"] == round(0.25 * n_windows) == stats["tasks"]["title2sid"]
    rows = pl.read_parquet(work / "data" / "sft_train.parquet")
    assert rows.height == stats["n_train_rows"] == n_windows + round(0.25 * n_windows)
    pairs = pl.read_parquet(run_dir / "pairs" / "pairs.parquet")
    val_pair_ids = set(map(tuple, pairs.filter(pl.col("split") == "val")["input_ids"].to_list()))
    used = rows.filter(pl.col("task") == "title2sid")["input_ids"].to_list()
    assert not val_pair_ids & set(map(tuple, used))
    val = pl.read_parquet(work / "data" / "val.parquet")
    assert val.height == 5
    valid_of = dict(zip(seqs["user_id"], seqs["valid_item"]))
    items = sid_map["item_id"].to_list()
    assert [items[r] for r in val["target_row"]] == [valid_of[u] for u in val["user_id"]]
    assert sft._prepare_data(ctx, tok, sid_ids, {"item_ids": items}) == stats  # reused

    import ray

    local = run_dir / ".sft.local"
    local.mkdir()
    ctx = StageContext(spec=s, cfg=cfg.model_copy(update={"local_max_items": 20_000}), run_dir=run_dir,
                       work_dir=local, fingerprint="x")
    monkeypatch.setattr(ray.data, "from_arrow", lambda *a, **k: pytest.fail("the local path used Ray Data"))
    assert sft._prepare_data(ctx, tok, sid_ids, {"item_ids": items}) == stats
    assert pl.read_parquet(local / "data" / "sft_train.parquet").equals(rows)


def test_stale_sid_map_is_refused(tmp_path):
    """A grounded model whose gti_meta.json names another SID map is refused before any work
    (only the manifests and the meta file are needed to get there)."""
    from gti.sid.versions import UnrelatedSidMapError

    run_dir = tmp_path / "run"
    stage_manifest(run_dir, "ingest", {"sequences": "sequences.parquet"}, {})
    stage_manifest(run_dir, "sid", {"sid_map": "sid_map.parquet"}, {"sid_map_hash": HASH})
    stage_manifest(run_dir, "pairs", {"tokenizer": "tokenizer", "pairs": "pairs.parquet"}, {"new_token_ids": [0, 1]})
    d = stage_manifest(run_dir, "ground", {"model": "model"}, {})
    (d / "model").mkdir()
    (d / "model" / "gti_meta.json").write_text(json.dumps({"sid_map_hash": "some-other-map"}))
    with pytest.raises(UnrelatedSidMapError, match="stale SID map"):
        pipeline.run_stage(pipeline.spec("sft"), sft_cfg(run_dir), run_dir)


@pytest.mark.slow
def test_sft_disabled_exports_the_grounded_model_unchanged(tmp_path):
    """sft.enabled=false (an ablation arm): no training, no Ray; model/ and e_new_sft equal
    the grounded model's, and the facts say 0 steps."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    first, end = make_upstream(run_dir, n_users=6)
    m = pipeline.run_stage(pipeline.spec("sft"), sft_cfg(run_dir, "sft.enabled=false"), run_dir)
    assert m.facts["steps_done"] == 0 and m.facts["trainable_params"] == 0
    ground = AutoModelForCausalLM.from_pretrained(run_dir / "ground" / "model", use_safetensors=True)
    out = AutoModelForCausalLM.from_pretrained(run_dir / "sft" / "model", use_safetensors=True)
    for (n, a), (_, b) in zip(ground.state_dict().items(), out.state_dict().items()):
        assert torch.equal(a, b), n
    e_new = load_file(str(run_dir / "sft" / "e_new_sft.safetensors"))["e_new"]
    assert torch.equal(e_new, ground.get_input_embeddings().weight[first:end])
    assert json.loads((run_dir / "sft" / "model" / "gti_meta.json").read_text())["sid_map_hash"] == HASH


@pytest.mark.slow
def test_lora_wrap_trains_adapters_and_embeddings_and_merges_back(tmp_path):
    """LoRA: adapters on the backbone's linear layers, the embedding (tied head) fully
    trainable, the base linear weights frozen. Export path: loading the trained tensors into a
    fresh wrap and merging gives a plain HF model with the same logits as the trained wrap."""
    from gti.lm import models, new_rows
    from gti.train import sft_task as sft

    base, tok = models.build_tiny(config.ModelConfig(name="tiny"), seed=0)
    new_rows.export_model(base, tok, tmp_path / "ground", {"sid_map_hash": HASH})
    cfg = config.RunConfig(model={"name": "tiny"}, sft={"lora": {"enabled": True, "r": 4, "alpha": 8}})
    model = sft.wrap_lora(sft.load_causal_lm(tmp_path / "ground", cfg), cfg.sft.lora)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any("embed_tokens" in n for n in trainable)
    assert not any("base_layer" in n for n in trainable)
    assert sum(p.numel() for p in trainable.values()) < sum(p.numel() for p in model.parameters())
    # "Train": move every trainable tensor, then export the way the stage does.
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainable.values():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    state = {n: p.detach().clone() for n, p in trainable.items()}
    merged = sft.rebuild_trained(tmp_path / "ground", cfg, state)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    model.eval(), merged.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(merged(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-3)


def test_validation_loss_and_mrr_match_direct_computation(tmp_path):
    """`val_loss` is the per-token loss of the target SIDs given the prompts (as the HF forward
    computes it) and `val_mrr` the mean 1/rank of the target among all catalog SIDs (brute-force
    scoring); rows not counted (rank padding) are left out of both."""
    from safetensors.torch import save_file

    from gti.eval.decode import score_all_sids
    from gti.lm import models, new_rows
    from gti.sid.codec import SidCodec
    from gti.train.sft_task import _val_loss_and_mrr
    from gti.train.worker_config import ValSet

    model, tok = models.build_tiny(config.ModelConfig(name="tiny"), seed=0)
    codec = SidCodec(2, [4, 4])
    first, end = new_rows.extend_tokenizer(tok, codec.tokens())
    model.resize_token_embeddings(end, mean_resizing=False)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        model.get_input_embeddings().weight[first:end] = torch.randn(end - first, model.config.hidden_size, generator=g)
    model.eval()
    codes = torch.tensor([[i // 4, i % 4] for i in range(12)])
    sids = codec.token_ids_from_offset(codes, first)
    save_file({"sid_token_ids": sids.contiguous()}, str(tmp_path / "sids.safetensors"))
    prompts = [tok.encode("beaker flask"), tok.encode("glass"), tok.encode("tape label battery")]
    targets = torch.tensor([3, 7, 10])
    counted = torch.tensor([True, True, False])
    v = ValSet(path="unused", sids_path=str(tmp_path / "sids.safetensors"), new_start=first, new_end=end, levels=2,
               batch_users=2, mrr=True)
    with torch.no_grad():
        out = _val_loss_and_mrr(model, prompts, targets, counted, v, tok.pad_token_id)
        total, n = 0.0, 0
        mrr = 0.0
        for p, t in zip(prompts[:2], targets[:2].tolist()):
            ids = torch.tensor([p + sids[t].tolist()])
            labels = torch.tensor([[-100] * len(p) + sids[t].tolist()])
            total += float(model(input_ids=ids, labels=labels).loss) * 2
            n += 2
            scores = score_all_sids(model, p, sids)
            mrr += 1.0 / (1 + int((scores > scores[t]).sum()))
    assert out["val_loss"][1] == n
    assert out["val_loss"][0] / n == pytest.approx(total / n, rel=1e-5)
    assert out["val_mrr"][1] == 2
    assert out["val_mrr"][0] == pytest.approx(mrr, rel=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sft_model_is_loaded_in_model_dtype(tmp_path, dtype):
    """model.dtype is honoured by the SFT worker's model (it used to load fp32 whatever it said)."""
    from gti.lm import models, new_rows
    from gti.train.sft_task import build_sft_model
    from gti.train.worker_config import SftStart, WorkerConfig

    model, tok = models.build_tiny(config.ModelConfig(name="tiny"), seed=0)
    new_rows.export_model(model, tok, tmp_path / "m", {"sid_map_hash": HASH})
    cfg = config.load(ROOT / "jobs" / "configs" / "tiny.yaml", [f"model.dtype={dtype}"])
    built = build_sft_model(WorkerConfig.build("sft", cfg, 0, sft=SftStart(str(tmp_path / "m"))), cfg)
    want = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    assert {p.dtype for p in built.parameters()} == {want}
    assert all(p.requires_grad for p in built.parameters())


SFT_FACTS = {"steps_done", "final_loss", "first_loss", "loss_history", "val_recall@10", "val_history", "sid_map_hash",
             "new_token_ids", "trainable_params", "lora", "zero_stage", "precision", "precision_setting", "timing",
             "prompt_style", "num_workers", "n_windows", "n_train_rows", "truncated_examples", "tasks", "multitask",
             "val_users", "mean_tokens", "objective", "render_style", "n_targets", "steps_resolved", "epochs"}


def test_a_killed_sft_is_finished_in_its_partial_dir_with_the_same_run_without_ray(tmp_path, monkeypatch):
    """Fast twin of the test above (no Ray: `fit` faked, the windows rendered in-process by
    the stage's own `RenderWindows`, testkit): the SFT runner's `fit` gets the same storage
    path, run name, typed worker config and rows on the second attempt, and the stage records
    the runner's facts with the same keys as ever."""
    from safetensors.torch import load_file
    from testkit import fake_data, finished_fit, no_ray

    from gti.stages import sft
    from gti.train import loop
    from gti.train.worker_config import SftStart

    def render_here(ctx, windows, sid_ids):  # what the RenderWindows actors do, in this process
        items = list(sid_ids)
        r = sft.RenderWindows(str(ctx.input("pairs", "tokenizer")), items, np.stack([sid_ids[i] for i in items]),
                              ctx.cfg.pairs.system_prompt, ctx.cfg.sft.max_len, False, ctx.cfg.sft.prompt_style)
        out = pl.from_arrow(r(windows.select("history", "target", "template").to_arrow()))
        return out, int((out["history_kept"] < out["history_len"]).sum())

    run_dir = tmp_path / "run"
    first, end = make_upstream(run_dir, n_users=12)
    cfg = sft_cfg(run_dir, "sft.num_workers=1", "sft.steps=3")
    fit = FailOnceFit(finished_fit)
    monkeypatch.setattr(loop, "fit", fit)
    monkeypatch.setattr(sft, "_render_windows", render_here)
    data, rays = fake_data(monkeypatch), no_ray(monkeypatch)
    with pytest.raises(WorkerDied):
        pipeline.run_stage(pipeline.spec("sft"), cfg, run_dir)
    work = run_dir / ".sft.partial"
    assert (work / "data" / "sft_train.parquet").is_file()
    m = pipeline.run_stage(pipeline.spec("sft"), cfg, run_dir)

    fit.assert_same_run()
    call = fit.calls[0]
    assert (call["storage_path"], call["name"]) == (str((work / "ray_train").resolve()), "sft")
    c = call["config"]
    assert c.task == "sft" and c.sft == SftStart(str(run_dir / "ground" / "model"))
    assert (c.val.k, c.val.beam_width, c.val.mrr, c.val.levels, c.val.new_start, c.val.new_end) == (10, 10, True, 2,
                                                                                                     first, end)
    train_file = str((work / "data" / "sft_train.parquet").resolve())
    assert data == [("parquet", train_file, ["input_ids", "labels"], True)] * 2
    assert len(rays) == 4  # per attempt: the stage's own start (Ray Data renders) and the runner's
    f = m.facts
    assert set(f) == SFT_FACTS
    assert f["steps_done"] == 3 and f["first_loss"] == pytest.approx(2.9) and f["precision"] == "fp32"
    assert f["val_recall@10"] == [{"step": 3, "value": 0.5}] and f["trainable_params"] > 0
    from transformers import AutoModelForCausalLM

    ground = AutoModelForCausalLM.from_pretrained(run_dir / "ground" / "model", use_safetensors=True)
    e_new = load_file(str(run_dir / "sft" / "e_new_sft.safetensors"))["e_new"]
    torch.testing.assert_close(e_new, ground.get_input_embeddings().weight[first:end].detach() + 0.01)


def test_the_sequence_objective_trains_every_item_in_epochs_without_ray(tmp_path, monkeypatch):
    """`sft.objective: sequence` through the stage (no Ray: `fit` faked, rows rendered in this
    process by the stage's own code): one row per chunk of training items, labels on every
    item after the first and on nothing else, no valid or test item in any row, the epoch
    budget resolved into the steps the loop gets, and the exported model marked as trained on
    sequence prompts."""
    import json
    import math

    from testkit import fake_data, finished_fit, no_ray

    from gti.lm.new_rows import META_NAME
    from gti.stages import sft
    from gti.train import loop

    run_dir = tmp_path / "run"
    make_upstream(run_dir, n_users=12)
    cfg = sft_cfg(run_dir, "sft.num_workers=1", "sft.objective=sequence", "sft.epochs=2", "sft.batch_size=4",
                  "data.max_history=3")
    calls = []

    def fit(config, train_ds, train_cfg, **kw):
        calls.append(int(train_cfg.steps))
        return finished_fit(config, train_ds, train_cfg, **kw)

    monkeypatch.setattr(loop, "fit", fit)
    fake_data(monkeypatch), no_ray(monkeypatch)
    m = pipeline.run_stage(pipeline.spec("sft"), cfg, run_dir)
    f = m.facts
    seqs = pl.read_parquet(run_dir / "ingest" / "sequences.parquet")
    n_targets = sum(max(len(t) - 1, 0) for t in seqs["train_items"])
    assert f["objective"] == "sequence" and f["render_style"] == "sequence"
    assert f["n_targets"] == n_targets and f["n_train_rows"] < n_targets
    assert f["steps_resolved"] == calls[0] == math.ceil(2 * f["n_train_rows"] / 4) and f["epochs"] == 2
    rows = pl.read_parquet(run_dir / "sft" / "data" / "sft_train.parquet") if (run_dir / "sft" / "data").is_dir() \
        else pl.read_parquet(next(run_dir.rglob("sft_train.parquet")))
    sid = pl.read_parquet(run_dir / "sid" / "sid_map.parquet")
    levels = len(sid["codes"][0])
    labelled = 0
    for ids, labels in zip(rows["input_ids"], rows["labels"]):
        assert len(ids) % levels == 0 and 2 * levels <= len(ids) <= 4 * levels  # 2..max_history + 1 items
        assert list(labels[:levels]) == [-100] * levels and list(labels[levels:]) == list(ids[levels:])
        labelled += len(ids) // levels - 1
    assert labelled == n_targets  # every training target once per epoch
    assert json.loads((run_dir / "sft" / "model" / META_NAME).read_text())["render_style"] == "sequence"
