"""Synthetic catalogs and interaction logs for scale tests (`gti data synth`).

What it is for: writing `--items N` items and `--users M` users' interactions that look like a
product catalog — a three-level category tree (department > family > product type), templated
titles and descriptions, brands per product type — with sequences driven by latent
preferences: each user prefers a few product types, picks from them most of the time (with a
popularity skew inside a type, and a chance to follow the previous item's type) and explores
uniformly otherwise. That gives the content embeddings, semantic IDs and recommenders real
structure to find.

Scale: everything is generated in fixed-size chunks with a generator seeded by (seed, chunk
index), so memory is bounded by one chunk whatever N is (10M items is fine) and the output is
the same for the same (N, M, seed) on every machine. An item's product type is a function of its
index (`item % n_types`, through a fixed permutation), so users can sample items of a type
without any table of all items.

Output: `<out>/items/part-00000.<ext>` ... (item_id, title, description, category, brand) and
`<out>/interactions/part-00000.<ext>` (user_id, item_id, ts), plus `<out>/synth.json` with the
parameters and counts. Point `data.items.path` / `data.interactions.path` at the two folders.

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


def generate(n_items: int, n_users: int | None, out: str | Path, seed: int = 0, fmt: str = "parquet",
             chunk: int = CHUNK, log=lambda m: print(m, file=sys.stderr, flush=True)) -> dict:
    """Write the synthetic data set; returns the summary also written to synth.json."""
    if n_items < 1:
        raise ValueError("--items must be >= 1")
    n_users = n_items // 2 if n_users is None else n_users
    out = Path(out)
    (out / "items").mkdir(parents=True, exist_ok=True)
    (out / "interactions").mkdir(parents=True, exist_ok=True)
    ext = {"parquet": "parquet", "csv": "csv", "jsonl": "jsonl"}[fmt]
    tax = Taxonomy(seed)
    t0 = time.time()
    for c, start in enumerate(range(0, n_items, chunk)):
        _write(_items_chunk(tax, start, min(start + chunk, n_items), seed, c), out / "items" / f"part-{c:05d}.{ext}", fmt)
        if c % 10 == 9:
            log(f"synth: {min(start + chunk, n_items):,}/{n_items:,} items ({time.time() - t0:.0f}s)")
    n_inter = 0
    user_chunk = max(1, chunk // 8)  # ~8 interactions per user keeps chunks about the same size
    for c, start in enumerate(range(0, n_users, user_chunk)):
        t = _users_chunk(tax, n_items, start, min(start + user_chunk, n_users), seed, c)
        n_inter += t.num_rows
        _write(t, out / "interactions" / f"part-{c:05d}.{ext}", fmt)
    summary = {"items": n_items, "users": n_users, "interactions": n_inter, "seed": seed, "format": fmt,
               "category_types": tax.n_types, "items_path": str(out / "items"),
               "interactions_path": str(out / "interactions"), "seconds": round(time.time() - t0, 2)}
    (out / "synth.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def cli_main(args) -> int:
    """`gti data synth --items N [--users M] --out DIR --seed S --format F`."""
    from gti.errors import GtiError

    if args.items < 1 or (args.users is not None and args.users < 0):
        raise GtiError("gti data synth: --items must be >= 1 and --users >= 0")
    s = generate(args.items, args.users, args.out, args.seed, args.format)
    print(f"wrote {s['items']:,} items, {s['users']:,} users, {s['interactions']:,} interactions "
          f"in {s['seconds']}s to {args.out}")
    print(f"use: data.items.path={s['items_path']} data.interactions.path={s['interactions_path']}")
    return 0
