"""gti/serve/search.py: the compact catalog index ranks exactly as the full sort it replaced
(`sorted((id != text, not key.startswith(text), row))[:limit]` over every hit), ties included:
same titles, ids equal but for case, empty titles, the empty text, NUL and newline in titles
and in the text, non-ASCII case rules; and it holds one buffer, not an object per item."""

from __future__ import annotations

import random

import pytest

from gti.serve.search import CatalogIndex


def full_sort(ids, titles, text, limit):
    """What RecommenderService.search did before the index: every hit sorted."""
    needle = text.strip().lower()
    keys = [(i.lower(), f"{titles.get(i, '')}\n{i}".lower()) for i in ids]
    hits = [(item != needle, not key.startswith(needle), row) for row, (item, key) in enumerate(keys) if needle in key]
    return [row for *_, row in sorted(hits)[:limit]]


def test_ties_keep_catalog_order():
    ids = ["b2", "B1", "a", "b1", "c", "d"]
    titles = {"b2": "Beaker", "B1": "Beaker", "a": "beaker set", "b1": "Beaker", "c": "glass beaker", "d": ""}
    idx = CatalogIndex.build(ids, titles)
    assert idx.search("beaker", 10) == [0, 1, 2, 3, 4]  # same rank: row order
    assert idx.search("B1", 10) == [1, 3]  # both ids equal "b1" but for case: rows in order
    assert idx.search("  BEAKER ", 2) == [0, 1]
    assert idx.search("glass", 10) == [4] and idx.search("nothing", 10) == []
    assert idx.search("", 4) == [0, 1, 2, 3]  # the empty text: catalog order
    assert idx.search("a", 10) == [2, 0, 1, 3, 4]  # the item with that id first, then titles holding it
    assert idx.search("beaker", 0) == []
    for text in ("beaker", "b1", "", "r\nb", "a", "d"):
        for limit in (1, 2, 3, 10):
            assert idx.search(text, limit) == full_sort(ids, titles, text, limit), (text, limit)


def test_a_match_never_spans_two_items():
    ids = ["x1", "x2", "x3"]
    titles = {"x1": "ends with ab", "x2": "c\x00nul and\nnewline", "x3": "abc"}
    idx = CatalogIndex.build(ids, titles)
    for text in ("x1\x00", "ab\x00", "b\nx1", "\x00", "\n", "x1\x00c", "nul", "c\x00n", "newline\nx2"):
        assert idx.search(text, 5) == full_sort(ids, titles, text, 5), repr(text)


@pytest.mark.parametrize("seed", range(3))
def test_random_catalogs_rank_as_the_full_sort(seed):
    rng = random.Random(seed)
    alpha = ["a", "b", "A", "B", "\n", "\x00", "é", "É", "Σ", "σ", " ", "ß", "İ", "😀"]
    for _ in range(300):
        ids = ["".join(rng.choice("abAB") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 25))]
        titles = {i: "".join(rng.choice(alpha) for _ in range(rng.randint(0, 6))) for i in ids if rng.random() < 0.8}
        idx = CatalogIndex.build(ids, titles)
        for _ in range(8):
            text = "".join(rng.choice(alpha) for _ in range(rng.randint(0, 3)))
            if ids and rng.random() < 0.3:
                text = rng.choice(ids).upper()
            limit = rng.randint(1, 8)
            assert idx.search(text, limit) == full_sort(ids, titles, text, limit), (ids, titles, text, limit)


def test_one_buffer_not_an_object_per_item():
    ids = [f"it{i}" for i in range(5000)]
    titles = {i: f"Title of {i}" for i in ids}
    idx = CatalogIndex.build(ids, titles)
    keys = sum(len(f"{titles[i]}\n{i}") + 1 for i in ids)
    assert len(idx.text) == keys + 1 and idx.nbytes == len(idx.text) + 3 * 8 * len(ids) + 8
    assert idx.search("title of it49", 3) == [49, 490, 491]
