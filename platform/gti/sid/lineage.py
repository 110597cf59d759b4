"""Which SID map a model may be used with, and where a run keeps its refreshed map versions.

What it is for (issue 15, "versioned SID maps in use"):
- `check_model_map(model_dir, map_hash, map_path=..., lineage=...)`: the one check that
  evaluation (`gti.stages.evaluate`) and `gti recommend` (`gti.run_artifacts.LoadedRun`) run before
  decoding. A model records the SID map it was trained with (`gti_meta.json`: `sid_map_hash`,
  and after a refresh `sid_map_parent` and `sid_map_version`, the version record). The map is
  accepted when it is that map, or when it *descends* from it (`gti.sid.versions`: the parent
  pointers lead there, same codebooks, the last level may have grown, every old item still
  present keeps its SID; a removed item simply leaves the trie). Returns the number of
  versions between them (0 = same map). Otherwise `UnrelatedSidMapError` (a DataError) with
  one line naming both hashes; a map without any version record keeps the old wording ("stale
  SID map, rerun the stages after 'sid'"). A descendant whose grown last level has codes the
  model's map lacks (`refresh.on_full_group: add_tokens`) is refused with
  `MissingSidTokensError`, naming the tokens: that model's vocabulary has no row for them.
- The layout `gti refresh` writes (gti/refresh/):
  `<run_dir>/refresh/lineage/` (a `LineageDir`: `<hash>.json` + `<hash>.parquet` of the run's
  base map and of every refreshed version) and `<run_dir>/refresh/v<k>/` (k = 1, 2, ...), each
  with `_manifest.json`, `sid/sid_map.parquet` + `sid/sid_map.version.json` (the new map and
  its record, parent hash included), `ingest/` (the new items, their quarantine, the merged
  sequences) and `model/` (the refreshed model). `versions(run_dir)` lists the finished ones,
  `latest_version(run_dir)` the newest, which `gti recommend --run-dir R` uses by default.
- `find_lineage(map_path)`: the lineage folder of the run a map file belongs to (the first
  ancestor folder holding `refresh/lineage/`), so a check given only a map path finds it.

What it does not know: models beyond their `gti_meta.json`, training, Ray. Pure.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from gti.sid.versions import LineageDir, SidMapVersion, UnrelatedSidMapError, check_map_for_model, read_version

REFRESH_DIR = "refresh"
LINEAGE_DIR = "lineage"
MAP_REL = "sid/sid_map.parquet"  # inside a version folder
MODEL_REL = "model"
META_NAME = "gti_meta.json"  # as gti.lm.vocab.META_NAME (not imported: lm sits above sid)
MANIFEST = "_manifest.json"
_VDIR = re.compile(r"^v(\d+)$")


@dataclass(frozen=True)
class RunVersion:
    """One finished refresh of a run: `<run_dir>/refresh/v<k>/`."""

    k: int
    dir: Path

    @property
    def map_path(self) -> Path:
        return self.dir / MAP_REL

    @property
    def model_dir(self) -> Path:
        return self.dir / MODEL_REL

    @property
    def items_path(self) -> Path:
        return self.dir / "ingest" / "items.parquet"

    @property
    def sequences_path(self) -> Path:
        return self.dir / "ingest" / "sequences.parquet"

    def version(self) -> SidMapVersion:
        v = read_version(self.map_path)
        if v is None:
            from gti.errors import DataError

            raise DataError(f"{self.map_path}: refreshed SID map without its version record")
        return v


def refresh_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / REFRESH_DIR


def lineage_dir(run_dir: str | Path) -> LineageDir:
    return LineageDir(refresh_root(run_dir) / LINEAGE_DIR)


def versions(run_dir: str | Path) -> list[RunVersion]:
    """Finished refresh versions of a run (those with a manifest), oldest first."""
    root = refresh_root(run_dir)
    out = []
    if root.is_dir():
        for p in root.iterdir():
            m = _VDIR.match(p.name)
            if m and p.is_dir() and (p / MANIFEST).is_file():
                out.append(RunVersion(int(m.group(1)), p))
    return sorted(out, key=lambda v: v.k)


def latest_version(run_dir: str | Path) -> RunVersion | None:
    vs = versions(run_dir)
    return vs[-1] if vs else None


def find_lineage(map_path: str | Path) -> LineageDir | None:
    """The lineage folder of the run `map_path` lies in, or None (a run never refreshed)."""
    p = Path(map_path).resolve()
    for folder in p.parents:
        cand = folder / REFRESH_DIR / LINEAGE_DIR
        if cand.is_dir():
            return LineageDir(cand)
    return None


def model_meta(model_dir: str | Path) -> dict:
    p = Path(model_dir) / META_NAME
    return json.loads(p.read_text()) if p.is_file() else {}


def check_model_map(model_dir: str | Path, map_hash: str | None, *, map_path: str | Path | None = None,
                    lineage: LineageDir | None = None) -> int:
    """Accept the SID map (`map_hash`, the file `map_path`) for the model in `model_dir`.

    0 when the model was trained with this very map; k > 0 when the map descends from the
    model's map through k versions (checked on the tables: old items keep their SIDs, same
    codebook identity). Raises UnrelatedSidMapError naming both hashes otherwise. Reads the map
    table only when the hashes differ and a version record exists.
    """
    meta = model_meta(model_dir)
    got = meta.get("sid_map_hash")
    version = read_version(map_path) if map_path is not None and Path(map_path).is_file() else None
    if version is not None:
        if map_hash is not None and version.hash != map_hash:
            raise UnrelatedSidMapError(
                f"{version_path_str(map_path)} records hash {version.hash} but the map is given as {map_hash}")
        map_hash = version.hash
    if got and got == map_hash:
        return 0
    if lineage is None and map_path is not None:
        lineage = find_lineage(map_path)
    if version is None and lineage is not None and map_hash is not None:
        version = lineage.get(map_hash)
    if version is None or not got:
        raise UnrelatedSidMapError(
            f"{model_dir}/{META_NAME} has sid_map_hash {got or '<none recorded>'} but the SID map's "
            f"sid_map_hash is {map_hash}: stale SID map, rerun the stages after 'sid'")
    import pyarrow.parquet as pq

    table = pq.read_table(str(map_path)) if map_path is not None and Path(map_path).is_file() else None
    if table is None and lineage is not None:
        table = lineage.table(version.hash)
    ident = None
    rec = meta.get("sid_map_version")
    if isinstance(rec, dict) and rec.get("hash") == got:
        model_version = SidMapVersion.from_dict(rec, f"{model_dir}/{META_NAME}")
        ident = model_version.codebook_identity
    return check_map_for_model(got, version, lineage, model_dir=model_dir, child_table=table,
                               ancestor_identity=ident)


def version_path_str(map_path: str | Path | None) -> str:
    from gti.sid.versions import version_path

    return str(version_path(map_path)) if map_path is not None else "<map>"
