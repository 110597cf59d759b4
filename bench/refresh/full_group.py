"""Benchmark: a refresh whose new items overflow a de-duplication group (issue 51, item 10).

A user adds a product line: 12 near-identical items (one catalog item's title and text, each
with its own size, "... (50 ml)", "(100 ml)", ...). Their content embeddings are nearly equal,
so the frozen quantiser puts them in ONE prefix group, and that group runs out of codes of the
de-duplication level (the last level). Two ways to place the items that do not fit:

- `add_tokens`: the last level grows by as many codes as the group lacks (new code tokens,
  appended to the model; the refresh's grounding trains their rows with the other SID rows):
  every item keeps the prefix the quantiser gave it;
- `widen` (the nearest group with a free code): an item that does not fit moves to the next-
  nearest code of the last QUANTISER level, i.e. into the neighbouring prefix group nearest to
  its embedding that still has a free code: no new token, the parent model accepts the map.

Measured on one base run (the tiny config with MiniLM embeddings, so that closeness in the
embedding means closeness in text; untrained: the placement reads only the quantiser and the
embeddings), per way, for the items that did not fit (`overflow`):
- `family_kept`: the share of them whose SID prefix group also holds the family's other items
  (what a beam search reaches by the same prefix);
- `group_cosine`: the mean cosine between an overflow item's embedding and the embeddings of
  the items sharing its prefix group in the new map (what the model will take it for);
- `extra_quant_cost`: the mean squared distance of its last quantiser residual to the chosen
  code's centroid over the distance to its own (nearest) code's (1.0 = no cost);
and for `add_tokens` the real `gti refresh` (`refresh.ground_steps`, default 20; --quick 4):
tokens added, wall s, the grounding's text->SID exact match on the new items (`val_exact_match`),
and whether the refreshed version loads and knows every new item (`served`). `widen` is
computed from the same quantiser and embeddings (the refresh stopped at the full group leaves
them in its work folder): a placement, not a shipped option.

Usage: python bench/refresh/full_group.py [--quick] [--n-new 12] [--ground-steps N] [--work DIR]
The last line is one JSON object: {"add_tokens": {...}, "widen": {...}, "overflow": n, ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared module
import common  # noqa: E402

common.hf_offline()
log = common.log
N_ITEMS = 300
BASE = ["embed.encoder=minilm", "data.max_items=null", "ground.steps=0", "sft.steps=0"]


def write_data(d: Path, n_new: int):
    """(base items, base interactions, the family's items, the source item id)."""
    import polars as pl

    from gti.data import bundled

    items = pl.read_parquet(bundled.resolve("bundled:amazon-scientific", "items")).head(N_ITEMS)
    inter = pl.read_parquet(bundled.resolve("bundled:amazon-scientific", "interactions"))
    inter = inter.filter(pl.col("item_id").is_in(items["item_id"].implode()))
    beakers = items.filter(pl.col("title").str.to_lowercase().str.contains("beaker"))
    src = (beakers if beakers.height else items).head(1)
    fam = pl.concat([src.with_columns(pl.lit(f"family{i}").alias("item_id"),
                                      (pl.col("title") + f" ({50 * (i + 1)} ml)").alias("title"))
                     for i in range(n_new)])
    d.mkdir(parents=True, exist_ok=True)
    paths = {n: d / f"{n}.parquet" for n in ("items", "inter", "family")}
    items.write_parquet(paths["items"])
    inter.write_parquet(paths["inter"])
    fam.write_parquet(paths["family"])
    return paths, src["item_id"][0]


def base_run(work: Path, paths: dict) -> Path:
    from gti import config as C
    from gti.run import pipeline

    run = work / "base"
    cfg = C.load(common.CONFIGS / "tiny.yaml", [f"run_dir={run}", f"data.items.path={paths['items']}",
                                                f"data.interactions.path={paths['inter']}", *BASE])
    pipeline.run(cfg, to_stage="sft", echo=log)
    return run


def _embeddings(path: Path) -> dict:
    import pyarrow.parquet as pq

    from gti.sid.embeddings import embedding_matrix

    t = pq.read_table(str(path))
    return dict(zip(t.column("item_id").to_pylist(), embedding_matrix(t.column("embedding"), str(path))))


def _groups(map_path: Path) -> dict:
    """{item id: its prefix group (every code but the last)}."""
    import polars as pl

    m = pl.read_parquet(map_path)
    return {i: tuple(c[:-1]) for i, c in zip(m["item_id"].to_list(), m["codes"].to_list())}


def placement(groups: dict, emb: dict, overflow: list[str], family: list[str], src: str) -> dict:
    """family_kept and group_cosine of the overflow items under `groups` (see the module doc)."""
    import numpy as np

    def unit(v):
        return v / max(float(np.linalg.norm(v)), 1e-12)

    members: dict = {}
    for i, g in groups.items():
        members.setdefault(g, []).append(i)
    kept, cos = [], []
    fam_groups = {groups[i] for i in [src, *family] if i in groups and i not in overflow}
    for i in overflow:
        if i not in groups:  # not placed (widen found no group with a free code)
            continue
        g = groups[i]
        kept.append(g in fam_groups)
        mates = [m for m in members[g] if m != i and m in emb]
        if mates:
            cos.append(float(np.mean([unit(emb[i]) @ unit(emb[m]) for m in mates])))
    return {"family_kept": round(float(np.mean(kept)), 3) if kept else None,
            "group_cosine": round(float(np.mean(cos)), 4) if cos else None, "n": len(overflow)}


def widen(run: Path, emb_new: dict, parent_map: Path):
    """The `widen` placement. The new items go through `assign_new_items` (what the refresh
    does); each one left without a code moves to the nearest last-quantiser-level code whose
    prefix group has a free de-duplication code. -> ({id: prefix group} of the new map,
    overflow ids, mean extra quantisation cost of the moved items)."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from gti.run.manifest import Manifest
    from gti.sid.kmeans import sq_dists
    from gti.sid.map_edits import assign_new_items, codes_matrix
    from gti.sid.quantizer import load_quantizer

    sf = Manifest.read(run / "sid").facts
    sizes = [int(k) for k in sf["codebook_sizes"]]
    ids = list(emb_new)
    q = load_quantizer(run / "sid")
    with torch.inference_mode():
        x = torch.from_numpy(np.stack([emb_new[i] for i in ids]).astype(np.float32))
        pre = q.encode(x)
        cost = sq_dists(q.last_residual(x).float(), q.level_codebooks()[-1].float()).numpy()
    a = assign_new_items(pq.read_table(str(parent_map)), ids, pre, sizes, sf["token_format"])
    if len(pre[0]) != len(sizes) - 1:
        raise SystemExit("widen is measured on maps with a de-duplication level (sid.dedup: extra_level)")
    table = a.table
    codes = codes_matrix(table)
    groups = {i: tuple(c[:-1]) for i, c in zip(table.column("item_id").to_pylist(), codes.tolist())}
    used: dict = {}
    for g in groups.values():
        used[g] = used.get(g, 0) + 1
    overflow, extra = [n.item_id for n in a.needs_new_tokens], []
    for i in overflow:
        j = ids.index(i)
        order = np.argsort(cost[j], kind="stable")
        for c in order:
            g = tuple(pre[j][:-1].tolist()) + (int(c),)
            if used.get(g, 0) < sizes[-1]:
                used[g] = used.get(g, 0) + 1
                groups[i] = g
                extra.append(float(cost[j][c]) / max(float(cost[j][order[0]]), 1e-12))
                break
    return groups, overflow, round(float(np.mean(extra)), 3) if extra else None


def _commit() -> str:
    import subprocess

    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=common.ROOT, capture_output=True,
                          text=True).stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 grounding steps (make bench)")
    ap.add_argument("--n-new", type=int, default=12)
    ap.add_argument("--ground-steps", type=int, default=None)
    ap.add_argument("--work", default=None, help="kept when given (else a temporary folder)")
    args = ap.parse_args(argv)
    steps = args.ground_steps if args.ground_steps is not None else (4 if args.quick else 20)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gti-full-group-"))
    t0, load_start = time.perf_counter(), os.getloadavg()
    try:
        out = measure(work, args.n_new, steps)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    out.update({"bench": "refresh-full-group", "mode": "quick" if args.quick else "full", "n_new": args.n_new,
                "ground_steps": steps, "total_s": round(time.perf_counter() - t0, 1),
                "load_avg_start": [round(x, 2) for x in load_start],
                "load_avg_end": [round(x, 2) for x in os.getloadavg()], "commit": _commit()})
    print(json.dumps(out))
    return 0


def measure(work: Path, n_new: int, steps: int) -> dict:
    from gti.common.errors import GtiError
    from gti.run.manifest import Manifest
    from gti.refresh.command import refresh
    from gti.serve.service import RecommenderService

    paths, src = write_data(work / "data", n_new)
    run = base_run(work, paths)
    family = [f"family{i}" for i in range(n_new)]
    parent_map = Manifest.read(run / "sid").output(run / "sid", "sid_map")
    stop = work / "stopped" / "run"  # the refresh that stops at the full group: its work folder
    shutil.rmtree(stop.parent, ignore_errors=True)
    shutil.copytree(run, stop, symlinks=True)
    try:
        refresh(stop, paths["family"], None, ["refresh.on_full_group=error", "refresh.ground_steps=0"], log=log)
        raise SystemExit("the family fitted its group: no overflow to measure (raise --n-new)")
    except GtiError as err:
        log(f"on_full_group=error: {err}")
    partial = stop / "refresh" / ".v1.partial"
    listed = [x["item_id"] for x in json.loads((partial / "needs_new_tokens.json").read_text())]
    new_emb = _embeddings(partial / "embed" / "embeddings.parquet")
    emb = {**_embeddings(run / "embed" / "embeddings.parquet"), **new_emb}
    wide, overflow, extra = widen(run, new_emb, parent_map)
    assert sorted(overflow) == sorted(listed), (overflow, listed)  # the refresh's own split
    grow = work / "add_tokens" / "run"
    shutil.rmtree(grow.parent, ignore_errors=True)
    shutil.copytree(run, grow, symlinks=True)
    t = time.perf_counter()
    res = refresh(grow, paths["family"], None, ["refresh.on_full_group=add_tokens", f"refresh.ground_steps={steps}",
                                                 "ground.batch_size=4", "refresh.replay_ratio=1.0"], log=log)
    wall = round(time.perf_counter() - t, 1)
    svc = RecommenderService.load(grow, res.k)
    served = set(family) <= set(svc.run.item_ids)
    groups = _groups(res.map_path)
    ground = res.facts.get("ground", {})
    return {"overflow": len(overflow), "source_item": src,
            "add_tokens": {**placement(groups, emb, overflow, family, src), "extra_quant_cost": 1.0,
                           "added_tokens": len(res.facts["added_tokens"]), "refresh_wall_s": wall,
                           "val_exact_match": ground.get("val_exact_match"), "served": served},
            "widen": {**placement(wide, emb, overflow, family, src), "extra_quant_cost": extra,
                      "added_tokens": 0, "placed": sum(i in wide for i in overflow)}}


if __name__ == "__main__":
    sys.exit(main())
