"""Atomic writes, fingerprints and manifest round trips."""

import json
import os

import pytest

from gti.run.manifest import Manifest, ManifestError, file_fingerprint, stable_hash
from gti.common.files import atomic_write_bytes


def test_manifest_round_trip(tmp_path):
    m = Manifest(stage="sid", fingerprint="abc", config={"x": 1}, facts={"levels": 3},
                 outputs={"sid_map": "sid_map.parquet"})
    m.write(tmp_path)
    back = Manifest.read(tmp_path)
    assert back.facts == {"levels": 3} and back.fingerprint == "abc"
    assert back.output(tmp_path, "sid_map") == tmp_path / "sid_map.parquet"
    assert "torch" in back.versions
    with pytest.raises(ManifestError, match="no output 'nope'"):
        back.output(tmp_path, "nope")
    with pytest.raises(ManifestError, match="no fact"):
        back.fact("nope")


def test_missing_and_corrupt_manifest(tmp_path):
    with pytest.raises(ManifestError, match="no manifest"):
        Manifest.read(tmp_path)
    (tmp_path / "_manifest.json").write_text("{half")
    with pytest.raises(ManifestError, match="unreadable"):
        Manifest.read(tmp_path)


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "f.json"
    atomic_write_bytes(target, b"old")

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]  # no temp file left behind


def test_atomic_write_permission_error_is_clear(tmp_path, monkeypatch):
    # Simulated, because the suite runs as root (which ignores directory permissions).
    import tempfile

    (tmp_path / "f").write_bytes(b"keep")

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(PermissionError, match="Permission denied"):
        atomic_write_bytes(tmp_path / "f", b"new")
    assert (tmp_path / "f").read_bytes() == b"keep"


def test_fingerprints_change_with_content(tmp_path):
    f = tmp_path / "a.csv"
    f.write_text("1,2\n")
    fp1 = file_fingerprint(f)
    f.write_text("1,3\n")
    assert file_fingerprint(f) != fp1
    d = tmp_path / "dir"
    d.mkdir()
    (d / "x").write_text("x")
    fpd = file_fingerprint(d)
    (d / "y").write_text("y")
    assert file_fingerprint(d) != fpd
    with pytest.raises(ManifestError, match="missing input"):
        file_fingerprint(tmp_path / "missing")
    assert stable_hash({"a": 1, "b": 2}) == stable_hash({"b": 2, "a": 1})
    assert json.loads(json.dumps(stable_hash([1])))
