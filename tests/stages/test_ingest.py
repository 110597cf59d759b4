"""gti.stages.ingest (+ embed) through the pipeline on a small slice of the bundled data."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from gti import pipeline
from gti.manifest import Manifest

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_ingest_and_embed_tiny(tiny_cfg, ray_start_4_cpus):
    done = pipeline.run(tiny_cfg, to_stage="embed")
    run_dir = tiny_cfg.resolved_run_dir()
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
