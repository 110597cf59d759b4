"""Row checks for catalogs and interactions: pure functions, one row at a time, plus the
batch wrappers that apply them to a pyarrow table.

What it is for: deciding, for every input row, either its normalised form or the reason it goes
to quarantine. The ingest stage runs `validate_items` / `validate_interactions` inside Ray Data
`map_batches`; tests call the row functions directly. The decisions a user sees (ids, text,
pseudo titles, timestamps) are on `normalise_id`, `clean_text`, `check_item` and `parse_ts`.

What it does not know: files, Ray, duplicates across batches, or unknown items (those need the
whole catalog and are decided by the ingest stage, in file order).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from datetime import date, datetime, time, timezone
from typing import Any

import pyarrow as pa

# Quarantine reasons (the `reason` column and the manifest's quarantine_reasons keys).
MISSING_ID = "missing_id"
DUPLICATE_ID = "duplicate_id"
FLOAT_ID = "float_id"
BAD_ID_TYPE = "bad_id_type"
INVALID_UTF8 = "invalid_utf8"
NON_STRING_TEXT = "non_string_text"
NO_TEXT = "no_text"
MISSING_USER = "missing_user"
MISSING_ITEM = "missing_item"
INVALID_TS = "invalid_ts"
UNKNOWN_ITEM = "unknown_item"
OUTSIDE_MAX_ITEMS = "outside_max_items"
OUTSIDE_MAX_USERS = "outside_max_users"
OUTSIDE_DENSE = "outside_dense"  # not in the data.dense subset (gti.data.dense)
SHORT_SEQUENCE = "short_sequence"
MALFORMED_RECORD = "malformed_record"

_INTEGRAL_FLOAT_STR = re.compile(r"^[+-]?\d+\.0*$")
_DIGITS = re.compile(r"^\+?\d+$")

# Schema of a validated item batch (ok and quarantined rows together, in input order).
ITEM_BATCH_SCHEMA = pa.schema(
    [
        ("item_id", pa.string()),
        ("title", pa.string()),
        ("description", pa.string()),
        ("category", pa.string()),
        ("attributes_text", pa.string()),
        ("text_is_pseudo", pa.bool_()),
        ("truncated", pa.bool_()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("source_file", pa.string()),
        ("source_row", pa.int64()),
        ("raw", pa.string()),
    ]
)
ITEMS_OUT_COLUMNS = ["item_id", "title", "description", "category", "attributes_text", "text_is_pseudo"]
QUARANTINE_COLUMNS = ["source_file", "source_row", "item_id", "reason", "detail", "raw"]

INTERACTION_BATCH_SCHEMA = pa.schema(
    [
        ("user_id", pa.string()),
        ("item_id", pa.string()),
        ("ts", pa.int64()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("source_file", pa.string()),
        ("source_row", pa.int64()),
        ("raw", pa.string()),
    ]
)
INTERACTIONS_QUARANTINE_COLUMNS = ["source_file", "source_row", "user_id", "item_id", "reason", "detail", "raw"]


# --------------------------------------------------------------------------- single values
def _is_nan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


def normalise_id(value: Any) -> tuple[str | None, str | None]:
    """One raw id -> (id string, None) or (None, reason). Ids are strings: an int id becomes its
    decimal string; a float id that is integral (12.0, or the string "12.0" that pandas leaves in
    CSVs) becomes "12"; a non-integral, NaN or infinite float id is quarantined with reason
    `float_id`. Other strings are kept verbatim (after stripping blanks), so "3.14" stays "3.14"
    as a string id."""
    if value is None or _is_nan(value):
        return None, MISSING_ID
    if isinstance(value, bool):
        return None, BAD_ID_TYPE
    if isinstance(value, int):
        return str(value), None
    if isinstance(value, float):
        if math.isinf(value) or not value.is_integer():
            return None, FLOAT_ID
        return str(int(value)), None
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return None, INVALID_UTF8
    if isinstance(value, str):
        s = value.strip()
        if not s:
            return None, MISSING_ID
        if _INTEGRAL_FLOAT_STR.match(s):
            return str(int(s.split(".")[0])), None
        return s, None
    return None, BAD_ID_TYPE


def clean_text(value: Any, max_chars: int) -> tuple[str | None, str | None, bool]:
    """One raw text value -> (text or None when absent, reason or None, truncated?).

    Text must be a string; NaN and empty/blank strings count as absent. bytes are decoded as
    UTF-8 (`invalid_utf8` if they are not); any other type (a number, a list, a mapping) is
    `non_string_text`: the adapters flatten the list-valued fields of known public formats
    before this point. Text longer than `max_chars` is cut to that length (truncated)."""
    if value is None or _is_nan(value):
        return None, None, False
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return None, INVALID_UTF8, False
    if not isinstance(value, str):
        return None, NON_STRING_TEXT, False
    # split/join collapses any run of (Unicode) whitespace, and is faster than a regex here.
    s = " ".join(value.split())
    if not s:
        return None, None, False
    if len(s) > max_chars:
        return s[:max_chars].rstrip(), None, True
    return s, None, False


def pseudo_title(category: str | None, attributes: dict[str, str]) -> str:
    """Text for an item that has neither title nor description, from what it does have.

    e.g. {"brand": "eSUN"}, "Lab > Filament" -> "eSUN Lab > Filament". The attribute values come
    first because a brand or author names an item more specifically than its category does.
    """
    parts = [v for v in attributes.values() if v]
    if category:
        parts.append(category)
    return " ".join(parts)


TS_MAX = 2**63 - 1  # timestamps are int64 in every output file; a larger one is invalid_ts


def _ts_in_range(v: int) -> int | None:
    return v if 0 <= v <= TS_MAX else None


def parse_ts(value: Any) -> int | None:
    """A raw timestamp -> int in [0, 2**63 - 1], or None when it is missing, invalid or out of
    that range (the row is then quarantined as invalid_ts, never the whole file). Accepted: an
    int, an integral float, a digit string, or an ISO-8601 date/time, taken as UTC seconds."""
    if value is None or _is_nan(value) or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return _ts_in_range(value)
    if isinstance(value, float):
        if math.isinf(value) or not value.is_integer() or value < 0:
            return None
        return _ts_in_range(int(value))
    if isinstance(value, date) and not isinstance(value, datetime):
        value = datetime.combine(value, time())  # a date column: midnight UTC
    if isinstance(value, datetime):
        dt = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
        ts = int(dt.timestamp())
        return ts if ts >= 0 else None
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return None
    if isinstance(value, str):
        s = value.strip()
        if _DIGITS.match(s) or _INTEGRAL_FLOAT_STR.match(s):
            digits = s.split(".")[0]
            # More than 19 significant digits cannot fit int64 (and int() refuses > 4300 digits).
            if len(digits.lstrip("+-").lstrip("0")) > 19:
                return None
            return _ts_in_range(int(digits))
        try:
            dt = datetime.fromisoformat(s)
        except ValueError:
            return None
        return parse_ts(dt)
    return None


def raw_json(record: dict[str, Any]) -> str:
    """The original record as a JSON string of strings (for the quarantine file)."""

    def s(v: Any) -> str | None:
        if v is None:
            return None
        if isinstance(v, (bytes, bytearray)):
            return bytes(v).decode("utf-8", errors="backslashreplace")
        text = v if isinstance(v, str) else repr(v)
        # 1 MB titles should not make a 1 MB quarantine cell.
        return text if len(text) <= 1000 else text[:1000] + f"...<{len(text)} chars>"

    return json.dumps({k: s(v) for k, v in record.items()}, ensure_ascii=False)


# --------------------------------------------------------------------------- item rows
@dataclass
class ItemCheck:
    item_id: str | None = None
    title: str = ""
    description: str = ""
    category: str = ""
    attributes_text: str = ""
    text_is_pseudo: bool = False
    truncated: bool = False
    reason: str | None = None
    detail: str | None = None


def check_item(
    raw_id: Any,
    title: Any,
    description: Any,
    category: Any,
    attributes: dict[str, Any],
    max_text_chars: int,
) -> ItemCheck:
    """Validate one catalog row. Returns the normalised row, or one with `reason` set. An item
    without title and description but with a category or attributes keeps a pseudo-text title
    built from them (`pseudo_title`, `text_is_pseudo`); with none of these it is `no_text`."""
    item_id, reason = normalise_id(raw_id)
    if reason:
        return ItemCheck(reason=reason, detail="id")
    out = ItemCheck(item_id=item_id)
    texts: dict[str, str | None] = {}
    fields = {"title": title, "description": description, "category": category}
    fields.update({f"attr:{k}": v for k, v in attributes.items()})
    for name, value in fields.items():
        text, reason, cut = clean_text(value, max_text_chars)
        if reason:
            return ItemCheck(item_id=item_id, reason=reason, detail=name.removeprefix("attr:"))
        texts[name] = text
        out.truncated |= cut
    attrs = {k: texts[f"attr:{k}"] for k in attributes if texts[f"attr:{k}"]}
    out.attributes_text = "; ".join(f"{k}: {v}" for k, v in attrs.items())
    out.category = texts["category"] or ""
    out.description = texts["description"] or ""
    out.title = texts["title"] or ""
    if not out.title and not out.description:
        pseudo = pseudo_title(texts["category"], attrs)
        if not pseudo:
            return ItemCheck(item_id=item_id, reason=NO_TEXT, detail="title,description,category,attributes")
        out.title = pseudo[:max_text_chars]
        out.text_is_pseudo = True
    return out


READ_ERROR = "_read_error"  # set by a reader for a row it could not parse (see adapters)


def _n_rows(raw: dict[str, list]) -> int:
    return len(next(iter(raw.values()))) if raw else 0


def _column(raw: dict[str, list], name: str, n: int) -> list[Any]:
    return raw.get(name) or [None] * n


def validate_items(
    raw: dict[str, list],
    attributes: list[str],
    max_text_chars: int,
    source_file: str,
    first_row: int,
) -> pa.Table:
    """Check every row of a raw item batch: a mapping of canonical column name -> list of
    values (`item_id, title, description, category` + attribute columns; absent ones count as
    null; `_read_error` marks rows a reader could not parse). Returns ITEM_BATCH_SCHEMA rows in
    the same order; rows with a non-null `reason` are for quarantine.
    """
    n = _n_rows(raw)
    ids = _column(raw, "item_id", n)
    titles = _column(raw, "title", n)
    descs = _column(raw, "description", n)
    cats = _column(raw, "category", n)
    errors = _column(raw, READ_ERROR, n)
    attr_cols = {a: _column(raw, a, n) for a in attributes}
    cols: dict[str, list] = {f.name: [] for f in ITEM_BATCH_SCHEMA}
    for i in range(n):
        attrs = {a: attr_cols[a][i] for a in attributes}
        if errors[i]:
            r = ItemCheck(reason=errors[i], detail="record")
        else:
            r = check_item(ids[i], titles[i], descs[i], cats[i], attrs, max_text_chars)
        cols["item_id"].append(r.item_id)
        cols["title"].append(r.title)
        cols["description"].append(r.description)
        cols["category"].append(r.category)
        cols["attributes_text"].append(r.attributes_text)
        cols["text_is_pseudo"].append(r.text_is_pseudo)
        cols["truncated"].append(r.truncated)
        cols["reason"].append(r.reason)
        cols["detail"].append(r.detail)
        cols["source_file"].append(source_file)
        cols["source_row"].append(first_row + i)
        if r.reason:
            rec = {"item_id": ids[i], "title": titles[i], "description": descs[i], "category": cats[i]}
            rec.update(attrs)
            cols["raw"].append(raw_json(rec))
        else:
            cols["raw"].append(None)
    return pa.table(cols, schema=ITEM_BATCH_SCHEMA)


# --------------------------------------------------------------------------- interaction rows
def check_interaction(raw_user: Any, raw_item: Any, raw_ts: Any, position: int | None) -> tuple:
    """One interaction row -> (user_id, item_id, ts, reason, detail).

    `position` is the row's place in file order, used as ts when the config has no ts column.
    """
    user, reason = normalise_id(raw_user)
    if reason:
        return None, None, None, (MISSING_USER if reason == MISSING_ID else reason), "user_id"
    item, reason = normalise_id(raw_item)
    if reason:
        return user, None, None, (MISSING_ITEM if reason == MISSING_ID else reason), "item_id"
    ts = position if position is not None else parse_ts(raw_ts)
    if ts is None:
        return user, item, None, INVALID_TS, "ts"
    return user, item, ts, None, None


def validate_interactions(
    raw: dict[str, list], has_ts: bool, source_file: str, first_row: int
) -> pa.Table:
    """Check every row of a raw interaction batch (canonical columns user_id, item_id, ts).
    Returns INTERACTION_BATCH_SCHEMA rows in input order; `reason` set for quarantine rows.
    Without a ts column, the global row position (`first_row + i`) is the timestamp.
    """
    n = _n_rows(raw)
    users = _column(raw, "user_id", n)
    items = _column(raw, "item_id", n)
    tss = _column(raw, "ts", n) if has_ts else [None] * n
    errors = _column(raw, READ_ERROR, n)
    cols: dict[str, list] = {f.name: [] for f in INTERACTION_BATCH_SCHEMA}
    for i in range(n):
        pos = None if has_ts else first_row + i
        if errors[i]:
            u, it, ts, reason, detail = None, None, None, errors[i], "record"
        else:
            u, it, ts, reason, detail = check_interaction(users[i], items[i], tss[i], pos)
        cols["user_id"].append(u)
        cols["item_id"].append(it)
        cols["ts"].append(ts)
        cols["reason"].append(reason)
        cols["detail"].append(detail)
        cols["source_file"].append(source_file)
        cols["source_row"].append(first_row + i)
        cols["raw"].append(
            raw_json({"user_id": users[i], "item_id": items[i], "ts": tss[i]}) if reason else None
        )
    return pa.table(cols, schema=INTERACTION_BATCH_SCHEMA)
