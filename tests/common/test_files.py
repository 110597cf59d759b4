"""gti/common/files.py: atomic writes leave the old file or the new one, never half."""

from __future__ import annotations

import json

import pytest

from gti.common.files import atomic_write_bytes, atomic_write_json


def test_write_replaces_and_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "sub" / "m.json"
    atomic_write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}

    with pytest.raises(TypeError):
        atomic_write_bytes(path, None)  # nothing written: not bytes
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in path.parent.iterdir()] == ["m.json"]  # no temp file left behind
