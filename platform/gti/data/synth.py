"""Synthetic catalogs and interaction logs for scale tests (`gti data synth`).

What it is for: `--items N` items and `--users M` users' interactions that look like a product
catalog (a category tree, templated titles and descriptions, brands), with sequences driven by
latent preferences over product types, so embeddings, SIDs and recommenders have structure to
find. Generated in chunks seeded by (seed, chunk index): memory is one chunk whatever N is, and
the output is the same for the same (N, M, seed) on every machine. Output: `<out>/items/`,
`<out>/interactions/` and `<out>/synth.json`. `--walk` (`generate_walk`) writes a learnability
set instead: every user walks a fixed random cycle of the catalog, so the next item is a
function of the previous one; a pipeline that cannot learn it is broken.

What it does not know: validation or Ray; it only writes files.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

CHUNK = 100_000
DEPARTMENTS = ["Lab Equipment", "Safety", "Electronics", "Hand Tools", "Office", "Kitchen", "Garden", "Sports"]
FAMILIES = ["Measuring", "Storage", "Cleaning", "Cutting", "Heating", "Lighting", "Fastening", "Protective",
            "Mixing", "Testing", "Carrying", "Display"]
PRODUCTS = ["beaker", "flask", "pipette", "glove", "goggle", "caliper", "multimeter", "soldering iron",
            "screwdriver", "wrench", "stapler", "notebook", "kettle", "whisk", "trowel", "hose", "ball",
            "racket", "cable", "sensor", "battery", "lamp", "tape", "scale", "thermometer", "funnel",
            "brush", "bucket", "drill bit", "clamp", "mask", "helmet", "tray", "rack", "timer", "magnet",
            "filter", "pump", "valve", "label", "marker", "scissors", "knife", "bottle", "jar", "box",
            "bag", "mat", "stand", "holder", "adapter", "switch", "fan", "heater", "cooler", "vacuum",
            "sprayer", "net", "rope", "hook"]
ADJECTIVES = ["heavy-duty", "compact", "professional", "portable", "premium", "durable", "lightweight",
              "adjustable", "precision", "ergonomic", "reusable", "digital", "classic", "industrial",
              "waterproof", "foldable"]
MATERIALS = ["stainless steel", "borosilicate glass", "aluminium", "nitrile", "bamboo", "silicone",
             "polypropylene", "brass", "carbon fibre", "oak", "nylon", "ceramic"]
USES = ["everyday lab work", "field testing", "home workshops", "school projects", "commercial kitchens",
        "outdoor use", "precise measurement", "safe handling", "quick repairs", "long shifts"]
BRAND_PARTS_A = ["Nor", "Vex", "Lum", "Tri", "Axi", "Zen", "Kor", "Mira", "Sol", "Pro", "Ultra", "Terra"]
BRAND_PARTS_B = ["tek", "lab", "line", "works", "gear", "ex", "core", "craft", "tron", "max"]
SIZES = ["50 ml", "100 ml", "250 ml", "500 ml", "1 l", "small", "medium", "large", "6 inch", "12 inch",
         "pack of 2", "pack of 10", "set of 3", "XL"]
N_FAMILIES_PER_DEPT = 6
N_TYPES_PER_FAMILY = 5
BRANDS_PER_TYPE = 4


class Taxonomy:
    """The category tree and the per-type vocab, built deterministically from the seed."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng([seed, 7919])
        self.paths: list[tuple[str, str, str]] = []
        for dept in DEPARTMENTS:
            for fam in rng.choice(FAMILIES, N_FAMILIES_PER_DEPT, replace=False):
                for prod in rng.choice(PRODUCTS, N_TYPES_PER_FAMILY, replace=False):
                    self.paths.append((dept, f"{fam} {dept.split()[0]}", str(prod)))
        self.n_types = len(self.paths)
        brands = [a + b for a in BRAND_PARTS_A for b in BRAND_PARTS_B]
        self.brands = [list(rng.choice(brands, BRANDS_PER_TYPE, replace=False)) for _ in range(self.n_types)]
        # Which type an item index has: a fixed permutation of index % n_types.
        self.type_of_residue = rng.permutation(self.n_types)
        self.residue_of_type = np.argsort(self.type_of_residue)
        self.category = [" > ".join(p) for p in self.paths]

    def item_type(self, idx: np.ndarray) -> np.ndarray:
        return self.type_of_residue[idx % self.n_types]


def _items_chunk(tax: Taxonomy, start: int, stop: int, seed: int, chunk_id: int) -> pa.Table:
    rng = np.random.default_rng([seed, 1, chunk_id])
    idx = np.arange(start, stop)
    types = tax.item_type(idx)
    n = len(idx)
    adj = rng.integers(0, len(ADJECTIVES), n)
    mat = rng.integers(0, len(MATERIALS), n)
    use = rng.integers(0, len(USES), n)
    size = rng.integers(0, len(SIZES), n)
    brand = rng.integers(0, BRANDS_PER_TYPE, n)
    model = rng.integers(100, 10_000, n)
    titles, descs, cats, brands = [], [], [], []
    for k in range(n):
        t = types[k]
        _, fam, prod = tax.paths[t]
        b = tax.brands[t][brand[k]]
        titles.append(f"{b} {ADJECTIVES[adj[k]]} {MATERIALS[mat[k]]} {prod}, {SIZES[size[k]]}, model {model[k]}")
        descs.append(
            f"A {ADJECTIVES[adj[k]]} {prod} made of {MATERIALS[mat[k]]} for {USES[use[k]]}. "
            f"Part of the {b} {fam.lower()} range."
        )
        cats.append(tax.category[t])
        brands.append(b)
    return pa.table({"item_id": [str(i) for i in idx], "title": titles, "description": descs,
                     "category": cats, "brand": brands})


def _users_chunk(tax: Taxonomy, n_items: int, start: int, stop: int, seed: int, chunk_id: int) -> pa.Table:
    """Interactions of users [start, stop): lengths 5 + geometric, latent preferred types."""
    rng = np.random.default_rng([seed, 2, chunk_id])
    n_users = stop - start
    lengths = 5 + rng.geometric(0.25, n_users) - 1  # mean ~ 8
    total = int(lengths.sum())
    user_of_row = np.repeat(np.arange(start, stop), lengths)
    first_row = np.repeat(np.cumsum(lengths) - lengths, lengths)
    pos = np.arange(total) - first_row
    prefs = rng.integers(0, tax.n_types, (n_users, 3))  # three preferred types per user
    which = rng.integers(0, 3, total)
    pref_type = prefs[user_of_row - start, which]
    explore = rng.random(total) < 0.15
    types = np.where(explore, rng.integers(0, tax.n_types, total), pref_type)
    # Follow the previous item's type with probability 0.3 (sequential structure).
    follow = (rng.random(total) < 0.3) & (pos > 0)
    for _ in range(2):  # two passes propagate short runs; enough for structure
        prev = np.roll(types, 1)
        types = np.where(follow, prev, types)
    residue = tax.residue_of_type[types]
    per_type = np.maximum(1, (n_items - residue + tax.n_types - 1) // tax.n_types)
    # Popularity skew inside a type: k = floor(count * u^3) favours low k.
    k = np.floor(per_type * rng.random(total) ** 3).astype(np.int64)
    items = np.minimum(k * tax.n_types + residue, n_items - 1)
    return _interactions_table(rng, items, user_of_row, first_row, start, n_users)


def _interactions_table(rng, items: np.ndarray, user_of_row: np.ndarray, first_row: np.ndarray,
                        start: int, n_users: int) -> pa.Table:
    """(user_id, item_id, ts) with random gaps; timestamps increase within each user."""
    total = len(items)
    gaps = rng.integers(60, 86_400 * 3, total)
    base = 1_600_000_000 + rng.integers(0, 86_400 * 365, n_users)
    # Per-user cumulative time: subtract each user's starting offset from a global cumsum.
    cum = np.cumsum(gaps)
    ts = base[user_of_row - start] + cum - cum[first_row] + gaps[first_row]
    return pa.table({"user_id": [f"u{u}" for u in user_of_row], "item_id": [str(i) for i in items],
                     "ts": pa.array(ts, pa.int64())})


def _write(table: pa.Table, path: Path, fmt: str) -> None:
    if fmt == "parquet":
        pq.write_table(table, path, compression="zstd")
    elif fmt == "csv":
        pacsv.write_csv(table, path)
    elif fmt == "jsonl":
        cols = table.column_names
        data = [table.column(c).to_pylist() for c in cols]
        with open(path, "w", encoding="utf-8") as fh:
            for row in zip(*data):
                fh.write(json.dumps(dict(zip(cols, row)), ensure_ascii=False) + "\n")
    else:
        raise ValueError(f"unknown format {fmt!r}")


def _write_items(tax: Taxonomy, n_items: int, out: Path, seed: int, fmt: str, chunk: int, log, t0: float) -> None:
    ext = {"parquet": "parquet", "csv": "csv", "jsonl": "jsonl"}[fmt]
    for c, start in enumerate(range(0, n_items, chunk)):
        _write(_items_chunk(tax, start, min(start + chunk, n_items), seed, c), out / "items" / f"part-{c:05d}.{ext}", fmt)
        if c % 10 == 9:
            log(f"synth: {min(start + chunk, n_items):,}/{n_items:,} items ({time.time() - t0:.0f}s)")


def _start(n_items: int, out: str | Path, seed: int, fmt: str, chunk: int, log):
    """Output folders, file extension and taxonomy, then the items written: what every data
    set shares. Returns (out, ext, taxonomy, start time)."""
    out = Path(out)
    (out / "items").mkdir(parents=True, exist_ok=True)
    (out / "interactions").mkdir(parents=True, exist_ok=True)
    ext = {"parquet": "parquet", "csv": "csv", "jsonl": "jsonl"}[fmt]
    tax = Taxonomy(seed)
    t0 = time.time()
    _write_items(tax, n_items, out, seed, fmt, chunk, log, t0)
    return out, ext, tax, t0


def generate(n_items: int, n_users: int | None, out: str | Path, seed: int = 0, fmt: str = "parquet",
             chunk: int = CHUNK, log=lambda m: print(m, file=sys.stderr, flush=True)) -> dict:
    """Write the synthetic data set; returns the summary also written to synth.json."""
    if n_items < 1:
        raise ValueError("--items must be >= 1")
    n_users = n_items // 2 if n_users is None else n_users
    out, ext, tax, t0 = _start(n_items, out, seed, fmt, chunk, log)
    n_inter = 0
    user_chunk = max(1, chunk // 8)  # ~8 interactions per user keeps chunks about the same size
    for c, start in enumerate(range(0, n_users, user_chunk)):
        t = _users_chunk(tax, n_items, start, min(start + user_chunk, n_users), seed, c)
        n_inter += t.num_rows
        _write(t, out / "interactions" / f"part-{c:05d}.{ext}", fmt)
    summary = {"kind": "preference", "items": n_items, "users": n_users, "interactions": n_inter, "seed": seed,
               "format": fmt, "category_types": tax.n_types, "items_path": str(out / "items"),
               "interactions_path": str(out / "interactions"), "seconds": round(time.time() - t0, 2)}
    (out / "synth.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


WALK_MIN_LEN = 8
WALK_MAX_LEN = 14


def walk_permutation(n_items: int, seed: int) -> np.ndarray:
    """The catalog cycle of `generate_walk`: item p[i] is always followed by p[(i + 1) % n]."""
    return np.random.default_rng([seed, 3]).permutation(n_items)


def _walk_users_chunk(perm: np.ndarray, start: int, stop: int, min_len: int, max_len: int, seed: int,
                      chunk_id: int) -> pa.Table:
    """Interactions of users [start, stop): a walk along the cycle from a uniform position."""
    rng = np.random.default_rng([seed, 4, chunk_id])
    n_users, n_items = stop - start, len(perm)
    lengths = rng.integers(min_len, max_len + 1, n_users)
    first = rng.integers(0, n_items, n_users)
    total = int(lengths.sum())
    user_of_row = np.repeat(np.arange(start, stop), lengths)
    first_row = np.repeat(np.cumsum(lengths) - lengths, lengths)
    pos = np.arange(total) - first_row
    items = perm[(np.repeat(first, lengths) + pos) % n_items]
    return _interactions_table(rng, items, user_of_row, first_row, start, n_users)


def generate_walk(n_items: int, n_users: int | None, out: str | Path, seed: int = 0, fmt: str = "parquet",
                  min_len: int = WALK_MIN_LEN, max_len: int = WALK_MAX_LEN, chunk: int = CHUNK,
                  log=lambda m: print(m, file=sys.stderr, flush=True)) -> dict:
    """Write a learnability data set: the same items as `generate`, but interactions that walk a
    fixed cycle of the catalog, so the next item is a deterministic function of the previous one.

    A seeded permutation p of the items defines the cycle p[0] -> p[1] -> ... -> p[n-1] -> p[0]
    (`walk_permutation`). Each user starts at a uniformly random position and follows the cycle
    for a length drawn uniformly from [min_len, max_len], with increasing timestamps (a walk
    longer than the catalog wraps around). A model that cannot reach near-perfect next-item
    accuracy here (a first-order Markov baseline does) is not learning. `n_users` None means
    20 * n_items. Returns the summary also written to synth.json ("kind": "walk").
    """
    if n_items < 1:
        raise ValueError("--items must be >= 1")
    if min_len < 4:
        raise ValueError("--min-len must be >= 4 (leave-one-out needs train, valid and test items)")
    if max_len < min_len:
        raise ValueError("--max-len must be >= --min-len")
    n_users = 20 * n_items if n_users is None else n_users
    if n_users < 0:
        raise ValueError("--users must be >= 0")
    out, ext, tax, t0 = _start(n_items, out, seed, fmt, chunk, log)
    perm = walk_permutation(n_items, seed)
    n_inter = 0
    user_chunk = max(1, chunk // max_len)
    for c, start in enumerate(range(0, n_users, user_chunk)):
        t = _walk_users_chunk(perm, start, min(start + user_chunk, n_users), min_len, max_len, seed, c)
        n_inter += t.num_rows
        _write(t, out / "interactions" / f"part-{c:05d}.{ext}", fmt)
    summary = {"kind": "walk", "items": n_items, "users": n_users, "interactions": n_inter, "seed": seed,
               "format": fmt, "min_len": min_len, "max_len": max_len,
               "permutation_head": [str(i) for i in perm[:10]], "category_types": tax.n_types,
               "items_path": str(out / "items"), "interactions_path": str(out / "interactions"),
               "seconds": round(time.time() - t0, 2)}
    (out / "synth.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def cli_main(args) -> int:
    """`gti data synth --items N [--users M] --out DIR --seed S --format F [--walk --min-len A --max-len B]`."""
    from gti.common.errors import GtiError

    if args.items < 1 or (args.users is not None and args.users < 0):
        raise GtiError("gti data synth: --items must be >= 1 and --users >= 0")
    if getattr(args, "walk", False):
        min_len = WALK_MIN_LEN if args.min_len is None else args.min_len
        max_len = WALK_MAX_LEN if args.max_len is None else args.max_len
        if min_len < 4 or max_len < min_len:
            raise GtiError(f"gti data synth --walk: need 4 <= --min-len <= --max-len, got {min_len} and {max_len}")
        s = generate_walk(args.items, args.users, args.out, args.seed, args.format, min_len, max_len)
    else:
        if getattr(args, "min_len", None) is not None or getattr(args, "max_len", None) is not None:
            raise GtiError("gti data synth: --min-len/--max-len only apply with --walk")
        s = generate(args.items, args.users, args.out, args.seed, args.format)
    print(f"wrote {s['items']:,} items, {s['users']:,} users, {s['interactions']:,} interactions "
          f"in {s['seconds']}s to {args.out}" + (" (permutation walk)" if s["kind"] == "walk" else ""))
    print(f"use: data.items.path={s['items_path']} data.interactions.path={s['interactions_path']}")
    return 0
