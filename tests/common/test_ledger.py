"""gti.common.ledger: the append-only record of Train runs and Ray instances a command started."""

from __future__ import annotations

import pytest


def test_ledger_notes_only_when_its_variable_is_set(tmp_path, monkeypatch):
    from gti.common import ledger

    path = tmp_path / "ledger.jsonl"
    monkeypatch.delenv(ledger.ENV, raising=False)
    ledger.note("train", "x")
    assert not path.exists()
    monkeypatch.setenv(ledger.ENV, str(path))
    ledger.note("train", "a")
    ledger.note("ray", "b")
    path.open("a").write('{"kind": "train", "na')  # a line cut by a killed writer is skipped
    assert ledger.counts(ledger.read(path)) == {"train": 1, "ray": 1}
    with pytest.raises(ValueError, match="ledger kind"):
        ledger.note("gpu", "c")
