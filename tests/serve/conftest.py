"""A tiny finished run for the `gti serve` tests, written without Ray or a pipeline: a tiny
Llama extended with 2x8 SID tokens (noise rows: distinct scores), the sid stage's map of 20
items (real map hash), ingest titles, the sft model, a config with data.max_history=4, and
one `gti refresh` version v1 (the same 20 items plus 2 new ones, its record naming the base
map as parent, its model the base model with its gti_meta.json naming the new map).

`publishable` is a copy of it with `publish(k, extra_ids)`, which writes a good v<k> (parent:
the newest version, plus the extra items), as `gti refresh` would publish it.
`add_bad_version(run)` adds v2, whose map changes the SID of an old item (it names v1 as its
parent, but does not descend from it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

N_ITEMS, CODEBOOK, MAX_HISTORY = 20, 8, 4
NEW_ITEMS = ["new0", "new1"]


def _map_table(item_ids, codes):
    from gti.sid.codec import SidCodec

    codec = SidCodec(2, CODEBOOK)
    return pa.table({"item_id": pa.array(item_ids, pa.string()),
                     "codes": pa.array(codes, pa.list_(pa.int32())),
                     "sid": pa.array([codec.to_string(c) for c in codes], pa.string())})


def _write_items(path: Path, item_ids):
    import polars as pl

    path.parent.mkdir(parents=True, exist_ok=True)
    pl.DataFrame({"item_id": item_ids, "title": [f"Title of {i}" for i in item_ids]}).write_parquet(path)


def _base(run: Path):
    """The run's own stages; returns (item_ids, codes, base map table)."""
    import pyarrow.parquet as pq

    from gti import config as C
    from gti.lm.models import build_tiny
    from gti.lm.new_rows import export_model, extend_tokenizer
    from gti.run.manifest import Manifest
    from gti.sid.codec import SidCodec
    from gti.sid.versions import map_hash

    model, tok = build_tiny(C.ModelConfig(name="tiny"), seed=0)
    codec = SidCodec(2, CODEBOOK)
    first, end = extend_tokenizer(tok, codec.tokens())
    model.resize_token_embeddings(end, mean_resizing=False)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        model.get_input_embeddings().weight[first:end] = torch.randn(end - first, model.config.hidden_size, generator=g)
    pairs = np.random.default_rng(0).permutation(CODEBOOK * CODEBOOK)
    codes = [[int(p // CODEBOOK), int(p % CODEBOOK)] for p in pairs]
    item_ids = [f"it{i}" for i in range(N_ITEMS)]
    table = _map_table(item_ids, codes[:N_ITEMS])
    h = map_hash(table)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(C.dump(C.load(None, [f"data.max_history={MAX_HISTORY}"])))
    (run / "sid").mkdir()
    pq.write_table(table, str(run / "sid" / "sid_map.parquet"))
    Manifest(stage="sid", fingerprint="f", config={}, outputs={"sid_map": "sid_map.parquet"},
             facts={"levels": 2, "codebook_sizes": [CODEBOOK] * 2, "token_format": codec.token_format,
                    "sid_map_hash": h, "n_items": N_ITEMS}).write(run / "sid")
    _write_items(run / "ingest" / "items.parquet", item_ids)
    Manifest(stage="ingest", fingerprint="f", config={}, outputs={"items": "items.parquet"}).write(run / "ingest")
    export_model(model, tok, run / "sft" / "model", {"sid_map_hash": h})
    Manifest(stage="sft", fingerprint="f", config={}, outputs={"model": "model"}).write(run / "sft")
    return item_ids, codes, table


def write_version(run: Path, k: int, item_ids, codes, parent) -> str:
    """refresh/v<k>: map (item_ids, codes) with parent `parent` (a SidMapVersion), the
    previous model copied with its meta naming the new map; returns the new map's hash."""
    from gti.run.versions import lineage_dir
    from gti.sid.versions import make_version, write_map

    table = _map_table(item_ids, codes)
    version = make_version(table, "cbhash", [CODEBOOK] * 2, parent=parent)
    vdir = run / "refresh" / f"v{k}"
    (vdir / "sid").mkdir(parents=True)
    write_map(vdir / "sid" / "sid_map.parquet", table, version)
    lineage_dir(run).add(version, table)
    _write_items(vdir / "ingest" / "items.parquet", [i for i in item_ids if i.startswith("new")])
    shutil.copytree(run / "sft" / "model", vdir / "model")
    meta_path = vdir / "model" / "gti_meta.json"
    meta = json.loads(meta_path.read_text())
    meta.update({"sid_map_hash": version.hash, "sid_map_parent": version.parent_hash,
                 "sid_map_version": version.to_dict()})
    meta_path.write_text(json.dumps(meta))
    (vdir / "_manifest.json").write_text(json.dumps({"stage": "refresh", "facts": {"new_hash": version.hash}}))
    return version.hash


def write_serve_run(run: Path) -> dict:
    from gti.run.versions import lineage_dir
    from gti.sid.versions import make_version

    item_ids, codes, base = _base(run)
    base_version = make_version(base, "cbhash", [CODEBOOK] * 2)
    lineage_dir(run).add(base_version, base)
    ids1 = item_ids + NEW_ITEMS
    h1 = write_version(run, 1, ids1, codes[:len(ids1)], base_version)
    return {"run": run, "item_ids": item_ids, "codes": codes, "base_hash": base_version.hash, "v1_hash": h1,
            "n_items": N_ITEMS, "new_items": NEW_ITEMS, "max_history": MAX_HISTORY}


def add_bad_version(info: dict) -> None:
    """v2: v1's items with the SIDs of it0 and it1 swapped, naming v1 as its parent."""
    from gti.run.versions import refresh_versions

    run = info["run"]
    ids = info["item_ids"] + NEW_ITEMS
    codes = list(info["codes"][:len(ids)])
    codes[0], codes[1] = codes[1], codes[0]
    write_version(run, 2, ids, codes, refresh_versions(run)[0].map_version())


@pytest.fixture(scope="session")
def serve_run(tmp_path_factory) -> dict:
    """The tiny run with v1 (read-only for the tests: copy it to change it)."""
    return write_serve_run(tmp_path_factory.mktemp("serve") / "run")


@pytest.fixture
def bad_run(serve_run, tmp_path) -> dict:
    """A copy of the tiny run with the non-descendant v2 added."""
    info = dict(serve_run, run=tmp_path / "run")
    shutil.copytree(serve_run["run"], info["run"])
    add_bad_version(info)
    return info


@pytest.fixture
def publishable(serve_run, tmp_path) -> dict:
    """A copy of the tiny run and `publish(k, extra_ids)` (see the module docstring)."""
    return copy_publishable(serve_run, tmp_path / "run")


def copy_publishable(serve_run: dict, run: Path) -> dict:
    from gti.run.versions import refresh_versions

    info = dict(serve_run, run=run)
    shutil.copytree(serve_run["run"], info["run"])
    ids = serve_run["item_ids"] + NEW_ITEMS

    def publish(k: int, extra: list[str]) -> str:
        parent = refresh_versions(info["run"])[-1].map_version()
        return write_version(info["run"], k, ids + extra, serve_run["codes"][:len(ids) + len(extra)], parent)

    info["publish"] = publish
    return info


@pytest.fixture(scope="session")
def publishable_factory():
    """`copy_publishable(serve_run, run)` for fixtures of a wider scope than `publishable`."""
    return copy_publishable


@pytest.fixture(scope="session")
def services(serve_run) -> dict:
    """{0: service of the run's own stages, 1: service of v1} (loaded once)."""
    from gti.serve.service import RecommenderService

    return {v: RecommenderService.load(serve_run["run"], v, max_k=100) for v in (0, 1)}
