"""Stage `pairs` (gti/stages/pairs.py): its own helpers (id order, exclusions), then the stage on
a local Ray over a small hand-made run directory (ingest + sid manifests). The renderer it maps
over the catalog: tests/lm/test_pairs.py."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gti import config as C
from gti.common.arms import DEFAULT_GROUNDING_TEMPLATES
from gti.data.descriptions import description_text
from gti.lm.pairs import is_val_item
from gti.run.manifest import Manifest
from gti.stages import pairs as P

N_ITEMS = 24
LEVELS, K = 2, 4


def test_same_id_order(tmp_path):
    pq.write_table(pa.table({"item_id": ["a", "b", "c"], "x": [1, 2, 3]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"item_id": ["a", "b", "c"]}), tmp_path / "b.parquet", row_group_size=1)
    pq.write_table(pa.table({"item_id": ["a", "c", "b"]}), tmp_path / "c.parquet")
    pq.write_table(pa.table({"item_id": ["a", "b"]}), tmp_path / "d.parquet")
    assert P.same_id_order(tmp_path / "a.parquet", tmp_path / "b.parquet", batch_rows=2)
    assert not P.same_id_order(tmp_path / "a.parquet", tmp_path / "c.parquet")
    assert not P.same_id_order(tmp_path / "a.parquet", tmp_path / "d.parquet")


def test_read_exclusions(tmp_path):
    assert P.read_exclusions(["a", "b"]) == {"a", "b"}
    f = tmp_path / "ids.txt"
    f.write_text("x\n\ny\n")
    assert P.read_exclusions([str(f)]) == {"x", "y"}
    pq.write_table(pa.table({"item_id": ["p", "q"]}), tmp_path / "ids.parquet")
    assert P.read_exclusions([str(tmp_path / "ids.parquet")]) == {"p", "q"}


def _fixture_run(tmp_path, overrides=(), aligned=False):
    run = tmp_path / "run"
    cfg = C.load(None, [f"run_dir={run}", "model.name=tiny", "ray_num_cpus=2", "pairs.max_len=96",
                        "pairs.val_fraction=0.25", *overrides])
    ing, sid = run / "ingest", run / "sid"
    ing.mkdir(parents=True)
    sid.mkdir()
    rng = np.random.default_rng(0)
    ids = [f"it{i:03d}" for i in range(N_ITEMS)]
    pq.write_table(pa.table({
        "item_id": ids,
        "title": [f"Glass beaker {i} ml" for i in range(N_ITEMS)],
        "description": ["" if i % 5 == 0 else f"A sturdy lab beaker number {i}." for i in range(N_ITEMS)],
        "category": ["Lab > Glass"] * N_ITEMS,
        "attributes_text": ["brand: Pyrex"] * N_ITEMS,
        "text_is_pseudo": [False] * N_ITEMS,
    }), ing / "items.parquet")
    codes = [[int(i % K), int(i // K % K)] for i in range(N_ITEMS)]
    codes[-1] = [3, 3]
    # sid_map in a different order than items: the stage must join, not zip.
    order = np.arange(N_ITEMS) if aligned else rng.permutation(N_ITEMS)
    pq.write_table(pa.table({
        "item_id": [ids[j] for j in order],
        "codes": pa.array([codes[j] for j in order], type=pa.list_(pa.int32())),
        "sid": [f"<a_{codes[j][0]}><b_{codes[j][1]}>" for j in order],
    }), sid / "sid_map.parquet")
    Manifest("ingest", "fp-ingest", {}, facts={"n_items": N_ITEMS}, outputs={"items": "items.parquet"}).write(ing)
    Manifest("sid", "fp-sid", {}, facts={"levels": LEVELS, "codebook_sizes": [K, K], "token_format": "<{level}_{code}>",
                                          "sid_map_hash": "h123"}, outputs={"sid_map": "sid_map.parquet"}).write(sid)
    return cfg, run, dict(zip(ids, codes))


def _run_stage(cfg, run):
    from gti.run import pipeline

    return pipeline.run_stage(pipeline.spec("pairs"), cfg, run)


@pytest.mark.slow
@pytest.mark.ray
def test_pairs_stage_end_to_end(tmp_path, ray_start_4_cpus, monkeypatch):
    from transformers import AutoTokenizer

    from gti.sid.codec import SidCodec

    # local_max_items=0: Ray Data's join/zip and actor pool even for this small catalog; the
    # in-process path for small catalogs must give the same file (checked at the end).
    over = ["pairs.exclude_items=[it003, nope]", "local_max_items=0"]
    cfg, run, codes = _fixture_run(tmp_path, over)
    m = _run_stage(cfg, run)
    f = m.facts
    df = pl.read_parquet(run / "pairs" / "pairs.parquet")
    assert df.columns == ["item_id", "task", "split", "input_ids", "labels", "prompt_ids", "answer_ids"]
    assert f["n_items"] == N_ITEMS - 1 and f["excluded_items"] == 1 and f["exclude_ids_not_in_catalog"] == 1
    assert "it003" not in set(df["item_id"])
    assert f["n_pairs"] == df.height == 6 * (N_ITEMS - 1)
    assert f["tasks"] == {t: N_ITEMS - 1 for t in DEFAULT_GROUNDING_TEMPLATES}
    assert f["sid_map_hash"] == "h123"
    assert {"ray_start_s", "tokenizer_s", "render_write_s", "total_s"} <= set(f["timing"])
    assert f["timing"]["items_per_s"] > 0
    assert f["description_source"] == {"description": 18, "pseudo": 5, "title": 0}  # items 0, 5, .., 20
    # the saved tokenizer has the SID tokens at the manifest's ids
    tok = AutoTokenizer.from_pretrained(run / "pairs" / "tokenizer")
    first, end = f["new_token_ids"]
    assert end - first == LEVELS * K and len(tok) == f["vocab_size_after"] == end
    codec = SidCodec(LEVELS, [K, K])
    # SID ids in the rows equal the codec's ids for that item
    for row in df.filter(pl.col("task") == "title2sid").iter_rows(named=True):
        expect = codec.token_ids(np.array([codes[row["item_id"]]]), tok)[0].tolist()
        assert row["answer_ids"][:LEVELS] == expect
        n_p = len(row["prompt_ids"])
        assert row["labels"][:n_p] == [-100] * n_p and row["labels"][n_p:] == row["answer_ids"]
    # val split: by item, text->SID rows only, deterministic by seed
    val = df.filter(pl.col("split") == "val")
    assert val.height > 0 and set(val["task"]) <= {"title2sid", "desc2sid", "titledesc2sid"}
    val_items = set(val["item_id"])
    assert val_items == {i for i in codes if i != "it003" and is_val_item(i, cfg.seed, 0.25)}
    assert f["n_val_items"] == len(val_items)
    # Deterministic: the file equals a direct rendering of the items in id order (so it cannot
    # depend on Ray's scheduling), tasks in template order.
    from gti.lm.templates import PairRenderer

    assert df["item_id"].to_list() == sorted(df["item_id"].to_list())
    items = pl.read_parquet(run / "ingest" / "items.parquet").filter(pl.col("item_id") != "it003").sort("item_id")
    r = PairRenderer(tok, cfg.pairs.templates, cfg.pairs.system_prompt, cfg.pairs.max_len)
    descs = [description_text(t, d, c, a, cfg.pairs.max_desc_chars)[0]
             for t, d, c, a in items.select("title", "description", "category", "attributes_text").iter_rows()]
    sids = [codec.token_ids(np.array([codes[i]]), tok)[0].tolist() for i in items["item_id"]]
    expect = [row for rows in r.render_batch(items["title"].to_list(), descs, sids) for row in rows]
    assert df["task"].to_list() == [e["task"] for e in expect]
    assert df["input_ids"].to_list() == [e["input_ids"] for e in expect]
    assert df["labels"].to_list() == [e["labels"] for e in expect]
    # The row-aligned path (sid_map in catalog order: zip, no shuffle) gives the same rows.
    cfg2, run2, _ = _fixture_run(tmp_path / "aligned", over, aligned=True)
    assert P.same_id_order(run2 / "ingest" / "items.parquet", run2 / "sid" / "sid_map.parquet")
    _run_stage(cfg2, run2)
    df2 = pl.read_parquet(run2 / "pairs" / "pairs.parquet")
    assert df2.sort("item_id", maintain_order=True).equals(df)
    # A catalog of at most local_max_items items is rendered in this process: the same rows and
    # facts, for the join and the zip.
    monkeypatch.setattr(P, "_items_with_codes", lambda *a: pytest.fail("the local path used Ray Data"))
    for aligned, ray_df in ((False, df), (True, df2)):
        cfg3, run3, _ = _fixture_run(tmp_path / f"local{aligned}", over[:1], aligned=aligned)
        m3 = _run_stage(cfg3, run3)
        assert pl.read_parquet(run3 / "pairs" / "pairs.parquet").equals(ray_df)
        assert {k: v for k, v in m3.facts.items() if k != "timing"} == {k: v for k, v in f.items() if k != "timing"}
