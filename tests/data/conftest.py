"""Helpers for the data tests: run the ingest stage body in-process (no Ray) on small files."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

FIXTURES = Path(__file__).parent / "fixtures"


class IngestRun:
    def __init__(self, facts, out: Path):
        self.facts = facts
        self.out = out

    def table(self, name: str):
        return pq.read_table(self.out / f"{name}.parquet")

    def reasons(self, name: str) -> list[str]:
        return self.table(name).column("reason").to_pylist()

    def check_accounting(self):
        f = self.facts
        for kind in ("items", "interactions"):
            assert f[f"{kind}_rows_in"] == f[f"{kind}_rows_ok"] + f[f"{kind}_rows_quarantined"], kind
            assert self.table(f"{kind}_quarantine").num_rows == f[f"{kind}_rows_quarantined"], kind
        assert self.table("items").num_rows == f["items_rows_ok"]
        assert self.table("interactions").num_rows == f["interactions_rows_ok"]


@pytest.fixture
def run_ingest(tmp_path):
    """run_ingest(items_path, interactions_path, *overrides) -> IngestRun (in-process stream)."""
    from gti import config
    from gti.run import pipeline
    from gti.run.contract import StageContext
    from gti.stages import ingest
    from gti.data.batches import local_stream

    counter = [0]

    def _run(items, interactions, *overrides):
        counter[0] += 1
        work = tmp_path / f"work{counter[0]}"
        work.mkdir()
        cfg = config.load(None, [f"run_dir={tmp_path / 'run'}", f"data.items.path={items}",
                                 f"data.interactions.path={interactions}", *overrides])
        ctx = StageContext(spec=pipeline.spec("ingest"), cfg=cfg, run_dir=tmp_path,
                           work_dir=work, fingerprint="test")
        res = ingest.ingest(ctx, local_stream)
        return IngestRun(res.facts, work)

    return _run
