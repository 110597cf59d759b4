"""SID maps from a file (`sid.method: file`): reading, token parsing, checks, duplicates.

What it is for: `read_file_map(sid_cfg, catalog_ids)` turns a map someone else made (a MiniOneRec /
LC-Rec `<Dataset>.index.json`, or a parquet table) into the codes of our catalog, checked as our
own maps are (docs/data.md, "Bring your own SIDs"). Every error is a DataError naming the file,
the item (and the token) it is about. `index_json_entries` / `export_index_json` are the reverse,
for `gti sid export`: our map in the index.json form.

What it does not know: embeddings, the run folder or its manifests, Ray. It holds the whole file
in memory (a MiniOneRec catalog is 10^4-10^5 items).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gti.common.errors import DataError

# Fields of an item.json record that hold the item's id, in the order they are looked for.
ID_FIELDS = ("item_id", "asin", "parent_asin", "id")
# Codes per level at most (gti.config.MAX_CODEBOOK_SIZE: each code is a new token).
MAX_CODES = 65536
MAX_LEVELS = 26  # levels are spelled a..z
_SHOW = 5  # ids named in an error about several items


@dataclass
class FileMap:
    """The checked map of the catalog's covered items, in catalog order."""

    ids: list[str]
    codes: np.ndarray  # int64 [n, L] (L = file_levels, + 1 when duplicates were numbered)
    sizes: list[int]  # codes per level [L]
    file_levels: int
    missing: list[str] = field(default_factory=list)  # catalog items the file lacks (quarantined)
    not_in_catalog: int = 0  # file keys that name no catalog item
    duplicate_groups: int = 0
    duplicate_items: int = 0


# --------------------------------------------------------------------------- tokens
def token_regex(token_format: str, token_pattern: str | None) -> re.Pattern:
    """One token: `token_pattern` as given (a group `code`, optionally `level`), else
    `token_format` with its fields as groups (literal parts escaped, as `SidCodec` does)."""
    if token_pattern is not None:
        try:
            rx = re.compile(token_pattern)
        except re.error as err:
            raise DataError(f"sid.token_pattern {token_pattern!r} is not a regular expression: {err}") from None
        if "code" not in rx.groupindex:
            raise DataError(f"sid.token_pattern {token_pattern!r} has no group named 'code'")
        return rx
    pat = re.escape(token_format).replace(re.escape("{level}"), "(?P<level>[a-z])", 1)
    return re.compile(pat.replace(re.escape("{code}"), "(?P<code>[0-9]+)", 1))


def _spelling(rx: re.Pattern, pattern: str | None) -> str:
    return f"sid.token_pattern {pattern!r}" if pattern is not None else f"sid.token_format (regex {rx.pattern!r})"


def parse_value(item: str, value: Any, rx: re.Pattern, where: str, pattern: str | None = None) -> list[int]:
    """The codes of one item: a list of ints, of token strings (`<a_12>`: parsed by
    `sid.token_format`, or by the regex `sid.token_pattern` with groups `code` and `level`), or one
    SID string of such tokens. Token i must be level i."""
    if isinstance(value, str):
        value = split_sid(item, value, rx, where, pattern)
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where}: item '{item}': codes must be a non-empty list of ints or token strings, "
                        f"got {value!r:.80}")
    out = []
    for pos, v in enumerate(value):
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            out.append(int(v))
            continue
        if not isinstance(v, str):
            raise DataError(f"{where}: item '{item}': {v!r:.40} at position {pos} is neither an int nor a token")
        m = rx.fullmatch(v.strip())
        if m is None:
            raise DataError(f"{where}: item '{item}': token {v!r} does not match {_spelling(rx, pattern)}")
        level = m.groupdict().get("level")
        if level is not None:
            lv = ord(level) - ord("a") if level.isalpha() and len(level) == 1 else int(level) if level.isdigit() else -1
            if lv != pos:
                raise DataError(f"{where}: item '{item}': token {v!r} at position {pos} is level {level!r}, "
                                f"expected level {pos} ({chr(ord('a') + pos) if pos < MAX_LEVELS else '?'})")
        out.append(int(m.group("code")))
    return out


def split_sid(item: str, text: str, rx: re.Pattern, where: str, pattern: str | None = None) -> list[str]:
    """'<a_1><b_2>' (whitespace between tokens allowed) -> ['<a_1>', '<b_2>']."""
    toks, pos, s = [], 0, text.strip()
    while pos < len(s):
        m = rx.match(s, pos)
        if m is None or m.end() == pos:
            raise DataError(f"{where}: item '{item}': SID {text!r} has text at position {pos} ({s[pos:pos + 12]!r}) "
                            f"that does not match {_spelling(rx, pattern)}")
        toks.append(m.group(0))
        pos = m.end()
        while pos < len(s) and s[pos].isspace():
            pos += 1
    return toks


# --------------------------------------------------------------------------- reading
def _no_repeats(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict = {}
    for k, v in pairs:
        if k in seen:
            raise DataError(f"key '{k}' appears twice")
        seen[k] = v
    return seen


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_no_repeats)
    except DataError as err:
        raise DataError(f"{path}: {err}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: not JSON ({err})") from None


def read_entries(path: Path) -> list[tuple[str, Any]]:
    """(key, raw value) of every entry of the map file, in file order: a JSON object {key: value}
    (a repeated key is refused) or a parquet table (`item_id` and `codes`, else `sid`, else its two
    columns in order)."""
    if not path.is_file():
        raise DataError(f"sid.path {path}: no such file")
    if path.suffix == ".json":
        data = _read_json(path)
        if not isinstance(data, dict):
            raise DataError(f"{path}: expected a JSON object {{item: codes}} (as index.json), "
                            f"got a {type(data).__name__}")
        return [(str(k), v) for k, v in data.items()]
    if path.suffix != ".parquet":
        raise DataError(f"sid.path {path}: expected a .json or .parquet file")
    import pyarrow.parquet as pq

    t = pq.read_table(path)
    names = t.column_names
    value = "codes" if "codes" in names else "sid" if "sid" in names else names[1] if len(names) == 2 else None
    key = "item_id" if "item_id" in names else names[0] if len(names) == 2 else None
    if key is None or value is None:
        raise DataError(f"{path}: expected columns item_id and codes (or sid), or two columns; has {names}")
    keys = [None if k is None else str(k) for k in t.column(key).to_pylist()]
    if None in keys:
        raise DataError(f"{path}: column {key} has a null at row {keys.index(None)}")
    counts = Counter(keys)
    twice = next((k for k in keys if counts[k] > 1), None)
    if twice is not None:
        raise DataError(f"{path}: item '{twice}' appears {counts[twice]} times")
    return list(zip(keys, t.column(value).to_pylist()))


def _record_id(index: str, entry: Any, where: Path) -> str:
    if isinstance(entry, (str, int)) and not isinstance(entry, bool):
        return str(entry)
    if isinstance(entry, dict):
        for f in ID_FIELDS:
            if entry.get(f) is not None:
                return str(entry[f])
    raise DataError(f"{where}: entry '{index}' names no item (an id, or a record with one of {', '.join(ID_FIELDS)}); "
                    "leave sid.item_json out when sid.path's keys are your item ids")


def read_item_names(path: Path) -> dict[str, str]:
    """index -> item id of their item.json (list: position; object: key) or .item2id lines."""
    if not path.is_file():
        raise DataError(f"sid.item_json {path}: no such file")
    if path.suffix == ".json":
        data = _read_json(path)
        pairs = enumerate(data) if isinstance(data, list) else data.items() if isinstance(data, dict) else None
        if pairs is None:
            raise DataError(f"{path}: expected a JSON list or object of items")
        out = {str(i): _record_id(str(i), e, path) for i, e in pairs}
    else:
        out = {}
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            parts = line.split("\t")
            if not line.strip():
                continue
            if len(parts) != 2:
                raise DataError(f"{path}: line {n}: expected 'item_id<TAB>index', got {line!r:.80}")
            if parts[1].strip() in out:
                raise DataError(f"{path}: index '{parts[1].strip()}' appears twice")
            out[parts[1].strip()] = parts[0].strip()
    named = Counter(out.values())
    twice = next((i for i in out.values() if named[i] > 1), None)
    if twice is not None:
        raise DataError(f"{path}: item '{twice}' is named by {named[twice]} indices")
    return out


def read_codes(s) -> dict[str, list[int]]:
    """item id -> codes of every entry of `s.path`. Keys are our item ids, or, with `s.item_json`,
    indices into their item.json (whose entries name the item: an id, or a record with one of
    `ID_FIELDS`) or into an LC-Rec `.item2id` (lines `item_id<TAB>index`)."""
    path = Path(s.path).expanduser()
    entries = read_entries(path)
    if not entries:
        raise DataError(f"sid.path {path}: the map is empty")
    rx = token_regex(s.token_format, s.token_pattern)
    names = read_item_names(Path(s.item_json).expanduser()) if s.item_json else None
    out: dict[str, list[int]] = {}
    for key, value in entries:
        item = key
        if names is not None:
            if key not in names:
                raise DataError(f"{path}: index '{key}' is not in sid.item_json {s.item_json}")
            item = names[key]
        out[item] = parse_value(item, value, rx, str(path), s.token_pattern)
    return out


# --------------------------------------------------------------------------- checks
def _some(ids: list[str]) -> str:
    return ", ".join(f"'{i}'" for i in ids[:_SHOW]) + (", ..." if len(ids) > _SHOW else "")


def align(codes_of: dict[str, list[int]], catalog_ids: list[str], missing_mode: str, where: str):
    """(ids covered in catalog order, their code rows, missing ids, file keys not in the catalog)."""
    ids = [i for i in catalog_ids if i in codes_of]
    missing = [i for i in catalog_ids if i not in codes_of]
    if not ids:
        raise DataError(f"{where}: none of the {len(catalog_ids)} catalog items is in the map (its keys, e.g. "
                        f"{_some(list(codes_of))}, are not item ids: indices need sid.item_json)")
    if missing and missing_mode != "quarantine":
        raise DataError(f"{where}: {len(missing)} catalog item(s) have no SID: {_some(missing)} (add them, or set "
                        "sid.missing=quarantine to leave them out)")
    extra = len(codes_of) - len(ids)
    return ids, [codes_of[i] for i in ids], missing, extra


def check_levels(ids: list[str], rows: list[list[int]], where: str) -> np.ndarray:
    """int64 [n, L] of rows that all have the most common length L (else a DataError)."""
    lengths = Counter(len(r) for r in rows)
    want = lengths.most_common(1)[0][0]
    bad = [i for i, r in zip(ids, rows) if len(r) != want]
    if bad:
        first = next(r for r in rows if len(r) != want)
        raise DataError(f"{where}: item '{bad[0]}' has {len(first)} codes where the map's others have {want} "
                        f"(every SID needs the same number of levels; {len(bad)} such item(s): {_some(bad)})")
    if want > MAX_LEVELS - 1:
        raise DataError(f"{where}: {want} levels; at most {MAX_LEVELS - 1} (a..z, one kept for duplicates)")
    return np.asarray(rows, dtype=np.int64).reshape(len(rows), want)


def level_sizes(ids: list[str], codes: np.ndarray, given, where: str) -> list[int]:
    """Codes per level: `given` (int or list), checked, else each level's largest code + 1."""
    levels = codes.shape[1]
    if given is not None:
        sizes = [int(given)] * levels if isinstance(given, int) else [int(k) for k in given]
        if len(sizes) != levels:
            raise DataError(f"sid.file_codebook_size {list(given)} has {len(sizes)} entries; "
                            f"the map has {levels} levels")
    else:
        sizes = [int(codes[:, lv].max()) + 1 for lv in range(levels)]
    for lv in range(levels):
        col, letter = codes[:, lv], chr(ord("a") + lv)
        if given is not None and sizes[lv] > MAX_CODES:
            raise DataError(f"sid.file_codebook_size: {sizes[lv]} codes at level {letter}; at most {MAX_CODES}")
        hi = min(sizes[lv], MAX_CODES)
        bad = np.nonzero((col < 0) | (col >= hi))[0]
        if bad.size:
            r = int(bad[0])
            why = ("codes start at 0" if col[r] < 0 else f"sid.file_codebook_size gives level {letter} {hi} codes"
                   if given is not None else f"at most {MAX_CODES} codes per level")
            raise DataError(f"{where}: item '{ids[r]}': code {int(col[r])} at level {letter} is outside "
                            f"0..{hi - 1} ({why}; {bad.size} such item(s) at level {letter})")
    return sizes


def resolve_duplicates(ids: list[str], codes: np.ndarray, mode: str, token_format: str, where: str):
    """(codes, duplicate groups, items in them): with `append_level`, one level more numbering
    each group's items 0, 1, ... in item id order (0 for every other item); `error`: a
    DataError naming two items of the first group (in item id order) and their SID."""
    import torch

    from gti.sid.resolve import dedup_extra_level, group_ids

    order = np.argsort(np.asarray(ids, dtype=object), kind="stable")
    gid = group_ids(torch.from_numpy(codes[order])).numpy()
    counts = np.bincount(gid)
    groups, items = int((counts > 1).sum()), int(counts[counts > 1].sum())
    if not groups:
        return codes, 0, 0
    if mode == "error":
        first = int(np.nonzero(counts[gid] > 1)[0][0])
        mate = int(np.nonzero(gid == gid[first])[0][1])
        sid = "".join(token_format.format(level=chr(ord("a") + lv), code=int(c))
                      for lv, c in enumerate(codes[order[first]]))
        raise DataError(f"{where}: items '{ids[order[first]]}' and '{ids[order[mate]]}' share the SID {sid} "
                        f"({groups} shared SID(s), {items} items; set sid.duplicates=append_level to number them)")
    out = np.empty((len(ids), codes.shape[1] + 1), dtype=np.int64)
    out[order] = dedup_extra_level(torch.from_numpy(codes[order])).numpy()
    return out, groups, items


def read_file_map(s, catalog_ids: list[str]) -> FileMap:
    """The checked map of `s.path` (a `SidConfig` with method file) for the catalog's ids.

    Checks on the catalog's items (the file's other keys are counted and left out): every item
    covered (else a DataError naming the first missing ids and the count, or with
    `sid.missing: quarantine` the items left out and listed), one level count, codes in range
    (`sid.file_codebook_size`, else each level's largest code + 1 is its size), and no SID shared
    (`sid.duplicates: error`), else one level more numbering each group's items 0, 1, ... in item
    id order (`gti.sid.resolve.dedup_extra_level`, as TIGER and GRID do).
    """
    where = str(Path(s.path).expanduser())
    ids, rows, missing, extra = align(read_codes(s), catalog_ids, s.missing or "error", where)
    codes = check_levels(ids, rows, where)
    sizes = level_sizes(ids, codes, s.file_codebook_size, where)
    file_levels = codes.shape[1]
    codes, groups, items = resolve_duplicates(ids, codes, s.duplicates or "append_level", s.token_format, where)
    if codes.shape[1] > file_levels:
        sizes = sizes + [int(codes[:, -1].max()) + 1]
    return FileMap(ids, codes, sizes, file_levels, missing, extra, groups, items)


# --------------------------------------------------------------------------- export
def index_json_entries(ids: list[str], codes: np.ndarray, token_format: str,
                       index_of: dict[str, str] | None = None) -> dict[str, list[str]]:
    """{key: [token, ...]} of a map (index.json's form): keys are the item ids, or with
    `index_of` (item id -> their index) the indices; rows in item id order (by index with
    `index_of`, numerically where the indices are numbers)."""
    letters = [chr(ord("a") + lv) for lv in range(codes.shape[1])]
    rows = {i: [token_format.format(level=letters[lv], code=int(c)) for lv, c in enumerate(r)]
            for i, r in zip(ids, codes)}
    if index_of is None:
        return {i: rows[i] for i in sorted(rows)}
    lacking = [i for i in sorted(rows) if i not in index_of]
    if lacking:
        raise DataError(f"{len(lacking)} item(s) of the map are not in the item.json: {_some(lacking)}")
    keyed = {index_of[i]: rows[i] for i in rows}
    return {k: keyed[k] for k in sorted(keyed, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))}


def export_index_json(map_path: Path, token_format: str, out: Path, item_json: Path | None = None,
                      items_path: Path | None = None) -> dict:
    """`gti sid export`: the map at `map_path` (item_id, codes) written to `out` as index.json.
    With `item_json`: keys are its indices; when that file does not exist it is written first,
    {index: {item_id, title, description}} with indices 0.. in item id order (titles and
    descriptions from `items_path`, the run's ingested items, where given). Returns counts."""
    import pyarrow.parquet as pq

    t = pq.read_table(map_path, columns=["item_id", "codes"])
    ids = [str(i) for i in t.column("item_id").to_pylist()]
    codes = np.asarray(t.column("codes").to_pylist(), dtype=np.int64).reshape(len(ids), -1)
    index_of, wrote = None, False
    if item_json is not None:
        if not item_json.exists():
            _write_item_json(item_json, sorted(ids), items_path)
            wrote = True
        index_of = {i: k for k, i in read_item_names(item_json).items()}
    entries = index_json_entries(ids, codes, token_format, index_of)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(entries, indent=4, ensure_ascii=False) + "\n", encoding="utf-8")
    return {"items": len(entries), "levels": int(codes.shape[1]), "item_json_written": wrote}


def _write_item_json(path: Path, ids: list[str], items_path: Path | None) -> None:
    """{index: {item_id, title, description}} for `ids` (indices 0.. in their order)."""
    text: dict[str, tuple[str, str]] = {}
    if items_path is not None and items_path.is_file():
        import pyarrow.parquet as pq

        cols = pq.read_table(items_path, columns=["item_id", "title", "description"]).to_pydict()
        text = {str(i): (t or "", d or "") for i, t, d in zip(cols["item_id"], cols["title"], cols["description"])}
    recs = {str(k): {"item_id": i, "title": text.get(i, ("", ""))[0], "description": text.get(i, ("", ""))[1]}
            for k, i in enumerate(ids)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recs, indent=4, ensure_ascii=False) + "\n", encoding="utf-8")
