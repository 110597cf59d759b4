"""A fake finished run for the fast refresh tests: the files `gti refresh` reads from a run
(stage manifests, the SID map and codebooks, a frozen residual k-means quantiser, pairs, the
interactions, a model folder), written directly, with no pipeline, model or Ray.

The quantiser has 2 levels of 4 codes in 2-d, codebooks chosen so that a vector (a, b) with
a, b in 0..3 encodes to codes (a, b) (level 0 at (10a, 0), level 1 at (0, b)); the map adds a
de-duplication level of 2 codes, so each prefix group holds 2 items."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gti import config as C
from gti.run.manifest import Manifest

SIZES = [4, 4, 2]
OLD = {"a0": [0, 0, 0], "a1": [0, 0, 1], "a2": [1, 2, 0], "a3": [2, 1, 0], "a4": [3, 3, 0]}
# (user, item, ts): u1 a0 a2 a3, u2 a1 a4 a0
OLD_INTER = [("u1", "a0", 1), ("u2", "a1", 2), ("u1", "a2", 3), ("u2", "a4", 4), ("u1", "a3", 5), ("u2", "a0", 6)]


@dataclass
class FakeRun:
    dir: Path
    map_hash: str
    model_dir: Path

    def cfg(self, items="unused.csv", interactions=None, *overrides):
        from gti.refresh.attempt import load_run_config

        return load_run_config(self.dir, str(items), None if interactions is None else str(interactions), overrides)


def _manifest(folder: Path, stage: str, outputs: dict, facts: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    Manifest(stage=stage, fingerprint="test", config={}, outputs=outputs, facts=facts).write(folder)


def _quantizer():
    from gti.sid.rqkmeans import RQKMeansConfig, ResidualKMeans

    q = ResidualKMeans(RQKMeansConfig(in_dim=2, levels=2, codebook_size=4))
    cb = torch.zeros(2, 4, 2)
    cb[0, :, 0] = torch.arange(4) * 10.0
    cb[1, :, 1] = torch.arange(4).float()
    q.codebooks.copy_(cb)
    return q


def write_run(run: Path) -> FakeRun:
    from safetensors.torch import save_file

    from gti.sid.codec import SidCodec
    from gti.sid.quantizer import codebooks_tensor, save_quantizer
    from gti.sid.map_edits import map_table
    from gti.sid.versions import map_hash
    from gti.data.schemas import INTER_OUT_SCHEMA, PAIRS_SCHEMA

    cfg = C.load(None, [f"run_dir={run}", "embed.encoder=hash", "embed.dim=16", "seed=7"])
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(C.dump(cfg))
    table = map_table(list(OLD), list(OLD.values()), SidCodec(3, SIZES))
    (run / "sid").mkdir()
    pq.write_table(table, str(run / "sid" / "sid_map.parquet"))
    q = _quantizer()
    save_quantizer(q, run / "sid")
    save_file(codebooks_tensor(q), str(run / "sid" / "codebooks.safetensors"))
    h = map_hash(table)
    _manifest(run / "sid", "sid", {"sid_map": "sid_map.parquet", "codebooks": "codebooks.safetensors"},
              {"sid_map_hash": h, "codebook_sizes": SIZES, "token_format": "<{level}_{code}>", "levels": 3,
               "dedup_level_added": True})
    n = 6
    pairs = pa.table({"item_id": [f"a{i % 5}" for i in range(n)], "task": ["title2sid"] * n,
                      "split": ["train"] * 4 + ["val"] * 2,
                      **{c: [[i]] * 1 + [[i, i]] * (n - 1) for i, c in enumerate(PAIRS_SCHEMA.names[3:])}},
                     schema=PAIRS_SCHEMA)
    (run / "pairs").mkdir()
    pq.write_table(pairs, str(run / "pairs" / "pairs.parquet"))
    _manifest(run / "pairs", "pairs", {"pairs": "pairs.parquet"}, {"new_token_ids": [100, 110], "sid_markers": None})
    (run / "ingest").mkdir()
    inter = pa.table({k: [r[i] for r in OLD_INTER] for i, k in enumerate(("user_id", "item_id", "ts"))},
                     schema=INTER_OUT_SCHEMA)
    pq.write_table(inter, str(run / "ingest" / "interactions.parquet"))
    _manifest(run / "ingest", "ingest", {"interactions": "interactions.parquet"}, {})
    _manifest(run / "embed", "embed", {}, {"dim": 16})
    model = run / "sft" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "gti_meta.json").write_text(f'{{"sid_map_hash": "{h}"}}')
    return FakeRun(run, h, model)


# The time-split run's interactions, in file order; 1:1:1 of 6 by (ts, file order): train
# (u1 a0 @1, u2 a1 @3), valid (u1 a2 @3, u2 a4 @4), test (u1 a3 @5, u2 a0 @6), so the cuts are
# ts 3 and 5 and u2's a1 ties the valid cut in train (its timestamp alone would say valid).
TIME_INTER = [("u1", "a0", 1), ("u2", "a1", 3), ("u1", "a2", 3), ("u2", "a4", 4), ("u1", "a3", 5), ("u2", "a0", 6)]


def write_time_split_run(run: Path, record_cuts: bool = True) -> FakeRun:
    """The fake run made with `data.split: global_time` (ratios 1:1:1): its ingest outputs and
    `split` facts are `gti.data.sequences.build_sequences`' on TIME_INTER, as the ingest stage
    writes them; `record_cuts=False`: a run ingested before ingest recorded `cut_ts`."""
    import polars as pl

    from gti.data.schemas import INTER_OUT_SCHEMA, SEQ_SCHEMA
    from gti.data.sequences import build_sequences

    fake = write_run(run)
    cfg = C.load(None, [f"run_dir={run}", "embed.encoder=hash", "embed.dim=16", "seed=7",
                        "data.split=global_time", "data.split_ratios=[1,1,1]", "data.min_seq_len=2"])
    (run / "config.yaml").write_text(C.dump(cfg))
    df = pl.DataFrame({k: [r[i] for r in TIME_INTER] for i, k in enumerate(("user_id", "item_id", "ts"))},
                      schema={"user_id": pl.String, "item_id": pl.String, "ts": pl.Int64})
    res = build_sequences(df.with_columns(order=pl.int_range(0, pl.len())), 2, None, "global_time", (1, 1, 1))
    pq.write_table(res.interactions.to_arrow().cast(INTER_OUT_SCHEMA), str(run / "ingest" / "interactions.parquet"))
    pq.write_table(res.sequences.to_arrow().cast(SEQ_SCHEMA), str(run / "ingest" / "sequences.parquet"))
    split = res.split if record_cuts else {k: v for k, v in res.split.items() if k != "cut_ts"}
    _manifest(run / "ingest", "ingest", {"interactions": "interactions.parquet", "sequences": "sequences.parquet"},
              {"split": split})
    return fake


@pytest.fixture
def fake_run(tmp_path) -> FakeRun:
    return write_run(tmp_path / "run")


def _job_on(run: FakeRun, items="unused.csv", interactions=None, *overrides):
    """A Job on the fake `run` (work folder `<run>/refresh/.v1.partial`); its log lines in `.logs`."""
    from gti.refresh.attempt import Job, find_parent, read_manifest

    cfg = run.cfg(items, interactions, *overrides)
    work = run.dir / "refresh" / ".v1.partial"
    work.mkdir(parents=True, exist_ok=True)
    sf = read_manifest(run.dir, "sid").facts
    logs: list[str] = []
    job = Job(run.dir, cfg, find_parent(run.dir), work, 1, sf, "cbhash", logs.append, interactions is not None)
    job.logs = logs  # type: ignore[attr-defined]
    return job


@pytest.fixture
def make_job(fake_run, tmp_path):
    """make_job(items=..., interactions=..., *overrides) -> a Job on the fake run (`job_on`)."""
    return lambda *args: _job_on(fake_run, *args)


@pytest.fixture
def time_split_run(tmp_path):
    """time_split_run(record_cuts=True) -> the fake time-split run (`write_time_split_run`)."""
    return lambda record_cuts=True: write_time_split_run(tmp_path / "time_run", record_cuts)


@pytest.fixture
def job_on():
    """job_on(run, items=..., interactions=..., *overrides) -> a Job on the fake `run`."""
    return _job_on
