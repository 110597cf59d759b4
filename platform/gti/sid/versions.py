"""Versioned SID maps: the record of each version of a map and the lineage that lets a model
trained on one map version accept a later one.

What it is for: a catalog changes, so a map has versions. `SidMapVersion` is the record written
beside a map (`<map>.version.json`); `descends_from` / `check_map_for_model` decide whether a map
descends from a model's map (parent pointers, the same codebook identity, and every surviving
item keeping its SID, checked on the tables whenever they are available); `LineageDir` is a
folder of records and tables to look ancestors up in.

What it does not know: how a map is edited (`gti.sid.map_edits`), which map and model a run uses
and where its versions lie (`gti.run.versions`), embeddings, quantiser weights, models, Ray.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gti.common.errors import DataError
from gti.sid.mapfile import sid_map_hash

VERSION_SUFFIX = ".version.json"
SCHEMA_VERSION = 1


class UnrelatedSidMapError(DataError):
    """A SID map that does not descend from the map a model was trained with."""


class MissingSidTokensError(UnrelatedSidMapError):
    """A SID map that descends from the model's map but uses codes added after it (a grown last
    level): the model's vocabulary lacks their tokens."""


# --------------------------------------------------------------------------- hashes
def map_hash(table: pa.Table) -> str:
    """`sid_map_hash` of a map table (item_id -> sid, independent of row order): the hash the
    `sid` stage records (`gti.sid.mapfile.sid_map_hash`)."""
    return sid_map_hash(table.column("item_id").combine_chunks().cast(pa.string()),
                        table.column("sid").combine_chunks().cast(pa.string()))


def codebooks_hash(codebooks: Mapping[str, torch.Tensor] | str | Path) -> str:
    """sha256 (16 hex) of a codebooks dict {"level_l": [K, d]} or a codebooks.safetensors file:
    names, dtypes, shapes and bytes, in name order (independent of how the file was written)."""
    if isinstance(codebooks, (str, Path)):
        from safetensors.torch import load_file

        codebooks = load_file(str(codebooks))
    h = hashlib.sha256()
    for name in sorted(codebooks):
        t = torch.as_tensor(codebooks[name]).detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}\n".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- version records
@dataclass(frozen=True)
class SidMapVersion:
    """What identifies one version of a SID map (written beside it as JSON): its hash
    (`sid_map_hash`, as the `sid` stage records it), the parent's hash, item count, the
    codebooks' identity (`codebooks_hash`, sizes and token format that spell the vocabulary) and
    a creation time."""

    hash: str
    parent_hash: str | None
    n_items: int
    codebooks_hash: str
    codebook_sizes: tuple[int, ...]
    token_format: str
    created: float
    note: str = ""

    @property
    def codebook_identity(self) -> tuple[str, tuple[int, ...], str]:
        """Same identity = same code vectors and the same vocabulary spelling."""
        return (self.codebooks_hash, tuple(self.codebook_sizes), self.token_format)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["codebook_sizes"] = list(self.codebook_sizes)
        d["schema_version"] = SCHEMA_VERSION
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "<version>") -> "SidMapVersion":
        try:
            return cls(hash=str(d["hash"]), parent_hash=d.get("parent_hash"), n_items=int(d["n_items"]),
                       codebooks_hash=str(d["codebooks_hash"]),
                       codebook_sizes=tuple(int(k) for k in d["codebook_sizes"]),
                       token_format=str(d["token_format"]), created=float(d["created"]),
                       note=str(d.get("note", "")))
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"{source}: not a SID-map version record ({type(err).__name__}: {err})") from None


def make_version(table: pa.Table, codebooks_hash_: str, codebook_sizes: Sequence[int],
                 token_format: str = "<{level}_{code}>", parent: SidMapVersion | str | None = None,
                 created: float | None = None, note: str = "") -> SidMapVersion:
    """The version record of `table` (its hash computed from the table)."""
    parent_hash = parent.hash if isinstance(parent, SidMapVersion) else parent
    return SidMapVersion(hash=map_hash(table), parent_hash=parent_hash, n_items=table.num_rows,
                         codebooks_hash=codebooks_hash_, codebook_sizes=tuple(int(k) for k in codebook_sizes),
                         token_format=token_format, created=time.time() if created is None else float(created),
                         note=note)


def version_path(map_path: str | Path) -> Path:
    """sid_map.parquet -> sid_map.version.json (same folder)."""
    p = Path(map_path)
    return p.with_name(p.stem + VERSION_SUFFIX)


def write_version(map_path: str | Path, version: SidMapVersion) -> Path:
    """Write the record beside the map (atomically) and return its path."""
    from gti.common.files import atomic_write_bytes

    path = version_path(map_path)
    atomic_write_bytes(path, (json.dumps(version.to_dict(), indent=1, sort_keys=True) + "\n").encode())
    return path


def read_version(map_path: str | Path) -> SidMapVersion | None:
    """The record beside the map, or None when the map has none (a map from before versions)."""
    path = version_path(map_path)
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err.msg})") from None
    return SidMapVersion.from_dict(raw, str(path))


def write_map(map_path: str | Path, table: pa.Table, version: SidMapVersion) -> Path:
    """Write the map table and its record; DataError if the record's hash is not the table's."""
    got = map_hash(table)
    if got != version.hash:
        raise DataError(f"{map_path}: version record has hash {version.hash} but the table hashes to {got}")
    pq.write_table(table, str(map_path))
    return write_version(map_path, version)


class LineageDir:
    """A folder of version records `<hash>.json`, with optional tables `<hash>.parquet` (any
    mapping {hash: SidMapVersion} works too where a lineage is asked for)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def add(self, version: SidMapVersion, table: pa.Table | None = None) -> None:
        from gti.common.files import atomic_write_bytes

        if version.parent_hash == version.hash:
            raise DataError(f"lineage {self.folder}: version {version.hash} names itself as its parent")
        known = self.get(version.hash)
        if known is not None and known.parent_hash != version.parent_hash:
            # Rewriting it would cut the record's real link (and every older model's path).
            raise DataError(f"lineage {self.folder}: version {version.hash} is recorded with parent "
                            f"{known.parent_hash}, not {version.parent_hash}")
        self.folder.mkdir(parents=True, exist_ok=True)
        if table is not None:
            got = map_hash(table)
            if got != version.hash:
                raise DataError(f"lineage {self.folder}: table hashes to {got}, record says {version.hash}")
            pq.write_table(table, str(self.folder / f"{version.hash}.parquet"))
        atomic_write_bytes(self.folder / f"{version.hash}.json",
                           (json.dumps(version.to_dict(), indent=1, sort_keys=True) + "\n").encode())

    def get(self, h: str) -> SidMapVersion | None:
        p = self.folder / f"{h}.json"
        return SidMapVersion.from_dict(json.loads(p.read_text()), str(p)) if p.is_file() else None

    def table(self, h: str) -> pa.Table | None:
        p = self.folder / f"{h}.parquet"
        return pq.read_table(str(p)) if p.is_file() else None


Lineage = Mapping[str, SidMapVersion] | LineageDir | Callable[[str], SidMapVersion | None]


def _lookup(lineage: Lineage | None, h: str) -> SidMapVersion | None:
    if lineage is None:
        return None
    if isinstance(lineage, LineageDir):
        return lineage.get(h)
    if isinstance(lineage, Mapping):
        return lineage.get(h)
    return lineage(h)


def _lineage_table(lineage: Lineage | None, h: str) -> pa.Table | None:
    return lineage.table(h) if isinstance(lineage, LineageDir) else None


# --------------------------------------------------------------------------- descent
def chain_to(child: SidMapVersion, ancestor_hash: str, lineage: Lineage | None,
             max_depth: int = 10_000) -> tuple[list[SidMapVersion] | None, str]:
    """([child, parent, ..., ancestor], "") following parent pointers, or (None, reason)."""
    chain, seen = [child], {child.hash}
    cur = child
    while cur.hash != ancestor_hash:
        if cur.parent_hash is None:
            return None, f"its lineage ends at {cur.hash} (no parent) without reaching {ancestor_hash}"
        nxt = _lookup(lineage, cur.parent_hash)
        if nxt is None:
            if cur.parent_hash == ancestor_hash:
                return chain + [None], ""  # type: ignore[list-item]  # ancestor record unknown
            return None, f"the record of its ancestor {cur.parent_hash} is not in the lineage"
        if nxt.hash in seen or len(chain) > max_depth:
            return None, f"its lineage has a cycle at {nxt.hash}"
        seen.add(nxt.hash)
        chain.append(nxt)
        cur = nxt
    return chain, ""


def compare_tables(ancestor: pa.Table, child: pa.Table) -> dict[str, Any]:
    """How `child` relates to `ancestor`: {"changed": [(item_id, old_sid, new_sid)] (first 5),
    "n_changed", "n_removed", "n_added", "duplicate_sids"} (a descendant has n_changed 0 and
    duplicate_sids 0)."""
    a = dict(zip(ancestor.column("item_id").to_pylist(), ancestor.column("sid").to_pylist()))
    c_ids, c_sids = child.column("item_id").to_pylist(), child.column("sid").to_pylist()
    c = dict(zip(c_ids, c_sids))
    changed = [(i, s, c[i]) for i, s in a.items() if i in c and c[i] != s]
    return {"changed": changed[:5], "n_changed": len(changed), "n_removed": sum(i not in c for i in a),
            "n_added": sum(i not in a for i in c), "duplicate_sids": len(c_sids) - len(set(c_sids))}


def descent_problem(child: SidMapVersion, ancestor_hash: str, lineage: Lineage | None = None, *,
                    child_table: pa.Table | None = None, ancestor_table: pa.Table | None = None,
                    ancestor_identity: tuple[str, tuple[int, ...], str] | None = None) -> str | None:
    """None when `child` descends from the map `ancestor_hash`, else why not (one clause).

    Checks, in order: the child's record matches its table (when given); the parent pointers
    lead to the ancestor; every version on the way (and the ancestor, when its record or
    `ancestor_identity` is known) has the child's codebook identity; and, on the tables (given,
    or from a `LineageDir`), every ancestor item still present keeps its SID and no SID is shared.
    """
    if child_table is not None:
        got = map_hash(child_table)
        if got != child.hash:
            return f"its table hashes to {got}, not to its record's {child.hash}"
    chain, why = chain_to(child, ancestor_hash, lineage)
    if chain is None:
        return why
    newer = child.codebook_identity
    for v in chain[1:]:
        if v is None:
            continue
        if identity_problem(v.codebook_identity, newer) is not None:
            return (f"map {v.hash} on its lineage has other codebooks ({_ident_str(v.codebook_identity)} vs "
                    f"{_ident_str(newer)})")
        newer = v.codebook_identity
    if ancestor_identity is not None and identity_problem(tuple(ancestor_identity), newer) is not None:
        return f"the model's codebooks differ ({_ident_str(tuple(ancestor_identity))} vs {_ident_str(newer)})"
    if ancestor_table is None:
        ancestor_table = _lineage_table(lineage, ancestor_hash)
    if ancestor_table is not None:
        got = map_hash(ancestor_table)
        if got != ancestor_hash:
            return f"the ancestor table given hashes to {got}, not {ancestor_hash}"
        if child_table is None:
            child_table = _lineage_table(lineage, child.hash)
        if child_table is None:
            return "its table is not available to verify that old items keep their SIDs"
        diff = compare_tables(ancestor_table, child_table)
        if diff["n_changed"]:
            i, s_old, s_new = diff["changed"][0]
            return (f"{diff['n_changed']} item(s) of {ancestor_hash} changed SID (e.g. '{i}': {s_old} -> {s_new})")
        if diff["duplicate_sids"]:
            return f"it gives {diff['duplicate_sids']} SID(s) to more than one item"
    return None


def identity_problem(older: tuple[str, tuple[int, ...], str], newer: tuple[str, tuple[int, ...], str]) -> str | None:
    """None when a map with codebook identity `newer` may follow one with `older` on a lineage:
    the same codebooks hash, token format and sizes, except that the last level's size may
    have grown (codes added by a refresh, `gti.sid.map_edits.add_last_level_codes`); else why
    not (one clause)."""
    (h_old, s_old, f_old), (h_new, s_new, f_new) = older, newer
    s_old, s_new = [int(k) for k in s_old], [int(k) for k in s_new]
    if h_old != h_new:
        return f"codebooks {h_new} are not {h_old}"
    if f_old != f_new:
        return f"token format {f_new!r} is not {f_old!r}"
    if len(s_old) != len(s_new) or s_old[:-1] != s_new[:-1]:
        return f"codebook sizes {s_new} are not {s_old} (only the last level may grow)"
    if s_new[-1] < s_old[-1]:
        return f"the last level shrank from {s_old[-1]} to {s_new[-1]} codes"
    return None


def missing_tokens(model_sizes: Sequence[int], map_version: "SidMapVersion") -> list[str]:
    """The SID tokens `map_version` can use that a vocabulary spelling `model_sizes` lacks (the
    codes its grown last level added), in code order."""
    from gti.sid.codec import SidCodec, codes_added

    sizes = list(map_version.codebook_sizes)
    if len(sizes) != len(model_sizes):
        return []
    have = [min(int(a), int(b)) for a, b in zip(model_sizes, sizes)]
    codec = SidCodec(len(sizes), sizes, map_version.token_format)
    return [codec.token(lv, c) for lv, c in codes_added(have, sizes)]


def _ident_str(ident: tuple[str, tuple[int, ...], str]) -> str:
    return f"codebooks {ident[0]}, sizes {list(ident[1])}, format {ident[2]!r}"


def descends_from(child: SidMapVersion, ancestor_hash: str, lineage: Lineage | None = None, **tables) -> bool:
    """True when `child` descends from the map `ancestor_hash` (see `descent_problem`)."""
    return descent_problem(child, ancestor_hash, lineage, **tables) is None


def check_map_for_model(model_meta_hash: str | None, map_version: SidMapVersion, lineage: Lineage | None = None,
                        *, model_dir: str | Path | None = None, **tables) -> int:
    """Accept `map_version` for a model trained on the map `model_meta_hash` (its gti_meta.json
    `sid_map_hash`); return the number of versions between them (0 = the same map).

    Raises UnrelatedSidMapError naming both hashes when the map does not descend from the
    model's (other codebooks, an old item's SID changed, or no lineage between them).
    `tables` go to `descent_problem` (child_table, ancestor_table, ancestor_identity).
    """
    where = f"{model_dir}/gti_meta.json" if model_dir is not None else "the model"
    if not model_meta_hash:
        raise UnrelatedSidMapError(f"{where} records no sid_map_hash; cannot accept SID map {map_version.hash}")
    problem = descent_problem(map_version, model_meta_hash, lineage, **tables)
    if problem is not None:
        raise UnrelatedSidMapError(
            f"SID map {map_version.hash} does not descend from {model_meta_hash}, the map {where} was trained "
            f"with: {problem}")
    chain, _ = chain_to(map_version, model_meta_hash, lineage)
    _check_tokens(model_meta_hash, map_version, chain, tables.get("ancestor_identity"), where)
    return len(chain) - 1 if chain else 0


def _check_tokens(model_meta_hash: str, map_version: SidMapVersion, chain: list | None, ancestor_identity,
                  where: str) -> None:
    """MissingSidTokensError when the map uses codes added after the model's map (the model's
    sizes: `ancestor_identity`, else the ancestor's record on the chain; unknown: no check)."""
    ancestor = chain[-1] if chain else None
    sizes = (tuple(ancestor_identity)[1] if ancestor_identity is not None
             else ancestor.codebook_sizes if ancestor is not None else None)
    missing = missing_tokens(sizes, map_version) if sizes is not None else []
    if missing:
        shown = ", ".join(missing[:5]) + (f", ... ({len(missing)} in all)" if len(missing) > 5 else "")
        raise MissingSidTokensError(
            f"SID map {map_version.hash} descends from {model_meta_hash}, the map {where} was trained with, but "
            f"uses SID tokens added after it that the model's vocabulary lacks ({shown}); use the model of the "
            f"refresh that added them")
