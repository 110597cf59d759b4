"""Editing a frozen SID map: new items in, removed items out, never moving an existing SID.

What it is for: a catalog changes after a map is frozen. `assign_new_items` gives new items full
SIDs from the frozen quantiser's codes; `add_last_level_codes` (`gti refresh` with
`refresh.on_full_group: add_tokens`) grows the last level for the items that fit nowhere else;
`remove_items` takes items out; `map_table` builds a map table from full codes.

A SID map is a pyarrow table `item_id` str, `codes` list<int32>, `sid` str (the `sid` stage's
sid_map.parquet; `gti.data.schemas.SID_MAP_SCHEMA`); its versions and lineage are
`gti.sid.versions`. What it does not know: embeddings, quantiser weights, version records,
models, Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from gti.data.schemas import SID_MAP_SCHEMA
from gti.common.errors import DataError
from gti.sid.codec import SidCodec


def map_table(item_ids: Sequence[str], codes: Sequence[Sequence[int]] | np.ndarray, codec: SidCodec) -> pa.Table:
    """A SID-map table from ids and full codes [N, L] (SID strings spelled by `codec`)."""
    rows = [list(map(int, c)) for c in np.asarray(codes, dtype=np.int64).reshape(len(item_ids), codec.levels)]
    return pa.table({"item_id": [str(i) for i in item_ids], "codes": rows,
                     "sid": [codec.to_string(r) for r in rows]}, schema=SID_MAP_SCHEMA)


def codes_matrix(table: pa.Table) -> np.ndarray:
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


def _checked_inputs(new_item_ids, new_codes_prefix, sizes: list[int], last_cost):
    """(ids, prefix codes int64 [M, Lq], last-level costs [M, K_last] or None), or DataError."""
    ids = [str(i) for i in new_item_ids]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise DataError(f"new items: item_id '{dup}' appears more than once")
    pre = np.asarray(torch.as_tensor(new_codes_prefix).cpu().numpy() if isinstance(new_codes_prefix, torch.Tensor)
                     else new_codes_prefix, dtype=np.int64)
    if pre.size == 0:  # no new items (or no levels): an empty [M, Lq] that the checks below accept
        pre = pre.reshape(len(ids), -1) if ids else np.zeros((0, len(sizes)), dtype=np.int64)
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
    return ids, pre, cost


class _UsedCodes:
    """Codes in use: full SIDs, and per group (the prefix for the extra level; the first L-1
    codes without one) the set of codes taken at the last level."""

    def __init__(self, old: np.ndarray) -> None:
        self.taken: set[tuple[int, ...]] = set(map(tuple, old.tolist()))
        if len(self.taken) != old.shape[0]:
            raise DataError("SID map: existing map has duplicate SIDs")
        self.groups: dict[tuple[int, ...], set[int]] = {}
        for row in old.tolist():
            self.groups.setdefault(tuple(row[:-1]), set()).add(row[-1])

    def group(self, key: tuple[int, ...]) -> set[int]:
        return self.groups.setdefault(key, set())

    def add(self, full: tuple[int, ...]) -> None:
        self.taken.add(full)
        self.group(full[:-1]).add(full[-1])


def _free_sid(p: tuple[int, ...], used: _UsedCodes, codec: SidCodec,
              cost_row: np.ndarray | None) -> tuple[tuple[int, ...] | None, str]:
    """(a free full SID for quantiser codes `p`, "") or (None, why there is none)."""
    k_last = codec.codebook_sizes[-1]
    if len(p) < codec.levels:  # a de-duplication level: the smallest code free in the group
        in_group = used.group(p)
        free = next((c for c in range(k_last) if c not in in_group), None)
        if free is None:
            return None, (f"prefix {''.join(codec.token(lv, c) for lv, c in enumerate(p))} already holds "
                          f"{len(in_group)} items, every code of the de-duplication level (size {k_last})")
        return p + (free,), ""
    if p not in used.taken:
        return p, ""
    in_group = used.group(p[:-1])
    free = None
    if cost_row is not None:
        order = np.argsort(cost_row, kind="stable")
        free = next((int(c) for c in order if int(c) not in in_group), None)
    if free is None:
        why = ("and every last-level code under its first levels is taken" if cost_row is not None
               else "and the map has no de-duplication level (pass last_cost to move it)")
        return None, f"SID {codec.to_string(list(p))} is taken {why}"
    return p[:-1] + (free,), ""


def assign_new_items(
    existing_map: pa.Table,
    new_item_ids: Sequence[str],
    new_codes_prefix: Sequence[Sequence[int]] | np.ndarray | torch.Tensor,
    codebook_sizes: Sequence[int],
    token_format: str = "<{level}_{code}>",
    *,
    last_cost: np.ndarray | torch.Tensor | None = None,
) -> Assignment:
    """Full SIDs for new items that leave every existing SID unchanged.

    With a de-duplication level (`sid.dedup: extra_level`) the extra code is the smallest one free
    within the item's prefix group (equal quantiser codes). Without one, a new item takes its
    quantiser codes when that SID is free, else (with `last_cost`) the cheapest last-level code
    still free under its first L-1 codes. An item that fits nowhere is returned in
    `needs_new_tokens` with a reason: never dropped, never given a duplicate. Ids already in the
    map keep their old SID (`already_present`, `prefix_changed`).

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
    ids, pre, cost = _checked_inputs(new_item_ids, new_codes_prefix, sizes, last_cost)
    old = codes_matrix(existing_map)
    if old.shape[0] and old.shape[1] != len(sizes):
        raise DataError(f"SID map has {old.shape[1]} levels but codebook_sizes {sizes} has {len(sizes)}")
    old_pos = {iid: i for i, iid in enumerate(existing_map.column("item_id").to_pylist())}
    used = _UsedCodes(old)
    out = Assignment(table=existing_map)
    new_ids, new_codes = [], []
    for m, iid in enumerate(ids):
        p = tuple(int(c) for c in pre[m])
        if iid in old_pos:
            out.already_present.append(iid)
            if tuple(old[old_pos[iid], :len(p)].tolist()) != p:
                out.prefix_changed.append(iid)
            continue
        full, why = _free_sid(p, used, codec, None if cost is None else cost[m])
        if full is None:
            out.needs_new_tokens.append(NeedsNewToken(iid, p, why))
            continue
        used.add(full)
        new_ids.append(iid)
        new_codes.append(list(full))
        out.assigned.append(iid)
    if new_ids:
        add = map_table(new_ids, np.asarray(new_codes, dtype=np.int64), codec)
        base = existing_map.select(["item_id", "codes", "sid"]).cast(SID_MAP_SCHEMA)
        out.table = pa.concat_tables([base, add])
    return out


@dataclass
class Growth:
    """Result of `add_last_level_codes`.

    assignment: the `Assignment` with every item placed: the first pass's rows, then the items
        that needed a new token on their added codes (in `needs_new_tokens` order); its
        `assigned` lists the first pass's ids, then those; `needs_new_tokens` is empty.
    codebook_sizes: the grown sizes (the last level's size + `n_added`; the rest unchanged).
    old_size: the last level's size before.
    on_new_codes: ids of the items placed on added codes.
    """

    assignment: Assignment
    codebook_sizes: list[int]
    old_size: int
    on_new_codes: list[str] = field(default_factory=list)

    @property
    def n_added(self) -> int:
        """How many codes the last level gained."""
        return self.codebook_sizes[-1] - self.old_size


def _group_key(need: NeedsNewToken, levels: int) -> tuple[int, ...]:
    """The prefix group of an item that needs a new token: its quantiser codes with a
    de-duplication level (the map has one more level), else its first L-1 codes."""
    if len(need.codes) == levels - 1:
        return tuple(need.codes)
    if len(need.codes) == levels:
        return tuple(need.codes[:-1])
    raise DataError(f"new item '{need.item_id}': {len(need.codes)} quantiser codes for a map of {levels} levels")


def add_last_level_codes(assignment: Assignment, codebook_sizes: Sequence[int],
                         token_format: str = "<{level}_{code}>") -> Growth:
    """Place `assignment.needs_new_tokens` on new codes of the last level.

    Old SIDs unchanged, every SID unique, nothing dropped; the grown sizes (`Growth`) go to the new
    map's version record and the vocabulary. Only the last level grows: its codes are the only
    ones no quantiser codebook vector stands for.

    codebook_sizes: the sizes `assignment` was made with (`assign_new_items`'s argument).
    Deterministic: items in `needs_new_tokens` order, each on the smallest free code >= the old
    last-level size in its group, so the last level grows by exactly the size of the largest
    group of such items. Without any such item the assignment and the sizes come back as they
    are.
    """
    sizes = [int(k) for k in codebook_sizes]
    k_old = sizes[-1]
    needs = list(assignment.needs_new_tokens)
    if not needs:
        return Growth(assignment, sizes, k_old)
    used = _UsedCodes(codes_matrix(assignment.table))
    ids, codes = [], []
    for need in needs:
        key = _group_key(need, len(sizes))
        in_group = used.group(key)
        code = k_old
        while code in in_group:
            code += 1
        used.add(key + (code,))
        ids.append(need.item_id)
        codes.append(list(key) + [code])
    grown = sizes[:-1] + [max(k_old, max(c[-1] for c in codes) + 1)]
    add = map_table(ids, np.asarray(codes, dtype=np.int64), SidCodec(len(grown), grown, token_format))
    base = assignment.table.select(["item_id", "codes", "sid"]).cast(SID_MAP_SCHEMA)
    placed = Assignment(table=pa.concat_tables([base, add]), assigned=list(assignment.assigned) + ids,
                        already_present=list(assignment.already_present),
                        prefix_changed=list(assignment.prefix_changed))
    return Growth(placed, grown, k_old, ids)
