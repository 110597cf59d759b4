"""gti/lm/chat.py: template parsing and fitting token segments into a budget."""

from __future__ import annotations

import pytest

from gti.common.errors import ConfigError
from gti.lm.chat import fit_segments, parse_template


def test_parse_template_splits_text_and_slots_and_names_unknown_slots():
    pieces = parse_template("Which item has the title: {title}?", {"title"}, "title2sid")
    assert [(p.kind, p.value) for p in pieces] == [("text", "Which item has the title: "), ("slot", "title"),
                                                   ("text", "?")]
    with pytest.raises(ConfigError, match=r"template 'x': unknown slot \{sid\}"):
        parse_template("{sid}", {"title"}, "x")


def test_fit_segments_cuts_the_longest_cuttable_text_first_and_exactly_the_excess():
    segs = [([1] * 3, False), ([2] * 10, True), ([3] * 4, True)]
    ids, cut = fit_segments(segs, 12, "row")
    assert cut and sum(map(len, ids)) == 12 and ids[0] == [1] * 3
    assert len(ids[1]) == 5 and len(ids[2]) == 4  # the long text lost 5, the short one nothing
    assert fit_segments(segs, 100, "row") == ([s for s, _ in segs], False)
    with pytest.raises(ConfigError, match="pairs.max_len=4 is too small"):
        fit_segments(segs, 4, "row")
