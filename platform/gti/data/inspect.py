"""`gti data inspect PATH [--interactions PATH]`: what is in a user's files, and the `data:`
config block that reads them.

What it is for: a new user points gti at their own catalog (and interactions) and gets, per
input: the detected format (`sniff_format`); each column with its type, null count and a few
examples (`profile`); a guess of the mapping to gti's fields (`guess_item_columns`,
`guess_interaction_columns`); a dry run of the real readers and row checks on the first
`--sample` rows (`dry_run`); and a YAML file holding a `data:` block that `gti config validate`
accepts and ingest reads.

What it does not know: Ray, the ingest stage's outputs.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from gti.data import adapters
from gti.data.readers import _csv_header, _json_records, _movielens_records
from gti.data.sources import ReadTask, _open, _parquet_file, detect_format, expand_paths, plan_tasks
from gti.data import catalog as cat
from gti.common.errors import DataError

EXAMPLES = 3
# Candidate column names per field, most specific first (normalised: see _norm).
ITEM_ID = ["itemid", "parentasin", "asin", "productid", "movieid", "bookid", "articleid", "sku", "iid", "id", "item"]
TITLE = ["title", "name", "productname", "itemname", "itemtitle", "movietitle", "producttitle", "headline"]
DESCRIPTION = ["description", "desc", "productdescription", "itemdescription", "longdescription", "summary",
               "overview", "blurb", "plot", "abstract", "about", "body", "text", "features"]
CATEGORY = ["category", "categories", "maincategory", "productcategory", "itemcategory", "genre", "genres",
            "categoryname", "department", "dept", "section", "producttype", "type"]
ATTRIBUTES = ["brand", "store", "manufacturer", "maker", "author", "artist", "publisher", "studio", "director",
              "color", "material", "tags", "keywords", "releasedate", "releaseyear", "year", "details"]
USER = ["userid", "user", "uid", "reviewerid", "customerid", "customer", "visitorid", "accountid", "memberid",
        "sessionid"]
INTER_ITEM = ["itemid", "parentasin", "asin", "productid", "movieid", "bookid", "articleid", "sku", "iid", "item", "product"]
TS = ["ts", "timestamp", "unixreviewtime", "unixtime", "time", "datetime", "eventtime", "createdat", "date", "ratedat"]
# Layout keys of the Amazon review dumps.
_AMAZON2023_ITEM_KEYS = {"features", "details", "main_category", "bought_together", "rating_number"}
_AMAZON_ITEM_KEYS = {"categories", "related", "salesRank", "imUrl", "also_buy", "also_view"}


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", str(name).lower())


@dataclass
class Column:
    name: str
    type: str
    nulls: int
    examples: list[str]
    int_like: bool = False  # every non-null value is an integer (or a string of digits)
    min_int: int | None = None


@dataclass
class Source:
    """What inspect found in one input (`kind` "items" or "interactions")."""

    kind: str
    path: str
    files: list[str]
    format: str  # the value for data.<kind>.format
    rows_sampled: int
    columns: list[Column]
    mapping: dict[str, Any]  # data.<kind>.columns as written
    read_errors: int = 0
    dry_run: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- sampling
def _type_name(values: list[Any]) -> str:
    kinds = Counter()
    for v in values:
        if isinstance(v, bool):
            kinds["bool"] += 1
        elif isinstance(v, int):
            kinds["int"] += 1
        elif isinstance(v, float):
            kinds["float"] += 1
        elif isinstance(v, str):
            kinds["string"] += 1
        elif isinstance(v, (bytes, bytearray)):
            kinds["bytes"] += 1
        elif isinstance(v, (list, tuple)):
            kinds["list"] += 1
        elif isinstance(v, dict):
            kinds["map"] += 1
        else:
            kinds[type(v).__name__] += 1
    if not kinds:
        return "empty"
    return "/".join(k for k, _ in kinds.most_common())


def _example(v: Any, width: int = 40) -> str:
    text = v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else (v if isinstance(v, str) else repr(v))
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _is_null(v: Any) -> bool:
    return v is None or (isinstance(v, float) and v != v) or (isinstance(v, str) and not v.strip())


def profile(records: list[dict[str, Any]], order: list[str] | None = None) -> list[Column]:
    """Columns of raw records (first-seen order, or `order`): type, nulls, examples."""
    names = list(order or [])
    for r in records:
        names.extend(k for k in r if k not in names and not str(k).startswith("_"))
    out = []
    for name in names:
        vals = [r.get(name) for r in records]
        present = [v for v in vals if not _is_null(v)]
        ints = [int(v) if not isinstance(v, str) else int(v.strip()) for v in present
                if (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, str) and re.fullmatch(r"\s*\d+\s*", v))]
        int_like = bool(present) and len(ints) == len(present)
        out.append(Column(name, _type_name(present), len(vals) - len(present),
                          [_example(v) for v in present[:EXAMPLES]], int_like, min(ints) if int_like else None))
    return out


def _raw_records(file: str, fmt: str, kind: str, n: int) -> tuple[list[dict], list[str] | None, int]:
    """Up to n raw records of one file as the user wrote them (names not mapped), the column
    order where the format has one, and how many lines could not be read."""
    task = ReadTask(file, fmt)
    if fmt == "parquet":
        pf = _parquet_file(file)
        rows: list[dict] = []
        for b in pf.iter_batches(batch_size=min(n, 65536)):
            rows.extend(b.to_pylist())
            if len(rows) >= n:
                break
        return rows[:n], pf.schema_arrow.names, 0
    if fmt in ("csv", "tsv"):
        import pyarrow as pa
        import pyarrow.csv as pacsv

        delim = "," if fmt == "csv" else "\t"
        header = _csv_header(task, delim)
        convert = pacsv.ConvertOptions(column_types={c: pa.string() for c in header}, strings_can_be_null=True)
        rows = []
        with _open(file) as fh:
            try:
                reader = pacsv.open_csv(fh, parse_options=pacsv.ParseOptions(delimiter=delim, newlines_in_values=True),
                                        convert_options=convert)
                for b in reader:
                    rows.extend(b.to_pylist())
                    if len(rows) >= n:
                        break
            except pa.ArrowInvalid as err:
                raise DataError(f"{file}: CSV parse error: {str(err).splitlines()[0]}") from None
        return rows[:n], header, 0
    if fmt == "movielens":
        recs = list(itertools.islice(_movielens_records(task, kind), n))
    else:
        recs = list(itertools.islice(_json_records(task, literal_ok=True), n))
    bad = sum(1 for r in recs if cat.READ_ERROR in r)
    return [r for r in recs if cat.READ_ERROR not in r], None, bad


def sniff_format(file: str, kind: str, records: list[dict] | None = None) -> str:
    """The reader for `file`: by extension (adapters.detect_format), then by layout keys: Amazon
    Reviews 2023 (`parent_asin` + `details`/`features`...: format `amazon2023`), the older Amazon
    metadata (`asin` + `categories`/`related`...: `amazon`), MovieLens ml-100k by file name
    (`u.item`, `u.data`)."""
    fmt = detect_format(file, "auto")
    if fmt in ("jsonl", "json") and records:
        keys = set().union(*(r.keys() for r in records))
        if kind == "items" and "parent_asin" in keys and keys & _AMAZON2023_ITEM_KEYS:
            return "amazon2023"
        if kind == "interactions" and {"parent_asin", "user_id", "timestamp"} <= keys:
            return "amazon2023"
        if kind == "items" and "asin" in keys and keys & _AMAZON_ITEM_KEYS and "reviewerID" not in keys:
            return "amazon"
    return fmt


# --------------------------------------------------------------------------- mapping
def _pick(columns: list[Column], candidates: list[str], taken: set[str], want_text: bool = False) -> str | None:
    by_norm: dict[str, Column] = {}
    for c in columns:
        by_norm.setdefault(_norm(c.name), c)
    for cand in candidates:
        c = by_norm.get(cand)
        if c is not None and c.name not in taken and (not want_text or "string" in c.type or "list" in c.type):
            return c.name
    return None


def guess_item_columns(columns: list[Column], fmt: str) -> dict[str, Any]:
    """data.items.columns for these columns (adapters of known layouts map names themselves):
    id, title, description, category, attributes, guessed by column name (normalised: lower
    case, letters and digits only)."""
    if fmt == "amazon2023":
        return {"attributes": ["brand", "details"]}
    if fmt == "amazon":
        return {"attributes": ["brand"] if any(c.name == "brand" for c in columns) else []}
    if fmt == "movielens":
        return {"attributes": ["release_date"]}
    taken: set[str] = set()
    out: dict[str, Any] = {}
    for key, cands, text in (("id", ITEM_ID, False), ("title", TITLE, True), ("description", DESCRIPTION, True),
                             ("category", CATEGORY, True)):
        name = _pick(columns, cands, taken, want_text=text)
        out[key] = name
        if name:
            taken.add(name)
    out["attributes"] = [c.name for c in columns if _norm(c.name) in ATTRIBUTES and c.name not in taken]
    return out


def guess_interaction_columns(columns: list[Column], fmt: str) -> dict[str, Any]:
    """data.interactions.columns: user, item, ts (None: file order is time order); by column
    name, then by content for timestamps (integers that look like Unix times)."""
    if fmt in ("amazon2023", "movielens"):
        return {}  # the adapter maps them; ts stays the default
    taken: set[str] = set()
    user = _pick(columns, USER, taken)
    taken.add(user or "")
    item = _pick(columns, INTER_ITEM, taken)
    taken.add(item or "")
    ts = _pick(columns, TS, taken)
    if ts is None:  # by content: integers that look like Unix seconds or milliseconds
        ts = next((c.name for c in columns if c.name not in taken and c.int_like and (c.min_int or 0) > 10**8), None)
    return {"user": user, "item": item, "ts": ts}


# --------------------------------------------------------------------------- dry run
def _slice(raw: dict[str, list], n: int) -> dict[str, list]:
    return {k: v[:n] for k, v in raw.items()}


def _read_sample(files: list[str], fmt: str, kind: str, columns, n: int):
    """([(file, raw batch, first row)] of the first n rows through the real reader, whether
    that is every row). One row past the sample is read to tell, then dropped."""
    out, left = [], n + 1
    for t in plan_tasks(files, fmt):
        for raw, first in adapters.iter_task(t, kind, columns, batch_rows=min(left, 8192)):
            rows = cat._n_rows(raw)
            take = min(rows, left)
            out.append((t.file, _slice(raw, take) if take < rows else raw, first))
            left -= take
            if left == 0:
                break
        if left == 0:
            break
    complete = left > 0
    if not complete:
        file, raw, first = out.pop()
        if cat._n_rows(raw) > 1:
            out.append((file, _slice(raw, cat._n_rows(raw) - 1), first))
    return out, complete


def dry_run(cfg: Any, n: int, with_interactions: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Quarantine reasons ingest would give on the first n rows of each input (through
    `gti.data.adapters` and `gti.data.catalog`): ({rows, ok, reasons, complete}, same for
    interactions plus users, or None). Whole-catalog checks need the whole files, so
    `unknown_item` and `short_sequence` are counted only when the sample covered both files;
    otherwise the report says they were not checked."""
    d = cfg.data
    items_files = expand_paths(d.items.path, "items")
    batches, items_complete = _read_sample(items_files, d.items.format, "items", d.items.columns, n)
    reasons: Counter[str] = Counter()
    kept: set[str] = set()
    rows = 0
    for file, raw, first in batches:
        t = cat.validate_items(raw, list(d.items.columns.attributes), d.max_text_chars, file, first)
        rows += t.num_rows
        for iid, reason in zip(t.column("item_id").to_pylist(), t.column("reason").to_pylist()):
            if reason is None and iid in kept:
                reason = cat.DUPLICATE_ID
            if reason:
                reasons[reason] += 1
            else:
                kept.add(iid)
    items = {"rows": rows, "ok": len(kept), "reasons": dict(reasons.most_common()), "complete": items_complete}
    inter: dict[str, Any] | None = None
    if with_interactions:
        src = d.interactions
        files = expand_paths(src.path, "interactions")
        ibatches, inter_complete = _read_sample(files, src.format, "interactions", src.columns, n)
        has_ts = src.columns.ts is not None or any(detect_format(f, src.format) == "movielens" for f in files)
        r2: Counter[str] = Counter()
        per_user: Counter[str] = Counter()
        rows = ok = 0
        for file, raw, first in ibatches:
            t = cat.validate_interactions(raw, has_ts, file, first)
            rows += t.num_rows
            for u, it, reason in zip(t.column("user_id").to_pylist(), t.column("item_id").to_pylist(),
                                     t.column("reason").to_pylist()):
                if reason is None and items_complete and it not in kept:
                    reason = cat.UNKNOWN_ITEM
                if reason:
                    r2[reason] += 1
                else:
                    ok += 1
                    per_user[u] += 1
        whole = items_complete and inter_complete
        if whole:
            short = sum(c for c in per_user.values() if c < d.min_seq_len)
            if short:
                r2[cat.SHORT_SEQUENCE] += short
                ok -= short
        inter = {"rows": rows, "ok": ok, "reasons": dict(r2.most_common()), "complete": inter_complete,
                 "users": sum(1 for c in per_user.values() if c >= d.min_seq_len) if whole else len(per_user),
                 "whole_catalog_checks": whole}
    return items, inter


# --------------------------------------------------------------------------- the command
def inspect_source(path: str, kind: str, n: int) -> Source:
    files = expand_paths(path, kind)
    concrete = detect_format(files[0], "auto")
    records, order, bad = _raw_records(files[0], concrete, kind, n)
    fmt = sniff_format(files[0], kind, records)
    cols = profile(records, order)
    if fmt in ("amazon2023", "amazon"):
        cols = profile(records)  # JSON keys, first-seen order
    mapping = guess_item_columns(cols, fmt) if kind == "items" else guess_interaction_columns(cols, fmt)
    cfg_fmt = "csv" if fmt == "tsv" else fmt
    return Source(kind, path, files, cfg_fmt, len(records), cols, mapping, read_errors=bad)


def data_block(items: Source, inter: Source | None) -> dict[str, Any]:
    def section(s: Source) -> dict[str, Any]:
        out: dict[str, Any] = {"path": s.path, "format": s.format}
        if s.mapping:
            out["columns"] = dict(s.mapping)
        return out

    block: dict[str, Any] = {"items": section(items)}
    if inter is not None:
        block["interactions"] = section(inter)
    return {"data": block}


def _missing_required(items: Source, inter: Source | None) -> str | None:
    if items.format not in ("amazon", "amazon2023", "movielens") and not items.mapping.get("id"):
        names = ", ".join(c.name for c in items.columns[:12])
        return f"{items.path}: no column looks like the item id (columns: {names}); set data.items.columns.id in the written file"
    if inter is not None and inter.format not in ("amazon2023", "movielens"):
        for key in ("user", "item"):
            if not inter.mapping.get(key):
                names = ", ".join(c.name for c in inter.columns[:12])
                return (f"{inter.path}: no column looks like the {key} id (columns: {names}); "
                        f"set data.interactions.columns.{key} in the written file")
    return None


def report(s: Source) -> list[str]:
    lines = [f"{s.kind}: {s.path} (format {s.format}, {len(s.files)} file(s); {s.rows_sampled:,} row(s) sampled"
             + (f", {s.read_errors} unreadable line(s)" if s.read_errors else "") + ")"]
    types = [f"{c.type} (integers)" if c.type == "string" and c.int_like else c.type for c in s.columns]
    w = max([len(c.name) for c in s.columns] + [6])
    tw = max([len(t) for t in types] + [4])
    lines.append(f"  {'column'.ljust(w)}  {'type'.ljust(tw)}  nulls  examples")
    for c, t in zip(s.columns, types):
        lines.append(f"  {c.name.ljust(w)}  {t.ljust(tw)}  {str(c.nulls).rjust(5)}  " + " | ".join(c.examples))
    if s.mapping:
        pairs = ", ".join(f"{k} <- {v if v is not None else '(none)'}" for k, v in s.mapping.items())
    else:
        pairs = "by the adapter"
    lines.append(f"  mapping (data.{s.kind}.columns): {pairs}")
    if s.kind == "interactions" and s.mapping and s.mapping.get("ts") is None:
        lines.append("  no timestamp column found: ts: null (file order is time order)")
    return lines


def _dry_lines(kind: str, res: dict[str, Any], min_seq_len: int) -> list[str]:
    q = res["rows"] - res["ok"]
    reasons = ", ".join(f"{k} {v:,}" for k, v in res["reasons"].items()) or "none"
    line = f"  dry run ({kind}, {res['rows']:,} rows{'' if res['complete'] else ', a sample'}): {res['ok']:,} ok, {q:,} would be quarantined ({reasons})"
    out = [line]
    if kind == "interactions":
        if res.get("whole_catalog_checks"):
            out.append(f"  {res['users']:,} user(s) with >= data.min_seq_len={min_seq_len} interactions")
        else:
            out.append("  unknown_item and short_sequence not checked: the sample does not hold whole files "
                       "(raise --sample to check them)")
    return out


def cli_main(args, validate: Callable[[dict, str], Any]) -> int:
    """`gti data inspect PATH [--interactions PATH] [--sample N] [--out FILE] [--force]`;
    `validate(block, source) -> RunConfig` is `gti.config.validate` (passed in by the CLI)."""
    out = Path(args.out)
    if out.exists() and not args.force:
        raise DataError(f"{out}: exists; pass --out to write elsewhere or --force to replace it")
    n = int(args.sample)
    if n < 1:
        raise DataError("--sample must be at least 1")
    items = inspect_source(args.path, "items", n)
    inter = inspect_source(args.interactions, "interactions", n) if args.interactions else None
    for s in [items] + ([inter] if inter else []):
        print("\n".join(report(s)))
    problem = _missing_required(items, inter)
    block = data_block(items, inter)
    if problem is None:
        cfg = validate(block, "<gti data inspect>")
        ires, xres = dry_run(cfg, n, with_interactions=inter is not None)
        print("\n".join(_dry_lines("items", ires, cfg.data.min_seq_len)))
        if xres is not None:
            print("\n".join(_dry_lines("interactions", xres, cfg.data.min_seq_len)))
    cmd = f"gti data inspect {args.path}" + (f" --interactions {args.interactions}" if args.interactions else "")
    header = [f"# Written by: {cmd}", f"# Check it: gti config validate --config {out}",
              "# Use it: copy this data: block into your run config (or pass this file's keys as overrides)."]
    if inter is None:
        header.append("# No --interactions given: data.interactions still points at the bundled data set.")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(header) + "\n" + yaml.safe_dump(block, sort_keys=False))
    if problem is not None:
        raise DataError(problem)
    print(f"wrote {out}; check it with: gti config validate --config {out}")
    return 0

