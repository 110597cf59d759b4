"""Reader for the Amazon Reviews 2023 layout (McAuley lab, `meta_<Category>.jsonl` and
`<Category>.jsonl`), the layout most current generative-recommendation papers use.

What it is for: turning its JSON lines into records with our canonical names, for
`gti.data.adapters.iter_task` (`format: amazon2023`): metadata lines into items
(`item_record`), review lines into interactions (`review_record`).

What it does not know: validation (gti.data.catalog), finding and opening files (gti.data.sources),
Ray.
"""

from __future__ import annotations

from typing import Any, Iterator

from gti.data.readers import _json_records, _records_to_batches

ITEM_FIELDS = ("item_id", "title", "description", "category", "brand", "store", "details", "main_category")


def _strings(v: Any) -> list[str]:
    """A value that should be a list of strings -> the non-blank strings in it."""
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        return []
    out = []
    for x in v:
        if isinstance(x, list):
            out.extend(_strings(x))
        elif isinstance(x, str) and x.strip():
            out.append(x.strip())
    return out


def _details_text(details: Any) -> str | None:
    if not isinstance(details, dict):
        return None
    parts = [f"{k}: {v}" for k, v in details.items()
             if isinstance(v, (str, int, float)) and not isinstance(v, bool) and str(v).strip()]
    return "; ".join(parts) or None


def item_record(rec: dict) -> dict:
    """One metadata line -> {item_id, title, description, category, brand, store, details,
    main_category} (values a string or None; the id as given, validated later).

    `parent_asin` -> item_id (the item the reviews point at; `asin` if absent); `description`
    (a list of paragraphs) joined with spaces, then `features` (a list of bullet points)
    appended as "Features: a; b"; `categories` (a flat list, often empty) joined with " > ",
    else `main_category`; `details` (a mapping such as {"Brand": .., "Material": ..}) flattened
    to "Key: value; ..." as the attribute `details`; `brand` from details' Brand /
    Manufacturer, else `store`; `store` and `main_category` kept as attributes.
    """
    details = rec.get("details") if isinstance(rec.get("details"), dict) else {}
    desc = " ".join(_strings(rec.get("description")))
    feats = _strings(rec.get("features"))
    if feats:
        desc = (desc + " " if desc else "") + "Features: " + "; ".join(feats)
    cats = _strings(rec.get("categories"))
    main = rec.get("main_category") if isinstance(rec.get("main_category"), str) else None
    brand = next((details[k] for k in ("Brand", "brand", "Manufacturer") if isinstance(details.get(k), str)), None)
    store = rec.get("store") if isinstance(rec.get("store"), str) else None
    return {
        "item_id": rec.get("parent_asin", rec.get("asin")),
        "title": rec.get("title"),
        "description": desc or None,
        "category": " > ".join(cats) if cats else main,
        "brand": brand or store,
        "store": store,
        "details": _details_text(details),
        "main_category": main,
    }


def review_record(rec: dict) -> dict:
    """One review line -> {user_id, item_id, ts} (`parent_asin`, else `asin`, is the item; ts in
    Unix milliseconds, as shipped)."""
    return {"user_id": rec.get("user_id"), "item_id": rec.get("parent_asin", rec.get("asin")),
            "ts": rec.get("timestamp")}


def iter_task(task, kind: str, columns, batch_rows: int) -> Iterator[tuple[dict, int]]:
    """adapters.iter_task for `format: amazon2023` (items: metadata; interactions: reviews).
    Attribute columns are read by name from the converted record (brand, store, details,
    main_category); `data.interactions.columns.ts: null` keeps file order instead of timestamps."""
    if kind == "items":
        mapping = {"item_id": "item_id", "title": "title", "description": "description", "category": "category"}
        mapping.update({a: a for a in columns.attributes})
        convert = item_record
    else:
        mapping = {"user_id": "user_id", "item_id": "item_id"}
        if columns.ts:
            mapping["ts"] = "ts"
        convert = review_record
    yield from _records_to_batches(task, _json_records(task), mapping, ["item_id"], kind, batch_rows,
                                   convert=convert)
