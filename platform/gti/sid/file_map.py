"""The `sid` stage's outputs for SIDs read from a file (`sid.method: file`).

What it is for: `make_file_map(s, emb_path, work_dir, log)` writes what the stage writes for a map
it builds (sid_map.parquet and its `sid_map_hash`, codebooks.safetensors, quarantine.parquet, the
facts), so pairs, ground, sft, evaluate and report read a file map unchanged. No quantiser is
written: nothing can encode a new item into someone else's codes, so `gti refresh` refuses such
a run. The checks are `gti.sid.from_file`'s.

What it does not know: the pipeline, manifests, Ray. The embeddings are read in row batches, once
per level and once for the MSE.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gti.data.schemas import SID_MAP_SCHEMA
from gti.common.errors import DataError
from gti.common.parquet_stream import iter_parquet
from gti.sid.codec import SidCodec
from gti.sid.embeddings import embedding_matrix
from gti.sid.from_file import FileMap, read_file_map
from gti.sid.mapfile import sid_map_hash, sid_strings
from gti.sid.quality import level_usage
from gti.common.timing import Timer

QUARANTINE_FILE = "quarantine.parquet"
_BATCH = 65536


def catalog_ids(emb_path: Path) -> list[str]:
    """The embeddings' item ids, in file order (the catalog's)."""
    return [str(i) for i in pq.read_table(emb_path, columns=["item_id"]).column(0).to_pylist()]


def residual_means(emb_path: Path, rows: np.ndarray, codes: np.ndarray, sizes: list[int],
                   batch_rows: int = _BATCH) -> tuple[list[torch.Tensor], float]:
    """(code vectors per level [K_l, dim] float32, reconstruction MSE): level l's vector of code
    c is the mean, over the items with code c at level l, of the embedding minus the vectors of
    its codes at levels < l. `rows`: the map row of each embeddings row (-1: not in the map)."""
    books: list[torch.Tensor] = []
    for lv in range(len(sizes) + 1):  # the last pass measures the reconstruction
        sums, counts, sq, n = None, torch.zeros(sizes[lv] if lv < len(sizes) else 1, dtype=torch.float64), 0.0, 0
        start = 0
        for b in iter_parquet(emb_path, batch_rows, columns=["embedding"]):
            m = rows[start:start + b.num_rows]
            start += b.num_rows
            keep = m >= 0
            if not keep.any():
                continue
            x = torch.from_numpy(embedding_matrix(b.column(0), str(emb_path))[keep]).double()
            c = torch.from_numpy(codes[m[keep]])
            for j, cb in enumerate(books):
                x -= cb.double()[c[:, j]]
            if lv == len(sizes):
                sq, n = sq + float((x * x).sum()), n + x.numel()
                continue
            if sums is None:
                sums = torch.zeros(sizes[lv], x.shape[1], dtype=torch.float64)
            sums.index_add_(0, c[:, lv], x)
            counts.index_add_(0, c[:, lv], torch.ones(len(c), dtype=torch.float64))
        if lv < len(sizes):
            books.append((sums / counts.clamp(min=1).unsqueeze(1)).float())
    return books, sq / max(n, 1)


def write_map(work_dir: Path, fm: FileMap, codec: SidCodec) -> str:
    """sid_map.parquet (item_id, codes list<int32>, sid; rows in embeddings order, which is the
    catalog's) and quarantine.parquet (item_id, reason `no_sid`: with `sid.missing: quarantine`
    the catalog items the file lacks, none otherwise) in `work_dir`; returns the map's hash."""
    ids = pa.array(fm.ids, pa.string())
    sids = sid_strings(codec, torch.from_numpy(fm.codes))
    codes = pa.array([list(map(int, r)) for r in fm.codes], pa.list_(pa.int32()))
    pq.write_table(pa.table({"item_id": ids, "codes": codes, "sid": sids}, schema=SID_MAP_SCHEMA),
                   str(work_dir / "sid_map.parquet"))
    pq.write_table(pa.table({"item_id": pa.array(fm.missing, pa.string()),
                             "reason": pa.array(["no_sid"] * len(fm.missing), pa.string())}),
                   str(work_dir / QUARANTINE_FILE))
    return sid_map_hash(ids, sids)


def check_quarantine_unused(missing: list[str], interactions: Path | None, log: Callable[[str], None]) -> None:
    """DataError when a quarantined item is in an interaction (it would be a history or a target:
    both need a SID for every item)."""
    if not missing:
        return
    if interactions is None or not interactions.is_file():
        log(f"{len(missing)} item(s) quarantined; no interactions to check them against")
        return
    used = set(pq.read_table(interactions, columns=["item_id"]).column(0).to_pylist())
    hit = [i for i in missing if i in used]
    if hit:
        raise DataError(f"sid.missing=quarantine: item '{hit[0]}' has no SID but is in the interactions ({len(hit)} "
                        "such item(s)); every item a user interacted with needs one")


def make_file_map(s, emb_path: Path, work_dir: Path, log: Callable[[str], None],
                  interactions: Path | None = None) -> tuple[dict[str, str], dict]:
    """The stage's (outputs, facts) for `s` (a `SidConfig` with method file).

    codebooks.safetensors holds `level_l` [K_l, dim] for the file's own levels: the residual means
    of the items' embeddings (`residual_means`), so `init.method: codebook` and the report's RSA
    have code vectors; a code no item uses gets zeros. The facts: levels, codebook sizes, token
    format and new tokens (the codec), the hash, the file's counts (`source`), utilisation and
    perplexity per level, the share of items whose file SID was shared
    (`collision_rate_before`), the residual means' reconstruction MSE.
    """
    from safetensors.torch import save_file

    timer = Timer(memory=True)
    with timer.phase("read"):
        ids = catalog_ids(emb_path)
        fm = read_file_map(s, ids)
    check_quarantine_unused(fm.missing, interactions, log)
    log(f"{s.path}: {len(fm.ids):,} of {len(ids):,} catalog items, {fm.file_levels} levels, codes per level "
        f"{fm.sizes}; {fm.not_in_catalog:,} keys name no catalog item; {len(fm.missing):,} quarantined; "
        f"{fm.duplicate_items:,} items in {fm.duplicate_groups:,} shared SIDs"
        + (" (numbered by a level more)" if fm.codes.shape[1] > fm.file_levels else ""))
    codec = SidCodec(len(fm.sizes), fm.sizes, s.token_format)
    with timer.phase("write"):
        map_hash = write_map(work_dir, fm, codec)
    with timer.phase("residual_means"):
        pos = {i: r for r, i in enumerate(fm.ids)}
        rows = np.asarray([pos.get(i, -1) for i in ids], dtype=np.int64)
        books, recon = residual_means(emb_path, rows, fm.codes, fm.sizes[:fm.file_levels])
        save_file({f"level_{lv}": cb.contiguous() for lv, cb in enumerate(books)},
                  str(work_dir / "codebooks.safetensors"))
    util, perp = level_usage(torch.from_numpy(fm.codes), fm.sizes)
    n = len(fm.ids)
    before = (fm.duplicate_items - fm.duplicate_groups) / n
    facts = {
        "method": "file", "levels": len(fm.sizes), "quantizer_levels": fm.file_levels,
        "dedup_level_added": fm.codes.shape[1] > fm.file_levels, "codebook_sizes": fm.sizes,
        "code_dim": int(books[0].shape[1]), "token_format": s.token_format, "new_tokens": codec.tokens(),
        "utilisation": [round(u, 6) for u in util], "perplexity": [round(p, 4) for p in perp],
        "collision_rate_before": before, "collision_rate_after_sinkhorn": before, "collision_rate_after": 0.0,
        "sinkhorn_rounds": 0, "recon_mse": recon, "sid_map_hash": map_hash, "n_items": n,
        "dim": int(books[0].shape[1]), "train_history": [],
        "source": {"path": s.path, "item_json": s.item_json, "file_items": n + fm.not_in_catalog,
                   "not_in_catalog": fm.not_in_catalog, "quarantined": len(fm.missing),
                   "duplicate_groups": fm.duplicate_groups, "duplicate_items": fm.duplicate_items},
        "timing": timer.facts(), "driver_peak_mb": timer.memory_facts(),
    }
    outputs = {"sid_map": "sid_map.parquet", "codebooks": "codebooks.safetensors", "quarantine": QUARANTINE_FILE}
    return outputs, facts
