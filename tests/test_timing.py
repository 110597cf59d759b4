"""gti.timing: named phases add up, seconds measured elsewhere are added, facts end in _s."""

from __future__ import annotations

import time

import pytest

from gti.timing import Timer, rate


def test_phases_add_up_and_total_covers_them():
    t = Timer()
    with t.phase("read"):
        time.sleep(0.01)
    with t.phase("read"):
        time.sleep(0.01)
    t.add("encode", 2.5)  # e.g. summed over actors: may exceed the wall time
    facts = t.facts()
    assert set(facts) == {"read_s", "encode_s", "total_s"}
    assert facts["read_s"] >= 0.02 and facts["encode_s"] == 2.5
    assert facts["total_s"] >= facts["read_s"]


def test_a_phase_that_raises_still_counts():
    t = Timer()
    with pytest.raises(ValueError):
        with t.phase("write"):
            raise ValueError("boom")
    assert "write_s" in t.facts()


def test_rate():
    assert rate(100, 4.0) == 25.0 and rate(5, 0.0) == 0.0
