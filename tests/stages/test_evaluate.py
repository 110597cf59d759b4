"""Tests of gti/stages/evaluate.py on fixture upstream stages (ingest sequences, a SID map, a
tiny "SFT" model folder with the SID tokens), written with the names of docs/ARCHITECTURE.md:

- the stage through gti.run.pipeline.run_stage on a local Ray: metrics.json layout, CIs around the
  values, per-user values consistent with recs.parquet, baselines on the same users, invalid-SID
  rate 0 when constrained, the same deterministic user sample for both splits, the cold-item
  slice (users whose target is a rare SFT target) and, with eval.exact_rank, the exact-rank
  metrics (MRR, mean percentile rank);
- the decoding actor in-process: constrained output is valid and distinct, unconstrained
  decoding of a random model reports invalid SIDs;
- a model trained on another SID map is refused with a one-line error;
- an evaluate stage interrupted after some chunks of users resumes from them, with the metrics
  of an uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
import torch

from testkit import stage_manifest

from gti import config
from gti.run import pipeline
from gti.run.contract import StageContext
from gti.run.manifest import Manifest

N_ITEMS, SIZES, HASH = 30, [6, 5], "sidhash-eval"
ROOT = Path(__file__).resolve().parents[2]


def make_upstream(run_dir, n_users: int = 40, seed: int = 0):
    """ingest + sid + sft outputs; the model is a random tiny Llama with noise SID rows."""
    from gti.lm import models, new_rows
    from gti.sid.codec import SidCodec

    rng = np.random.default_rng(seed)
    items = [f"it{i}" for i in range(N_ITEMS)]
    rows = []
    for u in range(n_users):
        seq = [items[int(j)] for j in rng.integers(0, N_ITEMS, int(rng.integers(3, 8)) + 2)]
        rows.append({"user_id": f"u{u}", "train_items": seq[:-2], "valid_item": seq[-2], "test_item": seq[-1]})
    d = stage_manifest(run_dir, "ingest", {"sequences": "sequences.parquet"}, {"n_users": n_users})
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

    model, tok = models.build_tiny(config.ModelConfig(name="tiny"), seed=seed)
    first, end = new_rows.extend_tokenizer(tok, codec.tokens())
    model.resize_token_embeddings(end, mean_resizing=False)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        model.get_input_embeddings().weight[first:end] = torch.randn(end - first, model.config.hidden_size, generator=g)
    d = stage_manifest(run_dir, "sft", {"model": "model"}, {"sid_map_hash": HASH})
    new_rows.export_model(model, tok, d / "model", {"sid_map_hash": HASH})
    stage_manifest(run_dir, "rl", {}, {"enabled": False})  # rl off: the SFT model is evaluated
    return items


def eval_cfg(run_dir, *overrides):
    return config.load(
        ROOT / "jobs" / "configs" / "tiny.yaml",
        [f"run_dir={run_dir}", "eval.max_users=12", "eval.beam_width=6", "eval.ks=[1,5]",
         "eval.bootstrap=50", "eval.batch_users=5", "sft.max_len=160",
         "eval.baselines=[mostpop,markov,sasrec]", "eval.sasrec.epochs=2", "eval.sasrec.sweep.enabled=false",
         *overrides],
    )


# The one full evaluate run of this file serves the default checks and the exact-rank ones:
# exact ranks on, and a generous cold threshold so that both splits have cold users to rank.
EVAL_RUN = ("eval.exact_rank=true", "eval.cold_max_sft_targets=8")


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory, ray_start_4_cpus):
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    items = make_upstream(run_dir)
    # local_max_items=0: decoded by the Ray Data actor pool, as a large catalog would be; the
    # resume test below decodes in this process (a small catalog) and must get the same files.
    cfg = eval_cfg(run_dir, *EVAL_RUN, "local_max_items=0")
    m = pipeline.run_stage(pipeline.spec("evaluate"), cfg, run_dir)
    return run_dir, cfg, m, items


@pytest.mark.slow
@pytest.mark.ray
def test_evaluate_writes_metrics_recs_and_baselines(eval_run):
    run_dir, cfg, m, items = eval_run
    out = run_dir / "evaluate"
    metrics = json.loads((out / "metrics.json").read_text())
    names = [f"{n}@{k}" for n in ("hr", "recall", "ndcg", "precision") for k in (1, 5)]
    assert set(metrics["splits"]) == {"valid", "test"}
    assert metrics["n_users"] == {"valid": 12, "test": 12}
    assert metrics["invalid_sid_rate"] == 0.0
    assert {"read_s", "decode_s", "reference_s", "metrics_s", "write_s", "total_s"} <= set(m.facts["timing"])
    for split in ("valid", "test"):
        table = metrics["splits"][split]
        assert sorted(table) == sorted(names)
        for cell in table.values():
            lo, hi = cell["ci"]
            assert lo <= cell["value"] <= hi
        for base in ("mostpop", "markov", "sasrec"):  # the reference rows, SASRec included
            assert sorted(metrics["baselines"][base][split]) == sorted(names)
        per = metrics["per_user"][split]
        assert len(per["user_ids"]) == 12
        assert np.mean(per["recall@5"]) == pytest.approx(table["recall@5"]["value"])
    # The same deterministic user sample in both splits.
    assert metrics["per_user"]["valid"]["user_ids"] == metrics["per_user"]["test"]["user_ids"]
    # Paired differences model - row for every reference row; the SASRec row's label and settings.
    assert set(metrics["paired"]["test"]) == {"mostpop", "markov", "sasrec"} and m.facts["paired"] == metrics["paired"]
    assert metrics["reference"]["sasrec"]["label"] == "SASRec" and m.facts["sasrec"]["max_len"] == 5

    recs = pl.read_parquet(out / "recs.parquet")
    assert recs.columns == ["user_id", "split", "target", "items", "scores"]
    assert recs.height == 24
    seqs = pl.read_parquet(run_dir / "ingest" / "sequences.parquet")
    truth = {("valid", u): v for u, v in zip(seqs["user_id"], seqs["valid_item"])}
    truth |= {("test", u): t for u, t in zip(seqs["user_id"], seqs["test_item"])}
    for user, split, target, lst, scores in recs.iter_rows():
        assert target == truth[(split, user)]
        assert len(lst) == 5 and len(set(lst)) == 5 and set(lst) <= set(items)
        assert scores == sorted(scores, reverse=True)
    # recall@5 per user == target among the recommended items
    for split in ("valid", "test"):
        part = recs.filter(pl.col("split") == split)
        hits = [float(t in lst) for t, lst in zip(part["target"], part["items"])]
        assert hits == metrics["per_user"][split]["recall@5"]
    assert m.facts["invalid_sid_rate"] == 0.0 and m.facts["sid_map_hash"] == HASH
    assert m.facts["slices"] == metrics["slices"]
    # Exact ranks are off by default (this run turns them on: the test below). The stage's
    # metrics of the same decoded rows with the default carry no ranks and equal top-K figures.
    from gti.stages import evaluate as E

    cfg_off = eval_cfg(run_dir, "eval.baselines=[mostpop,markov]")  # the decoded rows carry no SASRec lists
    assert cfg_off.eval.exact_rank is False
    ctx = StageContext(spec=pipeline.spec("evaluate"), cfg=cfg_off, run_dir=run_dir,
                       work_dir=run_dir / "evaluate", fingerprint="t")
    decoded = recs.with_columns(pl.lit(5).alias("n_returned"), pl.lit(0).alias("n_invalid"))
    off = E._metrics(ctx, E._read_inputs(ctx), decoded)
    assert off["ranks"] == {} and "exact_rank" not in off["per_user"]["valid"]
    assert off["splits"] == metrics["splits"] and off["baselines"]["markov"] == metrics["baselines"]["markov"]
    assert all(off["slices"]["cold"][s]["ranks"] == {} for s in ("valid", "test"))


def _check_cold_slice(metrics, seqs, max_targets, names, exact_rank=False):
    """slices.cold: definition from SFT windows only, per split the cold users' blocks."""
    from gti.train import sft_data

    cold = metrics["slices"]["cold"]
    counts = sft_data.training_windows(seqs, 5)["target"].value_counts()
    counts = dict(zip(counts["target"].to_list(), counts["count"].to_list()))
    assert cold["definition"]["max_sft_targets"] == max_targets
    assert cold["definition"]["n_cold_items"] == sum(counts.get(f"it{i}", 0) <= max_targets for i in range(N_ITEMS))
    truth = {"valid": dict(zip(seqs["user_id"], seqs["valid_item"])),
             "test": dict(zip(seqs["user_id"], seqs["test_item"]))}
    for split in ("valid", "test"):
        block = cold[split]
        users = metrics["per_user"][split]["user_ids"]
        is_cold = [counts.get(truth[split][u], 0) <= max_targets for u in users]
        assert block["n_users"] == sum(is_cold)
        if not block["n_users"]:
            assert block["model"] == {} and block["ranks"] == {}
            continue
        assert sorted(block["model"]) == sorted(names)
        hits = [h for h, c in zip(metrics["per_user"][split]["recall@5"], is_cold) if c]
        assert block["model"]["recall@5"]["value"] == pytest.approx(np.mean(hits))
        for base in ("mostpop", "markov"):
            assert sorted(block["baselines"][base]) == sorted(names)
        if exact_rank:
            ranks = [r for r, c in zip(metrics["per_user"][split]["exact_rank"], is_cold) if c]
            assert block["ranks"]["n_users"] == len(ranks)
            assert block["ranks"]["mrr"]["value"] == pytest.approx(np.mean(1.0 / np.array(ranks)))
        else:
            assert block["ranks"] == {}


@pytest.mark.slow
@pytest.mark.ray
def test_evaluate_exact_ranks_and_cold_slice(eval_run):
    run_dir, cfg, m, _ = eval_run
    metrics = json.loads((run_dir / "evaluate" / "metrics.json").read_text())
    names = [f"{n}@{k}" for n in ("hr", "recall", "ndcg", "precision") for k in (1, 5)]
    assert metrics["config"]["exact_rank"] is True
    for split in ("valid", "test"):
        r = metrics["ranks"][split]
        assert r["n_users"] == 12 and r["n_items"] == N_ITEMS
        assert 0 < r["mrr"]["value"] <= 1
        assert 0 <= r["mean_percentile_rank"]["value"] <= 1
        for key in ("mrr", "mean_percentile_rank"):
            lo, hi = r[key]["ci"]
            assert lo <= r[key]["value"] <= hi
        ranks = np.array(metrics["per_user"][split]["exact_rank"])
        assert ranks.shape == (12,) and ((ranks >= 1) & (ranks <= N_ITEMS)).all()
        assert r["mrr"]["value"] == pytest.approx(np.mean(1.0 / ranks))
        assert r["median_rank"] == pytest.approx(float(np.median(ranks)))
    seqs = pl.read_parquet(run_dir / "ingest" / "sequences.parquet")
    _check_cold_slice(metrics, seqs, 8, names, exact_rank=True)
    assert any(metrics["slices"]["cold"][s]["n_users"] for s in ("valid", "test"))
    assert m.facts["ranks"] == metrics["ranks"]


@pytest.mark.slow
@pytest.mark.ray
def test_interrupted_evaluate_resumes_with_the_same_metrics(eval_run, tmp_path, monkeypatch):
    """The driver dies after 2 chunks of 5 prompts (of 24); the rerun decodes only the rest and
    its metrics.json and recs.parquet equal the uninterrupted run's (eval_run: same upstream,
    same config, one big chunk). This run decodes in this process (a catalog under
    local_max_items), eval_run on Ray Data's actor pool: the same top-K either way."""
    from gti.stages import evaluate as E

    base_dir, cfg0, _, _ = eval_run
    run_dir = tmp_path / "run"
    make_upstream(run_dir)
    cfg = eval_cfg(run_dir, *EVAL_RUN)

    class DriverKilled(Exception):
        pass

    written: list[int] = []

    def kill_after_two(i):
        written.append(i)
        if i == 1:
            raise DriverKilled

    import ray

    # This run must decode in the driver: Ray Data is never asked.
    monkeypatch.setattr(ray.data, "from_arrow", lambda *a, **k: pytest.fail("the local path used Ray Data"))
    monkeypatch.setattr(E, "CHUNK_ROWS", 5)  # eval.batch_users=5: one batch per chunk
    monkeypatch.setattr(E, "EXACT_RANK_CHUNK_ROWS", 5)  # (this run ranks exactly too)
    monkeypatch.setattr(E, "_on_chunk", kill_after_two)
    with pytest.raises(DriverKilled):
        pipeline.run_stage(pipeline.spec("evaluate"), cfg, run_dir)
    partial = run_dir / ".evaluate.partial"
    assert not (run_dir / "evaluate").exists()
    assert sorted(p.name for p in (partial / E.DECODED_DIR).glob("chunk-*")) == [
        "chunk-000000.parquet", "chunk-000001.parquet"]
    written.clear()
    monkeypatch.setattr(E, "_on_chunk", written.append)
    m = pipeline.run_stage(pipeline.spec("evaluate"), cfg, run_dir)
    assert written == [2, 3, 4]  # prompts 10..23 only
    assert m.facts["resumed_prompts"] == 10
    assert not (run_dir / "evaluate" / E.DECODED_DIR).exists()
    got = json.loads((run_dir / "evaluate" / "metrics.json").read_text())
    want = json.loads((base_dir / "evaluate" / "metrics.json").read_text())
    # SASRec's wall times (reference.sasrec: train/score seconds, per sweep candidate too) are the
    # one thing two runs may not share; everything else must be equal.
    assert _without_seconds(got) == _without_seconds(want)
    assert set(got["reference"]["sasrec"]) == set(want["reference"]["sasrec"])
    assert pl.read_parquet(run_dir / "evaluate" / "recs.parquet").equals(
        pl.read_parquet(base_dir / "evaluate" / "recs.parquet"))


def _actor(run_dir, cfg):
    from gti.stages.evaluate import Recommender

    return Recommender(
        model_dir=str(run_dir / "sft" / "model"), sid_map_path=str(run_dir / "sid" / "sid_map.parquet"),
        sid_facts=Manifest.read(run_dir / "sid").facts, run_config=cfg.model_dump(mode="json"),
    )


@pytest.mark.slow
def test_decoding_actor_constrained_vs_unconstrained(tmp_path):
    run_dir = tmp_path / "run"
    items = make_upstream(run_dir, n_users=8)
    seqs = pl.read_parquet(run_dir / "ingest" / "sequences.parquet")
    batch = pa.table({
        "user_id": seqs["user_id"].to_list(),
        "split": ["valid"] * seqs.height,
        "history": seqs["train_items"].to_list(),
        "target": seqs["valid_item"].to_list(),
    })
    out = _actor(run_dir, eval_cfg(run_dir)).__call__(batch)
    assert out.num_rows == 8
    assert sum(out.column("n_invalid").to_pylist()) == 0
    assert sum(out.column("n_returned").to_pylist()) == 8 * 5
    assert all(len(x) == 5 and set(x) <= set(items) for x in out.column("items").to_pylist())
    free = _actor(run_dir, eval_cfg(run_dir, "eval.constrained=false")).__call__(batch)
    n_ret, n_inv = sum(free.column("n_returned").to_pylist()), sum(free.column("n_invalid").to_pylist())
    # A random model decoding over the whole vocabulary rarely spells a catalog SID.
    assert n_ret == 8 * 5 and n_inv / n_ret > 0.5


def test_stale_sid_map_is_refused(tmp_path):
    from gti.sid.versions import UnrelatedSidMapError

    run_dir = tmp_path / "run"
    stage_manifest(run_dir, "ingest", {"sequences": "sequences.parquet"}, {})
    stage_manifest(run_dir, "sid", {"sid_map": "sid_map.parquet"}, {"sid_map_hash": HASH})
    d = stage_manifest(run_dir, "sft", {"model": "model"}, {})
    (d / "model").mkdir()
    (d / "model" / "gti_meta.json").write_text(json.dumps({"sid_map_hash": "trained-on-another-map"}))
    stage_manifest(run_dir, "rl", {}, {"enabled": False})
    with pytest.raises(UnrelatedSidMapError, match="stale SID map"):
        pipeline.run_stage(pipeline.spec("evaluate"), eval_cfg(run_dir), run_dir)


def test_the_rl_model_is_evaluated_when_rl_trained(tmp_path):
    """With rl on, evaluate reads rl/model (here one trained on another map: refused, naming it)
    and not sft/model (whose map is right)."""
    from gti.sid.versions import UnrelatedSidMapError

    run_dir = tmp_path / "run"
    stage_manifest(run_dir, "ingest", {"sequences": "sequences.parquet"}, {})
    stage_manifest(run_dir, "sid", {"sid_map": "sid_map.parquet"}, {"sid_map_hash": HASH})
    d = stage_manifest(run_dir, "sft", {"model": "model"}, {})
    (d / "model").mkdir()
    (d / "model" / "gti_meta.json").write_text(json.dumps({"sid_map_hash": HASH}))
    r = stage_manifest(run_dir, "rl", {"model": "model"}, {"enabled": True})
    (r / "model").mkdir()
    (r / "model" / "gti_meta.json").write_text(json.dumps({"sid_map_hash": "trained-on-another-map"}))
    with pytest.raises(UnrelatedSidMapError, match="stale SID map") as err:
        pipeline.run_stage(pipeline.spec("evaluate"), eval_cfg(run_dir, "rl.enabled=true"), run_dir)
    assert str(run_dir / "rl" / "model") in str(err.value)


def test_chunks_are_whole_batches_and_smaller_with_exact_ranks():
    """A resumed evaluation must decode the same batches: chunks are whole eval.batch_users
    batches; exact ranks (seconds per prompt) get short chunks, so a kill loses minutes."""
    from gti.config.eval import EvalConfig
    from gti.stages import evaluate as E

    for batch in (1, 5, 8, 16, 300):
        for exact in (False, True):
            rows = E.chunk_rows(EvalConfig(batch_users=batch, exact_rank=exact))
            assert rows % batch == 0 and rows >= batch
    assert E.chunk_rows(EvalConfig(batch_users=8)) == E.CHUNK_ROWS == 256
    assert E.chunk_rows(EvalConfig(batch_users=8, exact_rank=True)) == E.EXACT_RANK_CHUNK_ROWS == 32
    assert E.chunk_rows(EvalConfig(batch_users=5, exact_rank=True)) == 30


def _without_seconds(x):
    """`x` (parsed JSON) without the keys that hold wall times (`*_seconds`, `*_s`)."""
    if isinstance(x, dict):
        return {k: _without_seconds(v) for k, v in x.items() if not (k.endswith("_seconds") or k.endswith("_s"))}
    if isinstance(x, list):
        return [_without_seconds(v) for v in x]
    return x
