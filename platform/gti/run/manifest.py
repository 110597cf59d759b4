"""Stage manifests, atomic writes and fingerprints.

What it is for: every stage leaves `run_dir/<stage>/_manifest.json` holding its resolved config,
input fingerprints, derived facts and package versions. The manifest is written last and
atomically (temp file + os.replace), so a stage directory without a manifest is incomplete, and
a stage directory with one is complete. Later stages read facts from here, never from paths a
person copied.

What it does not know: what any stage computes, or Ray.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from gti.common.errors import GtiError
from gti.common.files import atomic_write_json

MANIFEST_NAME = "_manifest.json"
_VERSIONED = ["gti", "torch", "ray", "transformers", "deepspeed", "pyarrow", "polars", "pydantic"]


class ManifestError(GtiError):
    """A manifest is missing, unreadable or inconsistent; the message names the file."""


def stable_hash(obj: Any) -> str:
    """sha256 of a JSON-serialisable object with sorted keys (first 16 hex digits)."""
    blob = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def file_fingerprint(path: str | Path, full_hash_below: int = 64 << 20) -> str:
    """Fingerprint of a file or directory tree.

    Files under `full_hash_below` bytes are hashed by content; larger ones by size and mtime
    (hashing terabytes to decide whether to skip a stage would defeat the purpose).
    """
    p = Path(path)
    h = hashlib.sha256()
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    if not files or not all(f.exists() for f in files):
        raise ManifestError(f"cannot fingerprint missing input: {p}")
    for f in files:
        st = f.stat()
        h.update(str(f.relative_to(p) if p.is_dir() else f.name).encode())
        if st.st_size < full_hash_below:
            h.update(f.read_bytes())
        else:
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def package_versions() -> dict[str, str]:
    out = {}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


@dataclass
class Manifest:
    stage: str
    fingerprint: str
    config: dict[str, Any]
    inputs: dict[str, str] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=package_versions)
    created: float = field(default_factory=time.time)
    duration_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "fingerprint": self.fingerprint,
            "config": self.config,
            "inputs": self.inputs,
            "facts": self.facts,
            "outputs": self.outputs,
            "versions": self.versions,
            "created": self.created,
            "duration_s": self.duration_s,
        }

    def write(self, stage_dir: str | Path) -> Path:
        """Write `_manifest.json`; every string in it has the credentials of its URIs removed
        (`gti.common.redact.redact_text`: a path or an error quoted in the facts)."""
        from gti.common.redact import redact_strings

        path = Path(stage_dir) / MANIFEST_NAME
        atomic_write_json(path, redact_strings(self.to_json()))
        return path

    @classmethod
    def read(cls, stage_dir: str | Path) -> "Manifest":
        path = Path(stage_dir) / MANIFEST_NAME
        if not path.is_file():
            raise ManifestError(f"no manifest at {path}: has the stage run?")
        try:
            raw = json.loads(path.read_text())
            return cls(**raw)
        except (json.JSONDecodeError, TypeError) as err:
            raise ManifestError(f"unreadable manifest {path}: {err}") from None

    def output(self, stage_dir: str | Path, name: str) -> Path:
        """Absolute path of a named output of this stage."""
        if name not in self.outputs:
            raise ManifestError(
                f"stage '{self.stage}' has no output '{name}' (has: {sorted(self.outputs)})"
            )
        return Path(stage_dir) / self.outputs[name]

    def fact(self, name: str) -> Any:
        if name not in self.facts:
            raise ManifestError(f"stage '{self.stage}' manifest has no fact '{name}'")
        return self.facts[name]
