"""Grounding pairs of catalog items: a batch of items with their SID codes -> pairs rows.

What it is for: `RenderPairs` is the one renderer of the grounding data set. The `pairs` stage
maps it over the catalog (Ray Data's `map_batches` with an actor pool, or in its own process for
a small catalog) and `gti refresh` over its new items. One call takes a pyarrow batch of
`ITEM_COLUMNS` plus `codes` (list<int>, one code per level) and returns `PAIRS_SCHEMA` rows
(`gti.data.schemas`), one per grounding task, rendered by `gti.lm.templates.PairRenderer`;
`is_val_item` picks the validation items. An item without codes, or with codes outside the
codec, is a DataError naming it.

What it does not know: files, Ray, the config type (the `pairs` section arrives as its dict),
how the codes were made.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pyarrow as pa

from gti.data.descriptions import description_text
from gti.data.schemas import PAIR_TOKEN_COLUMNS, PAIRS_SCHEMA
from gti.common.errors import DataError

ITEM_COLUMNS = ["item_id", "title", "description", "category", "attributes_text"]  # read from items.parquet


def is_val_item(item_id: str, seed: int, fraction: float) -> bool:
    """Seeded, order-independent choice of validation items (blake2b of seed and id below
    `fraction`: deterministic, independent of the other items). With `pairs.val_holdout=text2sid`
    only their text->SID rows are "val", with `item` all their rows."""
    if fraction <= 0:
        return False
    h = hashlib.blake2b(f"{seed}\x00{item_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64 < fraction


class RenderPairs:
    """Callable class for `map_batches`: one PairRenderer per actor; a pyarrow batch of items
    (joined with their codes) -> pairs rows (+ two columns the caller counts and drops:
    `truncated`, the text was cut to `pairs.max_len`, never the SID; and `desc_source`,
    `gti.data.descriptions.description_text`: the item's own description, a pseudo-description
    from its category and attributes, or its title).

    pairs_cfg: the `pairs` config section as a dict (`PairsConfig.model_dump()`: templates,
    system_prompt, max_len, max_desc_chars, val_fraction, val_holdout); code_table: [L, Kmax]
    tokenizer id of (level, code), -1 where a level has fewer codes; sid_wrap: the
    `<sid_start>`/`<sid_end>` ids or None; exclude: item ids left out."""

    def __init__(self, tokenizer, code_table: np.ndarray, pairs_cfg: dict, seed: int,
                 sid_wrap: tuple[int, int] | None, exclude: set[str]) -> None:
        from gti.lm.templates import TASKS, PairRenderer

        self.max_desc_chars = pairs_cfg["max_desc_chars"]
        self.val_fraction, self.val_holdout = pairs_cfg["val_fraction"], pairs_cfg["val_holdout"]
        self.renderer = PairRenderer(tokenizer, pairs_cfg["templates"], pairs_cfg["system_prompt"],
                                     pairs_cfg["max_len"], sid_wrap=sid_wrap)
        self.direction = {t: TASKS[t][0] for t in self.renderer.tasks}
        self.table = np.asarray(code_table)  # [L, Kmax] tokenizer id of (level, code)
        self.seed = seed
        self.exclude = exclude

    def __call__(self, batch: pa.Table) -> pa.Table:
        cols = {c: batch.column(c).to_pylist() for c in [*ITEM_COLUMNS, "codes"]}
        keep = [i for i, it in enumerate(cols["item_id"]) if it not in self.exclude]
        missing = [cols["item_id"][i] for i in keep if cols["codes"][i] is None]
        if missing:
            raise DataError(f"pairs: item_id '{missing[0]}' has no SID in sid_map.parquet ({len(missing)} such items in a batch)")
        titles, descs, srcs, sids = [], [], [], []
        levels = np.arange(self.table.shape[0])
        for i in keep:
            t = (cols["title"][i] or "").strip()
            d, src = description_text(t, cols["description"][i] or "", cols["category"][i] or "",
                                      cols["attributes_text"][i] or "", self.max_desc_chars)
            titles.append(t)
            descs.append(d)
            srcs.append(src)
            codes = np.asarray(cols["codes"][i], dtype=np.int64)
            if codes.shape[0] != self.table.shape[0] or (codes < 0).any() or (codes >= self.table.shape[1]).any():
                raise DataError(f"pairs: item_id '{cols['item_id'][i]}' has codes {codes.tolist()} "
                                f"that do not fit the {self.table.shape[0]}-level codec")
            ids = self.table[levels, codes]
            if (ids < 0).any():
                raise DataError(f"pairs: item_id '{cols['item_id'][i]}' has a code outside its codebook")
            sids.append(ids.tolist())
        rendered = self.renderer.render_batch(titles, descs, sids)
        out: dict[str, list[Any]] = {k: [] for k in ("item_id", "task", "split", *PAIR_TOKEN_COLUMNS,
                                                     "truncated", "desc_source")}
        for j, i in enumerate(keep):
            item = cols["item_id"][i]
            val = is_val_item(item, self.seed, self.val_fraction)
            for row in rendered[j]:
                held = val and (self.val_holdout == "item" or self.direction[row["task"]] == "text2sid")
                out["item_id"].append(item)
                out["task"].append(row["task"])
                out["split"].append("val" if held else "train")
                for c in PAIR_TOKEN_COLUMNS:
                    out[c].append(row[c])
                out["truncated"].append(row["truncated"])
                out["desc_source"].append(srcs[j])
        schema = PAIRS_SCHEMA.append(pa.field("truncated", pa.bool_())).append(pa.field("desc_source", pa.string()))
        return pa.table(out, schema=schema)
