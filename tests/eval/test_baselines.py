"""Baselines (gti/eval/baselines.py) on hand-made sequences, and the reference check on the
bundled amazon-scientific data."""

from __future__ import annotations

import polars as pl
import pytest

from gti.eval.baselines import Markov, MostPop

SEQS = [
    ["a", "b", "c"],
    ["a", "b", "d"],
    ["b", "c", "a"],
    ["d", "a", "c"],
    ["e"],
]
# counts: a 4, b 3, c 3, d 2, e 1.  pairs: a->b 2, b->c 2, b->d 1, c->a 1, d->a 1, a->c 1


def test_mostpop_counts_and_catalog_tiebreak():
    m = MostPop(catalog=["e", "d", "c", "b", "a", "z"]).fit(SEQS)
    # b and c tie at 3: catalog order puts c first; z never seen ranks last.
    assert m.recommend([["x"], []], 6) == [["a", "c", "b", "d", "e", "z"]] * 2
    assert m.recommend([["a"]], 2) == [["a", "c"]]
    # Without a catalog: items seen in training, ties by first appearance (b before c).
    assert MostPop().fit(SEQS).recommend([[]], 5) == [["a", "b", "c", "d", "e"]]


def test_markov_successors_then_popularity_backoff():
    cat = ["a", "b", "c", "d", "e"]
    m = Markov(catalog=cat).fit(SEQS)
    recs = m.recommend([["x", "a"], ["b"], ["c"], ["e"], []], 4)
    assert recs[0] == ["b", "c", "a", "d"]  # a->b (2), a->c (1), then popularity a, (b, c taken), d
    assert recs[1] == ["c", "d", "a", "b"]  # b->c (2), b->d (1)
    assert recs[2] == ["a", "b", "c", "d"]  # c->a (1), back-off: b, c, d
    assert recs[3] == ["a", "b", "c", "d"]  # e has no successor: pure popularity
    assert recs[4] == ["a", "b", "c", "d"]  # empty history
    # Transitions never cross sequences: seq 1 ends with "d" and seq 2 starts with "b", seq 3
    # ends with "c" and seq 4 is "e"; neither d->b nor c->e exists.
    succ = m.successors(5)
    assert succ["d"] == ["a"] and succ["c"] == ["a"] and "e" not in succ
    # Only the last history item matters.
    assert m.recommend([["b", "d"]], 2) == [["a", "b"]]


def test_markov_ties_by_popularity_and_catalog_restriction():
    seqs = [["s", "p"], ["s", "q"], ["q", "q"], ["r", "r"], ["r"]]  # s->p 1, s->q 1: q more popular
    m = Markov(catalog=["p", "q", "r", "s"]).fit(seqs)
    assert m.recommend([["s"]], 2) == [["q", "p"]]
    # A successor outside the catalog is never recommended.
    m2 = Markov(catalog=["p", "r", "s"]).fit(seqs)
    assert m2.recommend([["s"]], 3) == [["p", "r", "s"]]


def test_recommend_before_fit_raises():
    with pytest.raises(RuntimeError, match="fit"):
        Markov().recommend([["a"]], 3)


# Not marked slow: it takes ~1.5 s on the 2-core machine, so it runs in the fast suite too.
def test_reference_numbers_on_bundled_amazon_scientific():
    """The published reference points of the bundled data (leave-one-out, test split, full
    ranking): MostPop HR@10 ~ .031; Markov HR@10 ~ .081, NDCG@10 ~ .056 (fitted on training
    sequences)."""
    from gti.data import bundled
    from gti.data.sequences import build_sequences
    from gti.eval import metrics as M

    root = bundled.root() / "amazon-scientific"
    inter = pl.read_parquet(root / "interactions.parquet").with_row_index("order").with_columns(
        pl.col("order").cast(pl.Int64)
    )
    seqs = build_sequences(inter, min_seq_len=3).sequences
    catalog = pl.read_parquet(root / "items.parquet")["item_id"].to_list()
    train = seqs["train_items"].to_list()
    hist = [t + [v] for t, v in zip(train, seqs["valid_item"].to_list())]
    targets = seqs["test_item"].to_list()
    assert len(targets) == 8442

    pop = M.per_user_metrics(MostPop(catalog).fit(train).recommend(hist, 10), targets, [10])
    mk = M.per_user_metrics(Markov(catalog).fit(train).recommend(hist, 10), targets, [10])
    assert pop["recall@10"].mean() == pytest.approx(0.031, abs=0.003)
    assert mk["recall@10"].mean() == pytest.approx(0.081, abs=0.004)
    assert mk["ndcg@10"].mean() == pytest.approx(0.056, abs=0.003)
