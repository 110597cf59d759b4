"""Versioned SID maps: adding items to a frozen map, removing them, and the lineage that lets a
model trained on one map version accept a later one.

What it is for (issue 15, "catalogs change"):
- `assign_new_items(existing_map, new_item_ids, new_codes_prefix, codebook_sizes, ...)`: given
  the frozen quantiser's codes for new items (its levels only, without the de-duplication
  level) and the existing map, give every new item a full SID without changing any existing
  item's SID. With a de-duplication level (`sid.dedup: extra_level`), the extra code is the
  smallest one free within the item's prefix group (equal quantiser codes). Without one, a new
  item takes its quantiser codes when that SID is free; if it is taken and the caller passes
  `last_cost` (distances to the last codebook, as `dedup_reassign` uses), the cheapest
  last-level code still free under its first L-1 codes. An item that fits nowhere (its group
  already uses every code of the extra level, or no free code is left) is returned in
  `needs_new_tokens` with a reason: never dropped, never given a duplicate. Ids already in the
  map keep their old SID and are reported (`already_present`, and `prefix_changed` when the
  quantiser now puts them elsewhere).
- `remove_items(map, ids)`: a removed item simply leaves the map (and so the trie).
- `SidMapVersion`: the record written beside a map (`<map>.version.json`): its hash
  (`sid_map_hash`, the same function the `sid` stage uses), the parent's hash, item count,
  the codebooks' identity (`codebooks_hash` of codebooks.safetensors, plus the codebook sizes
  and token format that spell the vocabulary) and a creation time.
- `descends_from(...)`, `check_map_for_model(...)`: a map *descends* from the model's map when
  the parent pointers lead there, every version on the way has the same codebook identity, and
  (checked on the tables whenever they are available, never only by the pointers) every item of
  the ancestor map that is still present has the same SID. `check_map_for_model` raises
  `UnrelatedSidMapError` with one line naming both hashes otherwise.
- `LineageDir(folder)`: a folder of version records (`<hash>.json`) and, optionally, their
  tables (`<hash>.parquet`) to look ancestors up in; any mapping {hash: SidMapVersion} works too.

A SID map is a pyarrow table `item_id` str, `codes` list<int32>, `sid` str (the `sid` stage's
sid_map.parquet). What it does not know: embeddings, quantiser weights, models, Ray.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from gti.errors import DataError
from gti.sid.codec import SidCodec
from gti.sid.mapfile import sid_map_hash

VERSION_SUFFIX = ".version.json"
SCHEMA_VERSION = 1
MAP_SCHEMA = pa.schema([("item_id", pa.string()), ("codes", pa.list_(pa.int32())), ("sid", pa.string())])


class UnrelatedSidMapError(DataError):
    """A SID map that does not descend from the map a model was trained with."""


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


# --------------------------------------------------------------------------- map tables
def map_table(item_ids: Sequence[str], codes: Sequence[Sequence[int]] | np.ndarray, codec: SidCodec) -> pa.Table:
    """A SID-map table from ids and full codes [N, L] (SID strings spelled by `codec`)."""
    rows = [list(map(int, c)) for c in np.asarray(codes, dtype=np.int64).reshape(len(item_ids), codec.levels)]
    return pa.table({"item_id": [str(i) for i in item_ids], "codes": rows,
                     "sid": [codec.to_string(r) for r in rows]}, schema=MAP_SCHEMA)


def _codes_matrix(table: pa.Table) -> np.ndarray:
    """int64 [N, L] codes of a map table (DataError if rows differ in length)."""
    col = table.column("codes").combine_chunks()
    if len(col) == 0:
        return np.zeros((0, 0), dtype=np.int64)
    lens = np.asarray(pc.list_value_length(col).to_numpy(zero_copy_only=False))
    if (lens != lens[0]).any():
        raise DataError(f"SID map: codes rows have different lengths {sorted(set(lens.tolist()))}")
    return np.asarray(col.flatten().to_numpy(zero_copy_only=False), dtype=np.int64).reshape(len(col), int(lens[0]))


def remove_items(table: pa.Table, item_ids: Sequence[str]) -> tuple[pa.Table, list[str], list[str]]:
    """(map without `item_ids`, ids removed, ids that were not in the map). Every other row keeps
    its SID and its position; a removed item simply leaves the trie."""
    drop = {str(i) for i in item_ids}
    ids = table.column("item_id").to_pylist()
    keep = [i for i, iid in enumerate(ids) if iid not in drop]
    present = set(ids)
    removed = [i for i in dict.fromkeys(map(str, item_ids)) if i in present]
    missing = [i for i in dict.fromkeys(map(str, item_ids)) if i not in present]
    return table.take(pa.array(keep, pa.int64())), removed, missing


@dataclass(frozen=True)
class NeedsNewToken:
    """A new item that cannot get a unique SID from the existing vocabulary."""

    item_id: str
    codes: tuple[int, ...]  # the quantiser's codes (prefix levels)
    reason: str


@dataclass
class Assignment:
    """Result of `assign_new_items`.

    table: the new map: every existing row unchanged and in place, then the assigned new items
        in input order.
    assigned: ids of the new items that got a SID (in input order).
    already_present: ids that were in the map already (their SID is kept).
    prefix_changed: the subset of `already_present` whose quantiser codes now differ from the
        prefix of their kept SID (text changed; a full refresh would move them).
    needs_new_tokens: items left out because no free code exists for them, with the reason.
    """

    table: pa.Table
    assigned: list[str] = field(default_factory=list)
    already_present: list[str] = field(default_factory=list)
    prefix_changed: list[str] = field(default_factory=list)
    needs_new_tokens: list[NeedsNewToken] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{len(self.assigned)} new items assigned, {len(self.already_present)} already present "
                f"({len(self.prefix_changed)} with changed codes, SIDs kept), "
                f"{len(self.needs_new_tokens)} need new tokens")


def assign_new_items(
    existing_map: pa.Table,
    new_item_ids: Sequence[str],
    new_codes_prefix: Sequence[Sequence[int]] | np.ndarray | torch.Tensor,
    codebook_sizes: Sequence[int],
    token_format: str = "<{level}_{code}>",
    *,
    last_cost: np.ndarray | torch.Tensor | None = None,
) -> Assignment:
    """Full SIDs for new items that leave every existing SID unchanged (see module doc).

    existing_map: the current map (item_id, codes, sid).
    new_item_ids: [M] ids (unique).
    new_codes_prefix: [M, Lq] codes of the frozen quantiser (`quantizer.encode`), Lq = its levels.
    codebook_sizes: the map's codebook sizes (the `sid` facts' `codebook_sizes`, incl. the
        de-duplication level when the map has one); the vocabulary never grows here.
    last_cost: optional [M, K_last] costs of the last quantiser level (maps without a
        de-duplication level only): a new item whose SID is taken moves to the cheapest free
        last-level code under its first L-1 codes, as `gti.sid.resolve.dedup_reassign` does.

    Deterministic: new items are taken in input order; each gets the smallest free extra code.
    """
    sizes = [int(k) for k in codebook_sizes]
    codec = SidCodec(len(sizes), sizes, token_format)
    ids = [str(i) for i in new_item_ids]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise DataError(f"new items: item_id '{dup}' appears more than once")
    pre = np.asarray(torch.as_tensor(new_codes_prefix).cpu().numpy() if isinstance(new_codes_prefix, torch.Tensor)
                     else new_codes_prefix, dtype=np.int64)
    if pre.size == 0:
        pre = pre.reshape(len(ids), -1)
    if pre.ndim != 2 or pre.shape[0] != len(ids):
        raise DataError(f"new items: codes have shape {list(pre.shape)} for {len(ids)} ids")
    lq, levels = pre.shape[1], len(sizes)
    extra = levels - lq
    if extra not in (0, 1):
        raise DataError(f"new items: quantiser gives {lq} levels but the map has {levels} "
                        f"(codebook_sizes {sizes}); expected {levels} or {levels - 1}")
    for lv in range(lq):
        bad = np.nonzero((pre[:, lv] < 0) | (pre[:, lv] >= sizes[lv]))[0]
        if bad.size:
            raise DataError(f"new item '{ids[bad[0]]}': code {int(pre[bad[0], lv])} at level {lv} is "
                            f"outside 0..{sizes[lv] - 1}")
    if last_cost is not None and extra:
        raise DataError("new items: last_cost only applies to maps without a de-duplication level")
    cost = None if last_cost is None else np.asarray(torch.as_tensor(last_cost).float().cpu().numpy())
    if cost is not None and cost.shape != (len(ids), sizes[-1]):
        raise DataError(f"new items: last_cost has shape {list(cost.shape)}, expected [{len(ids)}, {sizes[-1]}]")

    old = _codes_matrix(existing_map)
    if old.shape[0] and old.shape[1] != levels:
        raise DataError(f"SID map has {old.shape[1]} levels but codebook_sizes {sizes} has {levels}")
    old_ids = existing_map.column("item_id").to_pylist()
    old_pos = {iid: i for i, iid in enumerate(old_ids)}
    # Used codes: full SIDs, and per group (prefix for the extra level; first L-1 codes without
    # one) the set of codes taken at the last level.
    taken: set[tuple[int, ...]] = set(map(tuple, old.tolist()))
    if len(taken) != old.shape[0]:
        raise DataError("SID map: existing map has duplicate SIDs")
    group_used: dict[tuple[int, ...], set[int]] = {}
    for row in old.tolist():
        group_used.setdefault(tuple(row[:-1]), set()).add(row[-1])

    out = Assignment(table=existing_map)
    new_ids, new_codes = [], []
    k_last = sizes[-1]
    for m, iid in enumerate(ids):
        p = tuple(int(c) for c in pre[m])
        if iid in old_pos:
            out.already_present.append(iid)
            if tuple(old[old_pos[iid], :lq].tolist()) != p:
                out.prefix_changed.append(iid)
            continue
        if extra:
            used = group_used.setdefault(p, set())
            free = next((c for c in range(k_last) if c not in used), None)
            if free is None:
                out.needs_new_tokens.append(NeedsNewToken(iid, p, (
                    f"prefix {''.join(codec.token(lv, c) for lv, c in enumerate(p))} already holds "
                    f"{len(used)} items, every code of the de-duplication level (size {k_last})")))
                continue
            full = p + (free,)
        else:
            full = p
            if full in taken:
                used = group_used.setdefault(p[:-1], set())
                free = None
                if cost is not None:
                    order = np.argsort(cost[m], kind="stable")
                    free = next((int(c) for c in order if int(c) not in used), None)
                if free is None:
                    why = ("and every last-level code under its first levels is taken" if cost is not None
                           else "and the map has no de-duplication level (pass last_cost to move it)")
                    out.needs_new_tokens.append(NeedsNewToken(
                        iid, p, f"SID {codec.to_string(list(p))} is taken {why}"))
                    continue
                full = p[:-1] + (free,)
        taken.add(full)
        group_used.setdefault(full[:-1], set()).add(full[-1])
        new_ids.append(iid)
        new_codes.append(list(full))
        out.assigned.append(iid)
    if new_ids:
        add = map_table(new_ids, np.asarray(new_codes, dtype=np.int64), codec)
        base = existing_map.select(["item_id", "codes", "sid"]).cast(MAP_SCHEMA)
        out.table = pa.concat_tables([base, add])
    return out


# --------------------------------------------------------------------------- version records
@dataclass(frozen=True)
class SidMapVersion:
    """What identifies one version of a SID map (written beside it as JSON)."""

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
    from gti.files import atomic_write_bytes

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
    """A folder of version records `<hash>.json`, with optional tables `<hash>.parquet`."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def add(self, version: SidMapVersion, table: pa.Table | None = None) -> None:
        from gti.files import atomic_write_bytes

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
    ident = child.codebook_identity
    for v in chain[1:]:
        if v is not None and v.codebook_identity != ident:
            return (f"map {v.hash} on its lineage has other codebooks ({_ident_str(v.codebook_identity)} vs "
                    f"{_ident_str(ident)})")
    if ancestor_identity is not None and tuple(ancestor_identity) != ident:
        return f"the model's codebooks differ ({_ident_str(tuple(ancestor_identity))} vs {_ident_str(ident)})"
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
    return len(chain) - 1 if chain else 0
