"""gti.data.synth: deterministic, hierarchical, preference-driven, readable by ingest."""

from __future__ import annotations

import json

import polars as pl
import pyarrow.parquet as pq
import pytest

from gti import cli
from gti.data import synth


def _read(d):
    return pq.read_table(d / "items"), pq.read_table(d / "interactions")


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = synth.generate(500, 100, tmp_path / "a", seed=3, chunk=200, log=lambda m: None)
    synth.generate(500, 100, tmp_path / "b", seed=3, chunk=200, log=lambda m: None)
    synth.generate(500, 100, tmp_path / "c", seed=4, chunk=200, log=lambda m: None)
    for sub in ("items", "interactions"):
        files_a = sorted((tmp_path / "a" / sub).iterdir())
        assert len(files_a) > 1  # chunked
        for f in files_a:
            assert f.read_bytes() == (tmp_path / "b" / sub / f.name).read_bytes()
    ia, xa = _read(tmp_path / "a")
    ic, xc = _read(tmp_path / "c")
    assert ia.column("title") != ic.column("title")
    assert a["items"] == ia.num_rows == 500 and a["interactions"] == xa.num_rows


def test_structure_hierarchy_and_latent_preferences(tmp_path):
    synth.generate(5000, 400, tmp_path, seed=0, log=lambda m: None)
    items, inter = _read(tmp_path)
    cats = items.column("category").to_pylist()
    assert all(len(c.split(" > ")) == 3 for c in cats)
    assert len({c.split(" > ")[0] for c in cats}) == len(synth.DEPARTMENTS)
    # The product noun of the category appears in the title and description (templated text).
    row = items.slice(0, 1).to_pylist()[0]
    assert row["category"].split(" > ")[2] in row["title"] and row["brand"] in row["title"]
    # Users concentrate on a few product types: far fewer distinct types per user than random.
    df = pl.from_arrow(inter).join(
        pl.from_arrow(items.select(["item_id", "category"])), on="item_id")
    per_user = df.group_by("user_id").agg(pl.col("category").n_unique().alias("k"), pl.len().alias("n"))
    share = (per_user["k"] / per_user["n"]).mean()
    assert share < 0.75
    # Timestamps increase within a user; every user has >= 5 interactions.
    min_gap = pl.from_arrow(inter).group_by("user_id", maintain_order=True).agg(
        pl.col("ts").diff().drop_nulls().min().alias("gap"))
    assert (min_gap["gap"] > 0).all()
    assert per_user["n"].min() >= 5
    ids = set(items.column("item_id").to_pylist())
    assert set(inter.column("item_id").to_pylist()) <= ids


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_cli_formats_ingest_cleanly(tmp_path, run_ingest, fmt, capsys):
    rc = cli.main(["data", "synth", "--items", "300", "--users", "40", "--out", str(tmp_path / "s"),
                   "--seed", "1", "--format", fmt])
    assert rc == 0
    assert "use: data.items.path=" in capsys.readouterr().out
    summary = json.loads((tmp_path / "s" / "synth.json").read_text())
    r = run_ingest(tmp_path / "s" / "items", tmp_path / "s" / "interactions")
    r.check_accounting()
    assert r.facts["items_rows_ok"] == 300 and r.facts["items_rows_quarantined"] == 0
    assert r.facts["interactions_rows_in"] == summary["interactions"]
    assert r.facts["n_users"] == 40  # every synthetic user has >= 5 interactions
