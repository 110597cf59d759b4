"""gti/eval/recommend.py: the pure top-K over any loaded run (a stand-in here, no model) and the
text table. The real model path is tested with a tiny run in tests/run/test_loaded.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gti.common.errors import DataError, GtiError
from gti.eval.recommend import format_recommendations, top_k


def _run():
    return SimpleNamespace(sid_ids={"a": np.array([1, 2]), "b": np.array([1, 3])}, item_ids=["a", "b"])


def test_history_is_checked_before_any_decoding():
    with pytest.raises(DataError, match="history is empty"):
        top_k(_run(), [" ", ""], k=1)
    with pytest.raises(GtiError, match="k must be >= 1"):
        top_k(_run(), ["a"], k=0)
    with pytest.raises(DataError, match=r"unknown item id\(s\) in history: x, y; they have no SID in here"):
        top_k(_run(), ["a", "x", "y", "x"], k=1, where="here")


def test_table_has_a_row_per_item_and_cuts_long_titles():
    recs = [{"item_id": "it1", "title": "T" * 80, "score": -1.5, "sid": "<a_1><b_2>"},
            {"item_id": "it22", "title": "short", "score": -2.25, "sid": "<a_1><b_3>"}]
    lines = format_recommendations(recs, title_width=20).splitlines()
    assert lines[0].split() == ["rank", "item_id", "score", "sid", "title"]
    assert lines[1].split()[:4] == ["1", "it1", "-1.5000", "<a_1><b_2>"] and lines[1].endswith("T" * 17 + "...")
    assert lines[2].split()[1] == "it22" and lines[2].endswith("short")
