"""`LoadedRun` / `recommend` / `gti recommend` (gti/run/loaded.py) on a tiny run directory built here:
a tiny Llama extended with 2x8 SID tokens, exported with gti_meta.json, a sid_map with its
manifest, and an ingest items table with titles."""

from __future__ import annotations

import shutil

import numpy as np
import polars as pl
import pytest
import torch

from gti.config import ModelConfig
from gti.common.errors import DataError
from gti.eval.decode import score_all_sids
from gti.eval.recommend import format_recommendations
from gti.run.loaded import LoadedRun, recommend
from gti.run.versions import RunDirError, check_exact_map
from gti.sid.versions import UnrelatedSidMapError


def load_recommender(run_dir):
    return LoadedRun.open(run_dir)
from gti.run.manifest import Manifest
from gti.sid.codec import SidCodec

N_ITEMS, LEVELS, CODEBOOK = 20, 2, 8


def _write_run(run, export_stage: str = "sft", meta_hash: str | None = None):
    from gti.lm.models import build_tiny
    from gti.lm.new_rows import export_model

    model, tok = build_tiny(ModelConfig(name="tiny"), seed=0)
    codec = SidCodec(LEVELS, CODEBOOK)
    from gti.lm.new_rows import extend_tokenizer

    first, end = extend_tokenizer(tok, codec.tokens())
    model.resize_token_embeddings(end, mean_resizing=False)
    with torch.no_grad():  # noise rows: distinct SID scores, no near-ties
        g = torch.Generator().manual_seed(0)
        model.get_input_embeddings().weight[first:end] = torch.randn(end - first, model.config.hidden_size, generator=g)
    rng = np.random.default_rng(0)
    pairs = rng.permutation(CODEBOOK * CODEBOOK)[:N_ITEMS]
    codes = [[int(p // CODEBOOK), int(p % CODEBOOK)] for p in pairs]
    item_ids = [f"it{i}" for i in range(N_ITEMS)]
    sids = [codec.to_string(c) for c in codes]
    sid_hash = f"hash{N_ITEMS}"

    (run / "sid").mkdir(parents=True)
    pl.DataFrame(
        {"item_id": item_ids, "codes": codes, "sid": sids},
        schema={"item_id": pl.String, "codes": pl.List(pl.Int32), "sid": pl.String},
    ).write_parquet(run / "sid" / "sid_map.parquet")
    Manifest(
        stage="sid", fingerprint="f", config={},
        facts={"levels": LEVELS, "codebook_sizes": [CODEBOOK] * LEVELS, "token_format": codec.token_format,
               "sid_map_hash": sid_hash, "n_items": N_ITEMS},
        outputs={"sid_map": "sid_map.parquet"},
    ).write(run / "sid")
    (run / "ingest").mkdir()
    pl.DataFrame({"item_id": item_ids, "title": [f"Title of item {i}" for i in range(N_ITEMS)]}).write_parquet(
        run / "ingest" / "items.parquet"
    )
    Manifest(stage="ingest", fingerprint="f", config={}, outputs={"items": "items.parquet"}).write(run / "ingest")
    export_model(model, tok, run / export_stage / "model", {"sid_map_hash": meta_hash or sid_hash})
    Manifest(stage=export_stage, fingerprint="f", config={}, outputs={"model": "model"}).write(run / export_stage)
    return item_ids, sids


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    item_ids, sids = _write_run(run)
    return run, item_ids, sids


def test_recommend_returns_exact_topk_with_titles(tiny_run):
    run, item_ids, sids = tiny_run
    rec = load_recommender(run)
    assert rec.model_stage == "sft"
    history = ["it3", "it7", "it1"]
    out = rec.recommend(history, k=5)
    assert [set(r) for r in out] == [{"item_id", "title", "score", "sid"}] * 5
    ids = [r["item_id"] for r in out]
    assert len(set(ids)) == 5 and set(ids) <= set(item_ids)
    for r in out:
        row = item_ids.index(r["item_id"])
        assert r["sid"] == sids[row] and r["title"] == f"Title of item {row}"
    # Beam width 20 >= 20 items: the search is exhaustive, so it must equal teacher forcing.
    prompt, _ = rec.renderer.prompt(history)
    mat = torch.from_numpy(np.stack([rec.sid_ids[i] for i in item_ids]))
    exact = score_all_sids(rec.model, prompt, mat)
    top_scores, top_rows = exact.topk(5)
    assert ids == [item_ids[r] for r in top_rows.tolist()]
    np.testing.assert_allclose([r["score"] for r in out], top_scores.numpy(), atol=1e-4)
    # The module-level function gives the same answer (it loads the run again).
    assert [r["item_id"] for r in recommend(run, history, k=5)] == ids
    table = format_recommendations(out)
    assert len(table.splitlines()) == 6 and "Title of item" in table


def test_unknown_history_and_bad_k(tiny_run):
    run, _, _ = tiny_run
    rec = load_recommender(run)
    with pytest.raises(DataError, match="unknown item id.*nope, zzz"):
        rec.recommend(["it1", "nope", "zzz", "nope"], k=3)
    with pytest.raises(DataError, match="history is empty"):
        rec.recommend([" "], k=3)
    # k larger than the catalog: the whole catalog, ranked.
    assert len(rec.recommend(["it1"], k=50)) == N_ITEMS


def test_stale_sid_map_is_refused(tmp_path):
    _write_run(tmp_path, meta_hash="someotherhash")
    with pytest.raises(UnrelatedSidMapError, match="someotherhash.*hash20"):
        load_recommender(tmp_path)


def test_falls_back_to_ground_model_and_reports_missing(tmp_path):
    _write_run(tmp_path, export_stage="ground")
    assert load_recommender(tmp_path).model_stage == "ground"
    shutil.rmtree(tmp_path / "ground")
    with pytest.raises(RunDirError, match="no exported model"):
        load_recommender(tmp_path)
    with pytest.raises(RunDirError, match="not found"):
        load_recommender(tmp_path / "missing")


def test_cli(tiny_run, capsys):
    from gti.cli import main

    run, _, _ = tiny_run
    assert main(["recommend", "--run-dir", str(run), "--history", "it2, it5", "--k", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "history: it2, it5" in out[0] and out[1].split()[:3] == ["rank", "item_id", "score"]
    assert len(out) == 5 and out[2].split()[0] == "1"
    assert main(["recommend", "--run-dir", str(run), "--history", "it2,bogus"]) == 2
    assert "unknown item id(s) in history: bogus" in capsys.readouterr().err


def test_open_from_named_folders_equals_open_from_run_dir(tiny_run):
    """The evaluate stage's form (model folder, SID map file, sid facts, config) loads the
    same catalog as the run-dir form, and the hash check is the same one method."""
    run, item_ids, _ = tiny_run
    a = LoadedRun.open(run)
    sid_man = Manifest.read(run / "sid")
    b = LoadedRun.open(model_dir=a.model_dir, sid_map_path=sid_man.output(run / "sid", "sid_map"),
                       sid_facts=sid_man.facts, cfg=a.cfg)
    assert b.item_ids == a.item_ids == item_ids and b.run_dir is None
    assert torch.equal(a.sid_matrix, b.sid_matrix) and b.levels == LEVELS
    with pytest.raises(UnrelatedSidMapError, match="stale SID map"):
        check_exact_map(a.model_dir, "not-this-map")
    with pytest.raises(RunDirError, match="needs a run_dir"):
        LoadedRun.open(model_dir=a.model_dir)


def test_recommend_takes_trust_remote_code_from_the_flag_only(tmp_path, capsys, monkeypatch):
    """`gti recommend` on a run whose config says `model.trust_remote_code: true`: the loaders
    get False with one note, and True only with --trust-remote-code."""
    import transformers

    from gti import config as C
    from gti.run import versions as run_versions
    from gti.cli import main

    _write_run(tmp_path)
    (tmp_path / "sft" / "config.yaml").write_text(C.dump(C.load(None, ["model.trust_remote_code=true"])))
    seen: list[tuple[str, bool]] = []
    for cls in (transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        orig = cls.from_pretrained

        def spy(path, *a, _orig=orig, _name=cls.__name__, **kw):
            seen.append((_name, kw.get("trust_remote_code")))
            kw["trust_remote_code"] = False  # the tiny model has no code of its own either way
            return _orig(path, *a, **kw)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    monkeypatch.setattr(run_versions, "_noted", set())
    assert main(["recommend", "--run-dir", str(tmp_path), "--history", "it2", "--k", "2"]) == 0
    assert seen == [("AutoTokenizer", False), ("AutoModelForCausalLM", False)]
    err = [line for line in capsys.readouterr().err.splitlines() if "trust_remote_code" in line]
    assert len(err) == 1 and "model.trust_remote_code: true is ignored" in err[0] and "--trust-remote-code" in err[0]
    seen.clear()
    assert main(["recommend", "--run-dir", str(tmp_path), "--history", "it2", "--k", "2", "--trust-remote-code"]) == 0
    assert seen == [("AutoTokenizer", True), ("AutoModelForCausalLM", True)]


def test_a_refresh_version_made_on_another_base_is_not_loaded(tmp_path, capsys, monkeypatch):
    """The newest refresh/v<k> whose manifest records another base (the run retrained since) is
    skipped with one note: `LoadedRun.open` loads the run's own model, never the old version."""
    import pyarrow.parquet as pq

    from gti.run import versions as run_versions
    from gti.sid.versions import make_version, write_map

    _write_run(tmp_path)
    base = run_versions.base_record(tmp_path)
    assert base["model_stage"] == "sft" and base["sid_map_hash"] == f"hash{N_ITEMS}"
    v1 = tmp_path / "refresh" / "v1"
    (v1 / "sid").mkdir(parents=True)
    t = pq.read_table(str(tmp_path / "sid" / "sid_map.parquet"))
    write_map(v1 / "sid" / "sid_map.parquet", t, make_version(t, "cb", [CODEBOOK] * LEVELS, parent="old"))
    Manifest(stage="refresh", fingerprint="v1", config={},
             facts={"base": {**base, "model_fingerprint": "before-the-retrain"}}).write(v1)
    monkeypatch.setattr(run_versions, "_noted", set())
    run = LoadedRun.open(tmp_path)
    assert run.model_stage == "sft" and run.model_dir == tmp_path / "sft" / "model"
    err = [line for line in capsys.readouterr().err.splitlines() if "skipped" in line]
    assert len(err) == 1 and f"{v1} is skipped: it was refreshed from another base" in err[0]
    assert "before-the-retrain" in err[0]
