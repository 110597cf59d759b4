"""gti.stages.ingest (+ embed) through the pipeline on a small slice of the bundled data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from gti.run import pipeline
from gti.run.contract import StageContext
from gti.run.manifest import Manifest

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ROOT = Path(__file__).resolve().parents[2]


def _corpus(d):
    """A directory of parquet files with mixed schemas and defects, plus CSV interactions."""
    import pyarrow as pa

    cat = d / "catalog"
    cat.mkdir()
    pq.write_table(pa.table({"item_id": ["1", "2", "1", None], "title": ["Beaker", "Flask", "dup", "x"]}),
                   cat / "a.parquet")
    pq.write_table(pa.table({"item_id": pa.array([3.0, 4.5, 5.0]), "description": ["Pipette", "Half", None],
                             "brand": [None, None, "Pyrex"]}), cat / "b.parquet")
    inter = d / "inter.csv"
    inter.write_text("user_id,item_id,ts\n" + "".join(
        f"{u},{i},{t}\n" for t, (u, i) in enumerate(
            [("u", 1), ("u", 2), ("u", 3), ("u", 5), ("v", 1), ("u", 9), ("w", 2), ("w", 3), ("w", 1)])
    ) + "w,2,-1\n")
    return cat, inter


def test_ray_stream_equals_local_stream(tmp_path, ray_start_4_cpus):
    """The Ray Data path and the in-process path give identical outputs on a defect corpus."""
    from gti import config
    from gti.stages import ingest
    from gti.data.batches import local_stream

    cat, inter = _corpus(tmp_path)
    cfg = config.load(None, [f"run_dir={tmp_path / 'run'}", f"data.items.path={cat}",
                             f"data.interactions.path={inter}"])
    results = {}
    for name, stream in [("local", local_stream), ("ray", ingest.ray_stream)]:
        work = tmp_path / name
        work.mkdir()
        ctx = StageContext(spec=pipeline.spec("ingest"), cfg=cfg, run_dir=tmp_path,
                           work_dir=work, fingerprint="t")
        results[name] = (ingest.ingest(ctx, stream).facts, work)
    (fl, wl), (fr, wr) = results["local"], results["ray"]
    fl.pop("timing"), fr.pop("timing")  # wall seconds differ from run to run
    assert fl == fr
    for f in ["items", "items_quarantine", "interactions", "interactions_quarantine", "sequences"]:
        assert pq.read_table(wl / f"{f}.parquet").equals(pq.read_table(wr / f"{f}.parquet")), f
    assert fr["items_rows_in"] == 7 and fr["items_rows_ok"] == 4
    assert fr["items_quarantine_reasons"] == {"duplicate_id": 1, "missing_id": 1, "float_id": 1}
    assert fr["interactions_quarantine_reasons"] == {"unknown_item": 1, "short_sequence": 1, "invalid_ts": 1}
    assert fr["interactions_rows_in"] == fr["interactions_rows_ok"] + fr["interactions_rows_quarantined"]


def test_ingest_and_embed_tiny(tiny_upstream):
    """The session's shared tiny stages (tests/conftest.py), built by pipeline.run."""
    from gti import config

    run_dir = tiny_upstream
    tiny_cfg = config.load(ROOT / "jobs" / "configs" / "tiny.yaml", [f"run_dir={run_dir}"])
    done = {s: Manifest.read(run_dir / s) for s in ("ingest", "embed")}
    f = done["ingest"].facts
    # Accounting: every row is either ok or quarantined.
    assert f["items_rows_in"] == f["items_rows_ok"] + f["items_rows_quarantined"]
    assert f["interactions_rows_in"] == f["interactions_rows_ok"] + f["interactions_rows_quarantined"]
    assert f["n_items"] == tiny_cfg.data.max_items == 300
    assert f["interactions_rows_in"] == 59427  # the whole bundled file was read
    ing = run_dir / "ingest"
    items = pq.read_table(ing / "items.parquet")
    assert items.column_names == ["item_id", "title", "description", "category", "attributes_text", "text_is_pseudo"]
    assert items.num_rows == f["items_rows_ok"]
    assert items.column("item_id").to_pylist()[:3] == ["0", "1", "2"]  # file order kept
    assert all(items.column("title").to_pylist())  # every kept item has text to ground
    q = pq.read_table(ing / "interactions_quarantine.parquet")
    assert q.num_rows == f["interactions_rows_quarantined"]
    assert sum(f["quarantine_reasons"].values()) == f["items_rows_quarantined"] + f["interactions_rows_quarantined"]
    # Sequences: leave-one-out over the kept, chronologically sorted interactions.
    inter = pl.read_parquet(ing / "interactions.parquet")
    seqs = pl.read_parquet(ing / "sequences.parquet")
    assert seqs.height == f["n_users"]
    kept_items = set(items.column("item_id").to_pylist())
    assert set(inter["item_id"].unique().to_list()) <= kept_items
    full = inter.group_by("user_id", maintain_order=True).agg(pl.col("item_id"))
    joined = seqs.join(full, on="user_id")
    for row in joined.iter_rows(named=True):
        items_u = row["item_id"]
        assert row["train_items"] == items_u[:-2]
        assert (row["valid_item"], row["test_item"]) == (items_u[-2], items_u[-1])
        assert len(items_u) >= f["min_seq_len_effective"]
    # Embed: one L2-normalised vector per item, in items.parquet order.
    e = done["embed"].facts
    assert (e["dim"], e["encoder"], e["n_items"]) == (32, "hash", 300)
    assert {"ray_start_s", "pool_s", "concat_s", "encoder_load_s", "read_s", "encode_s", "write_s",
            "total_s", "encode_items_per_s"} <= set(e["timing"])
    assert {"items_s", "interactions_s", "ray_start_s", "total_s"} <= set(f["timing"]) and f["dense"] is None
    emb = pq.read_table(run_dir / "embed" / "embeddings.parquet")
    assert str(emb.schema.field("embedding").type) == "fixed_size_list<element: float>[32]"
    assert emb.column("item_id").to_pylist() == items.column("item_id").to_pylist()
    vecs = np.stack(emb.column("embedding").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert Manifest.read(run_dir / "embed").outputs == {"embeddings": "embeddings.parquet"}
    # A rerun with nothing changed skips both stages.
    again = pipeline.run(tiny_cfg, to_stage="embed")
    assert again["ingest"].fingerprint == done["ingest"].fingerprint
    assert again["embed"].created == done["embed"].created


def test_small_catalogs_run_in_process_with_the_same_outputs(tiny_upstream, tmp_path):
    """The session's tiny upstream (300 items, one read task per source) was ingested and
    embedded in this process (`local_max_items`); the same stages on Ray Data
    (`local_max_items=0`: read tasks, the embedding actor pool) write the same tables."""
    from gti import config

    logs: list[str] = []
    cfg = config.load(ROOT / "jobs" / "configs" / "tiny.yaml", [f"run_dir={tmp_path / 'run'}", "local_max_items=0"])
    ray_run = pipeline.run(cfg, to_stage="embed", echo=logs.append)
    assert not any("local_max_items" in m for m in logs), logs  # nothing ran in process
    for stage, name in [("ingest", "items"), ("ingest", "items_quarantine"), ("ingest", "interactions"),
                        ("ingest", "interactions_quarantine"), ("ingest", "sequences"), ("embed", "embeddings")]:
        assert pq.read_table(tmp_path / "run" / stage / f"{name}.parquet").equals(
            pq.read_table(tiny_upstream / stage / f"{name}.parquet")), (stage, name)
    assert ray_run["embed"].fingerprint == Manifest.read(tiny_upstream / "embed").fingerprint


def test_one_read_task_is_read_in_process(monkeypatch):
    """Ingest's stream for a run with local_max_items > 0: one read task is read here (Ray
    Data is never asked), more go to `ray_stream`."""
    from gti.stages import ingest

    calls = []
    monkeypatch.setattr(ingest, "local_stream", lambda tasks, *a: calls.append(("local", len(tasks))) or iter([1]))
    monkeypatch.setattr(ingest, "ray_stream", lambda tasks, *a: calls.append(("ray", len(tasks))) or iter([2]))
    assert list(ingest._small_local_stream(["t"], "items", None, 10, 2)) == [1]
    assert list(ingest._small_local_stream(["t", "u"], "items", None, 10, 2)) == [2]
    assert calls == [("local", 1), ("ray", 2)]


def test_errors_inside_ray_tasks_are_one_line(tmp_path, ray_start_4_cpus):
    """A file-level problem found inside a Ray Data task reaches the user as the same one-line
    DataError as in-process (no Ray traceback)."""
    from gti import config
    from gti.common.errors import DataError
    from gti.stages import ingest

    items = tmp_path / "items.jsonl"
    items.write_text('{"sku": "1", "title": "Beaker"}\n')  # JSON columns are checked in the task
    inter = tmp_path / "inter.csv"
    inter.write_text("user_id,item_id,ts\nu,1,1\n")
    cfg = config.load(None, [f"run_dir={tmp_path / 'run'}", f"data.items.path={items}",
                             f"data.interactions.path={inter}"])
    ctx = StageContext(spec=pipeline.spec("ingest"), cfg=cfg, run_dir=tmp_path,
                       work_dir=tmp_path, fingerprint="t")
    with pytest.raises(DataError) as e:
        ingest.ingest(ctx, ingest.ray_stream)
    assert str(e.value) == (f"{items}: missing column 'item_id' (data.items.columns; the file has: sku, title)")


def test_the_dense_subset_through_the_stage(tmp_path, ray_start_4_cpus):
    """`data.dense` through the pipeline (Ray Data reads): the same outputs as the in-process
    path, the cut and the timing in the manifest, and a changed subset re-runs the stage."""
    from gti import config
    from gti.data.catalog import OUTSIDE_DENSE
    from gti.stages import ingest
    from gti.data.batches import local_stream

    keys = [f"run_dir={tmp_path / 'run'}", "data.dense.top_items=300", "data.dense.min_user_len=4",
            "local_max_items=0"]  # Ray Data reads, also for this one-file source
    m = pipeline.run(config.load(None, keys), to_stage="ingest")["ingest"]
    f = m.facts
    out = tmp_path / "run" / "ingest"
    assert f["n_items"] == f["dense"]["items_after"] == pq.read_metadata(out / "items.parquet").num_rows
    assert f["items_quarantine_reasons"][OUTSIDE_DENSE] == f["dense"]["items_before"] - f["dense"]["items_after"]
    assert f["interactions_rows_in"] == f["interactions_rows_ok"] + f["interactions_rows_quarantined"]
    assert {"items_s", "interactions_s", "dense_items_s", "ray_start_s", "total_s"} <= set(f["timing"])
    local = tmp_path / "local"
    local.mkdir()
    ctx = StageContext(spec=pipeline.spec("ingest"), cfg=config.load(None, keys), run_dir=tmp_path,
                       work_dir=local, fingerprint="t")
    ingest.ingest(ctx, local_stream)
    for name in ["items", "items_quarantine", "interactions", "interactions_quarantine", "sequences"]:
        assert pq.read_table(local / f"{name}.parquet").equals(pq.read_table(out / f"{name}.parquet")), name
    again = pipeline.run(config.load(None, keys + ["data.dense.min_user_len=5"]), to_stage="ingest")["ingest"]
    assert again.fingerprint != m.fingerprint and again.facts["dense"]["min_user_len"] == 5
