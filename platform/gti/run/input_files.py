"""The fingerprint of the user's input files: what tells a rerun that its data changed.

What it is for: `fingerprint_files(path, kind, storage_options)` is the ingest stage's input
fingerprint of `data.items.path` / `data.interactions.path` (its `input_fingerprints`) and
`gti refresh`'s of its new files (what a work folder may be reused for). The files are the
ones the readers would read (`gti.data.sources.expand_paths`: a file, a folder, a glob, a
URI); a local file counts by its content (a large one by size and mtime,
`gti.run.manifest.file_fingerprint`), a URI by its size and mtime from its file system (never
downloaded; a presigned query is left out, its signature changes with every signing). A URI
that cannot be stat'ed is an `UnreadableFileError` naming it.

What it does not know: what the rows hold (a changed file is a changed input), Ray.
"""

from __future__ import annotations

import os

from gti.data.sources import READ_ERRORS, error_reason, expand_paths, filesystem
from gti.common.errors import UnreadableFileError
from gti.run.manifest import file_fingerprint, stable_hash


def fingerprint_files(path: str, kind: str, storage_options=None) -> str:
    """Fingerprint of the files `path` names: a local file by content (large ones by size and
    mtime, `gti.run.manifest.file_fingerprint`), a URI by its size and mtime from the file system
    (never downloaded; `gti refresh` fingerprints its new files the same way)."""
    parts = []
    for f in expand_paths(path, kind, storage_options):
        if "://" in f and not f.startswith("file://"):
            try:
                fs, p = filesystem(f, storage_options)
                info = fs.get_file_info(p)
            except (*READ_ERRORS, ValueError) as err:
                raise UnreadableFileError(f, f"cannot stat: {error_reason(err)}") from None
            # The URI without a presigned query (its signature changes with every signing).
            parts.append(f"{f.split('?', 1)[0]}:{info.size}:{info.mtime_ns}")
        else:
            parts.append(f"{os.path.basename(f)}:{file_fingerprint(f)}")
    return stable_hash(parts)
