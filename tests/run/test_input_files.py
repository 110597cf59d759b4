"""gti/run/input_files.py: the user's input files fingerprinted file by file, local ones by content
(URIs by size and mtime: tests/refresh/test_command.py, on an in-memory file system)."""

from __future__ import annotations

from gti.run.input_files import fingerprint_files


def test_input_files_are_fingerprinted_by_content_file_by_file(tmp_path):
    """The user's input files a data path names (a file or a folder of them): a changed file or
    one more file changes the fingerprint; a copy of the same files elsewhere does not."""
    d = tmp_path / "items"
    d.mkdir()
    (d / "a.csv").write_text("item_id,title\n1,A\n")
    one = fingerprint_files(str(d), "items")
    assert fingerprint_files(str(d / "a.csv"), "items") == one
    (d / "b.csv").write_text("item_id,title\n2,B\n")
    two = fingerprint_files(str(d), "items")
    assert two != one
    (d / "b.csv").write_text("item_id,title\n2,C\n")
    assert fingerprint_files(str(d), "items") != two
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in d.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert fingerprint_files(str(copy), "items") == fingerprint_files(str(d), "items")
