"""gti.common.timing: named phases add up, seconds measured elsewhere are added, facts end in _s."""

from __future__ import annotations

import time

import pytest

from gti.common.timing import Timer, peak_rss_mb, rate, reset_peak_rss


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


def _hold_mb(mb: int) -> None:
    """Touch `mb` MB of fresh memory, then free it (the peak stays)."""
    import numpy as np

    a = np.ones(mb * 2**20 // 8)
    assert a.sum() > 0


@pytest.mark.skipif(peak_rss_mb() is None or not reset_peak_rss(), reason="needs Linux /proc clear_refs")
def test_memory_peaks_per_phase_are_reset_between_phases():
    t = Timer(memory=True)
    with t.phase("big"):
        _hold_mb(300)
    with t.phase("small"):
        _hold_mb(10)
    m = t.memory_facts()
    assert set(m) == {"big_peak_mb", "small_peak_mb"}
    # The 300 MB phase's peak is not carried into the next phase: the peak is reset at its start.
    assert m["big_peak_mb"] - m["small_peak_mb"] > 200


@pytest.mark.skipif(peak_rss_mb() is None or not reset_peak_rss(), reason="needs Linux /proc clear_refs")
def test_nested_phase_counts_from_its_outer_phase_and_reentry_keeps_the_larger_peak():
    t = Timer(memory=True)
    with t.phase("outer"):
        _hold_mb(200)
        with t.phase("inner"):  # no reset inside a phase: the outer's 200 MB stays in its peak
            _hold_mb(10)
    with t.phase("base"):
        _hold_mb(10)
    with t.phase("outer"):  # a second, small entry: the first one's peak is kept
        _hold_mb(10)
    m = t.memory_facts()
    assert m["inner_peak_mb"] - m["base_peak_mb"] > 150
    assert m["outer_peak_mb"] - m["base_peak_mb"] > 150


def test_no_memory_facts_unless_asked():
    t = Timer()
    with t.phase("read"):
        pass
    assert t.memory_facts() == {}
