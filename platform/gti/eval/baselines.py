"""Reference recommenders: MostPop and first-order Markov (item -> next item).

What it is for: reference rows in the evaluation table, computed on the same users and split as
the model, so a generative recommender that cannot beat them is seen to be broken. Both rank the
whole catalog; which sequences to fit on is the caller's choice (the same training data as the
model, for a fair row). Their reference points on the bundled amazon-scientific data are checked
by `tests/eval/test_baselines.py::test_reference_numbers_on_bundled_amazon_scientific`.

What it does NOT know: models, SIDs, metrics (see `gti.eval.metrics`), files, Ray. Columnar
counting in polars; one process.
"""

from __future__ import annotations

from typing import Sequence

import polars as pl


class _Base:
    """What both recommenders share: the popularity ranking of the whole catalog (`catalog` = the
    items that may be recommended, in a fixed order used for the final tie-break). Catalog items
    never seen in training rank last, in catalog order; training items outside the catalog are
    never recommended. History items are not removed (the leave-one-out protocol allows
    repeats)."""

    def __init__(self, catalog: Sequence[str] | None = None) -> None:
        self.catalog = None if catalog is None else [str(i) for i in catalog]
        self._pop_order: list[str] | None = None
        self._pop_rank: dict[str, int] = {}

    def _pairs_frame(self, sequences: Sequence[Sequence[str]]) -> pl.DataFrame:
        """One row per interaction: seq (int), pos (int), item (str)."""
        df = pl.DataFrame({"items": [list(map(str, s)) for s in sequences]}, schema={"items": pl.List(pl.String)})
        return (
            df.with_row_index("seq")
            .explode("items")
            .drop_nulls("items")
            .rename({"items": "item"})
            .with_columns(pl.int_range(pl.len()).over("seq").alias("pos"))
        )

    def _fit_popularity(self, inter: pl.DataFrame) -> None:
        counts = inter.group_by("item").agg(pl.len().alias("count"))
        if self.catalog is None:
            # No catalog given: the items seen in training, in order of first appearance.
            catalog = inter.unique("item", keep="first", maintain_order=True)["item"].to_list()
        else:
            catalog = self.catalog
        cat = pl.DataFrame({"item": catalog}, schema={"item": pl.String}).with_row_index("cat_rank")
        ranked = (
            cat.join(counts, on="item", how="left")
            .with_columns(pl.col("count").fill_null(0))
            .sort(["count", "cat_rank"], descending=[True, False])
        )
        self._pop_order = ranked["item"].to_list()
        self._pop_rank = {item: r for r, item in enumerate(self._pop_order)}

    def _check_fitted(self) -> list[str]:
        if self._pop_order is None:
            raise RuntimeError(f"{type(self).__name__}.fit() must be called before recommend()")
        return self._pop_order


class MostPop(_Base):
    """Most popular items of the training sequences (interaction counts), the same list for
    every user, most frequent first."""

    def fit(self, sequences: Sequence[Sequence[str]]) -> "MostPop":
        self._fit_popularity(self._pairs_frame(sequences))
        return self

    def recommend(self, histories: Sequence[Sequence[str]], k: int) -> list[list[str]]:
        top = self._check_fitted()[:k]
        return [list(top) for _ in histories]


class Markov(_Base):
    """First-order Markov chain over items, backing off to popularity.

    `fit` counts consecutive pairs (a -> b) within each training sequence. A user's list is the
    successors of their LAST history item by pair count, ties broken by popularity and then
    catalog order, then filled up ("back-off") with the popularity ranking minus the items
    already listed. Users with an empty history get the popularity list."""

    def fit(self, sequences: Sequence[Sequence[str]]) -> "Markov":
        inter = self._pairs_frame(sequences)
        self._fit_popularity(inter)
        nxt = inter.with_columns(
            pl.col("item").shift(-1).over("seq").alias("next")
        ).drop_nulls("next")
        self._pairs = nxt.group_by(["item", "next"]).agg(pl.len().alias("count"))
        self._succ_cache: dict[int, dict[str, list[str]]] = {}
        return self

    def successors(self, k: int) -> dict[str, list[str]]:
        """{item: up to k catalog successors, best first} (cached per k)."""
        self._check_fitted()
        if k not in self._succ_cache:
            rank = pl.DataFrame(
                {"next": list(self._pop_rank), "pop_rank": list(self._pop_rank.values())},
                schema={"next": pl.String, "pop_rank": pl.Int64},
            )
            # Inner join drops successors outside the catalog; pop_rank encodes popularity then
            # catalog order, so (count desc, pop_rank asc) is the documented tie-break.
            top = (
                self._pairs.join(rank, on="next", how="inner")
                .sort(["item", "count", "pop_rank"], descending=[False, True, False])
                .group_by("item", maintain_order=True)
                .agg(pl.col("next").head(k))
            )
            self._succ_cache[k] = dict(zip(top["item"].to_list(), top["next"].to_list()))
        return self._succ_cache[k]

    def recommend(self, histories: Sequence[Sequence[str]], k: int) -> list[list[str]]:
        pop = self._check_fitted()
        succ = self.successors(k)
        out = []
        for hist in histories:
            ranked = list(succ.get(str(hist[-1]), [])) if len(hist) else []
            if len(ranked) < k:
                seen = set(ranked)
                for item in pop:
                    if item not in seen:
                        ranked.append(item)
                        if len(ranked) == k:
                            break
            out.append(ranked)
        return out
