"""MiniOneRec's data folder read as a catalog, interactions and the time split they carry.

What it is for: MiniOneRec (and D3 / BIGRec before it) ship a data set as train/valid/test CSVs
of one row per interaction that has an earlier one, plus `index/<name>.item.json` (the items)
and `index/<name>.index.json` (their SID tokens, read by `sid.method: file`). `find_files(root,
dataset)` locates them; `read(files)` rebuilds each user's sequence with invented timestamps,
so the rows gti derives with `data.split: global_time` are the files' rows. Item ids are the
files' indices as strings, so index.json's keys are item ids as they stand.

What it does not know: Ray, the run config, ingest's checks (the tables it returns go through
them), SIDs (`gti.sid.from_file` reads index.json).
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from gti.common.errors import DataError

SPLIT_DIRS = ("train", "valid", "test")
REQUIRED = ("user_id", "history_item_id", "item_id")
ITEM_FIELDS = {"title": "title", "description": "description", "category": "categories", "brand": "brand"}


@dataclass
class Files:
    """The CSVs, rows `user_id, history_item_title, item_title, history_item_id, item_id, ...`:
    one row per interaction that has an earlier one (the last <= 10 items before it, then it),
    every row of all three files sorted by the target's time and cut 8:1:1; item.json maps an
    item index to its title, description, brand and categories."""

    train: Path
    valid: Path
    test: Path
    item_json: Path
    index_json: Path | None  # their SIDs, for sid.path (None: the folder has none)


@dataclass
class Converted:
    items: pl.DataFrame  # item_id, title, description, category, brand (all strings)
    interactions: pl.DataFrame  # user_id, item_id, ts (int64, invented in file order)
    cuts: tuple[int, int]  # first valid ts, first test ts
    facts: dict = field(default_factory=dict)


def _one(folder: Path, pattern: str, dataset: str | None, what: str) -> Path | None:
    found = sorted(p for p in folder.glob(pattern) if dataset is None or p.name.startswith(dataset))
    if len(found) > 1:
        raise DataError(f"data.root: {len(found)} {what} files in {folder} ({', '.join(p.name for p in found)}); "
                        "set data.dataset to the name they start with")
    return found[0] if found else None


def find_files(root: str | Path, dataset: str | None = None) -> Files:
    """The folder's train/valid/test CSVs and index files (`dataset`: the name they start with).
    DataError naming the folder when one is missing or several match."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise DataError(f"data.root {root}: not a folder")
    csvs = {}
    for split in SPLIT_DIRS:
        csvs[split] = _one(root / split, "*.csv", dataset, f"{split} CSV")
        if csvs[split] is None:
            raise DataError(f"data.root {root}: no {split}/*.csv"
                            + (f" starting with '{dataset}'" if dataset else ""))
    index_dir = root / "index" if (root / "index").is_dir() else root
    item_json = _one(index_dir, "*.item.json", dataset, "item.json")
    if item_json is None:
        raise DataError(f"data.root {root}: no {index_dir.name}/*.item.json (the items' titles)")
    return Files(csvs["train"], csvs["valid"], csvs["test"], item_json,
                 _one(index_dir, "*.index.json", dataset, "index.json"))


def _id_list(text: str, where: str) -> list[str]:
    """'[3466, 2697]' (their history_item_id) -> ['3466', '2697']."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise DataError(f"{where}: history_item_id {text[:60]!r} is not a list of item indices") from None
    if not isinstance(value, list):
        raise DataError(f"{where}: history_item_id {text[:60]!r} is not a list of item indices")
    return [str(v) for v in value]


def read_items(path: Path) -> pl.DataFrame:
    """item.json (an object index -> record, or a list: the position is the index) as a table."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: cannot read item.json: {err}") from None
    pairs = raw.items() if isinstance(raw, dict) else enumerate(raw)
    rows = []
    for key, rec in pairs:
        if not isinstance(rec, dict):
            raise DataError(f"{path}: item '{key}' is not an object with a title")
        rows.append({"item_id": str(key), **{ours: None if rec.get(theirs) in (None, "") else str(rec[theirs])
                                            for ours, theirs in ITEM_FIELDS.items()}})
    if not rows:
        raise DataError(f"{path}: no items")
    return pl.DataFrame(rows, schema={c: pl.Utf8 for c in ("item_id", *ITEM_FIELDS)})


def _rows(path: Path) -> pl.DataFrame:
    try:
        df = pl.read_csv(path, infer_schema=False)
    except (OSError, pl.exceptions.PolarsError) as err:
        raise DataError(f"{path}: cannot read the CSV: {str(err).splitlines()[0]}") from None
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing} (MiniOneRec's CSVs have {list(REQUIRED)})")
    return df.select(REQUIRED)


def read(files: Files) -> Converted:
    """The catalog and the interactions the three files describe.

    Each user's sequence is the first row's history, then every row's target, in file order
    (train, valid, test), checked: every row's history must be the end of what came before it.
    Timestamps are invented, in file order: row t (counted over the three files) has its target
    at 2t + 1 and a user's first history items at 2t, so the two cut timestamps (`cuts`) put
    every interaction in its file's period, and a user's first items in the period of their
    first row (never an earlier one)."""
    items = read_items(files.item_json)
    known = set(items["item_id"].to_list())
    seqs: dict[str, list[str]] = {}
    users, item_ids, ts = [], [], []
    t = 0
    counts = {}
    for split in SPLIT_DIRS:
        path = getattr(files, split)
        df = _rows(path)
        counts[split] = df.height
        for r, (user, hist_text, target) in enumerate(df.iter_rows()):
            where = f"{path} row {r}"
            if user is None or target is None:
                raise DataError(f"{where}: empty user_id or item_id")
            hist = _id_list(hist_text or "[]", where)
            for item in (*hist, target):
                if item not in known:
                    raise DataError(f"{where}: item {item} is not in {files.item_json.name}")
            seq = seqs.get(user)
            if seq is None:  # the user's first row: its history is where the user started
                seq = seqs[user] = list(hist)
                users += [user] * len(hist)
                item_ids += hist
                ts += [2 * t] * len(hist)
            elif hist and seq[-len(hist):] != hist:
                raise DataError(f"{where}: user {user}'s history_item_id {hist} is not the end of the items "
                                f"before it in the files (…{seq[-len(hist):]}); rows of a user must follow "
                                "each other in time, train before valid before test")
            seq.append(target)
            users.append(user)
            item_ids.append(target)
            ts.append(2 * t + 1)
            t += 1
    if counts["valid"] == 0 or counts["test"] == 0:
        raise DataError(f"data.root: the valid and test CSVs need rows ({counts})")
    inter = pl.DataFrame({"user_id": users, "item_id": item_ids, "ts": ts},
                         schema={"user_id": pl.Utf8, "item_id": pl.Utf8, "ts": pl.Int64})
    cuts = (2 * counts["train"], 2 * (counts["train"] + counts["valid"]))
    facts = {"layout": "minionerec", "files": {s: getattr(files, s).name for s in SPLIT_DIRS},
             "item_json": files.item_json.name, "rows": counts, "users": len(seqs),
             "index_json": None if files.index_json is None else files.index_json.name}
    return Converted(items, inter, cuts, facts)
