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


# --- permutation walk (learnability set) ------------------------------------------------------


def _walk_sequences(d) -> dict[str, list[str]]:
    inter = pl.from_arrow(pq.read_table(d / "interactions"))
    per_user = inter.sort(["user_id", "ts"]).group_by("user_id", maintain_order=True).agg(
        pl.col("item_id"), pl.col("ts").diff().drop_nulls().min().alias("gap"))
    assert (per_user["gap"] > 0).all()  # strictly increasing timestamps
    return dict(zip(per_user["user_id"].to_list(), per_user["item_id"].to_list()))


def test_walk_follows_the_permutation_with_bounded_lengths(tmp_path):
    s = synth.generate_walk(60, 500, tmp_path, seed=2, min_len=5, max_len=9, chunk=40, log=lambda m: None)
    assert s["kind"] == "walk" and s["users"] == 500 and (s["min_len"], s["max_len"]) == (5, 9)
    perm = [str(i) for i in synth.walk_permutation(60, 2)]
    assert s["permutation_head"] == perm[:len(s["permutation_head"])]
    succ = {perm[i]: perm[(i + 1) % len(perm)] for i in range(len(perm))}
    seqs = _walk_sequences(tmp_path)
    assert len(seqs) == 500 and sum(map(len, seqs.values())) == s["interactions"]
    for seq in seqs.values():
        assert 5 <= len(seq) <= 9
        assert all(succ[a] == b for a, b in zip(seq, seq[1:]))
    lengths = {len(v) for v in seqs.values()}
    assert lengths == set(range(5, 10))  # the whole range is drawn
    starts = {v[0] for v in seqs.values()}
    assert len(starts) > 50  # uniform start positions cover the cycle
    items = pq.read_table(tmp_path / "items")
    assert items.num_rows == 60 and len(list((tmp_path / "items").glob("part-*.parquet"))) == 2  # chunk=40
    assert set(items.column("item_id").to_pylist()) == set(perm)
    row = items.slice(0, 1).to_pylist()[0]
    assert row["title"] and row["description"] and len(row["category"].split(" > ")) == 3 and row["brand"]


def test_walk_is_deterministic_for_a_seed(tmp_path):
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        synth.generate_walk(80, 300, tmp_path / name, seed=seed, chunk=50, log=lambda m: None)
    for sub in ("items", "interactions"):
        files = sorted((tmp_path / "a" / sub).iterdir())
        assert len(files) > 1  # chunked
        for f in files:
            assert f.read_bytes() == (tmp_path / "b" / sub / f.name).read_bytes()
    assert (pq.read_table(tmp_path / "a" / "interactions").column("item_id")
            != pq.read_table(tmp_path / "c" / "interactions").column("item_id"))


def test_walk_rejects_short_sequences(tmp_path):
    with pytest.raises(ValueError, match="min-len"):
        synth.generate_walk(10, 5, tmp_path, min_len=3, max_len=6, log=lambda m: None)
    with pytest.raises(ValueError, match="max-len"):
        synth.generate_walk(10, 5, tmp_path, min_len=8, max_len=6, log=lambda m: None)


def test_walk_is_perfect_for_a_first_order_markov_baseline(tmp_path):
    from gti.eval.baselines import Markov

    synth.generate_walk(50, 1000, tmp_path, seed=0, log=lambda m: None)
    seqs = list(_walk_sequences(tmp_path).values())
    train = [s[:-2] for s in seqs]  # leave-one-out: last = test, second to last = valid
    model = Markov().fit(train)
    hist = [s[:-1] for s in seqs]
    top1 = model.recommend(hist, 1)
    assert all(r == [s[-1]] for r, s in zip(top1, seqs))


def test_cli_walk_writes_files(tmp_path, capsys):
    out = tmp_path / "w"
    rc = cli.main(["data", "synth", "--walk", "--items", "30", "--out", str(out), "--seed", "1",
                   "--min-len", "4", "--max-len", "6"])
    assert rc == 0
    assert "permutation walk" in capsys.readouterr().out
    summary = json.loads((out / "synth.json").read_text())
    assert summary["kind"] == "walk" and summary["users"] == 20 * 30
    assert (summary["min_len"], summary["max_len"]) == (4, 6)
    assert (out / "items" / "part-00000.parquet").is_file()
    assert (out / "interactions" / "part-00000.parquet").is_file()
    assert all(4 <= len(v) <= 6 for v in _walk_sequences(out).values())


def test_cli_walk_bad_lengths_and_lengths_without_walk_fail(tmp_path, capsys):
    args = ["data", "synth", "--items", "10", "--out", str(tmp_path / "x")]
    assert cli.main(args + ["--walk", "--min-len", "3"]) == 2
    assert "--min-len" in capsys.readouterr().err
    assert cli.main(args + ["--max-len", "9"]) == 2
    assert "only apply with --walk" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
