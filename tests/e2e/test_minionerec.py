"""MiniOneRec's files in, their table out, end to end (issue 52 item 4): the documented
`gti run --config jobs/configs/minionerec.yaml data.root=...` on the committed fixture in their
public format (tests/data/fixtures/minionerec), with the tiny model of the other stage tests
and their own SIDs (`sid.method: file`, their index.json): ingest reads the folder, the time
split is theirs, and evaluate scores EVERY test row of their test CSV with HR/NDCG@3/5/10
beside MostPop and Markov. Untrained (ground.steps=0, sft.steps=0): no Train run; what is
checked is the plumbing, not the quality."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "data" / "fixtures" / "minionerec"
TINY = ["model.name=tiny", "embed.encoder=hash", "embed.dim=32", "ground.steps=0", "sft.steps=0",
        "pairs.max_len=128", "sft.max_len=160", "eval.beam_width=10", "eval.bootstrap=20", "eval.cpu_threads=1",
        "eval.baselines=[mostpop,markov]", "ray_num_cpus=2"]


@pytest.mark.slow
@pytest.mark.ray
def test_minionerec_files_in_hr_and_ndcg_on_every_test_row_out(tmp_path, ray_start_4_cpus):
    from gti.cli import main

    index = next((FIXTURE / "index").glob("*.index.json"))
    run = tmp_path / "run"
    rc = main(["run", "--config", str(ROOT / "jobs" / "configs" / "minionerec.yaml"), f"data.root={FIXTURE}",
               "data.dataset=Tiny_Scientific", f"run_dir={run}", "sid.method=file", f"sid.path={index}", *TINY])
    assert rc == 0
    ingest = json.loads((run / "ingest" / "_manifest.json").read_text())["facts"]
    assert ingest["split"]["name"] == "global_time" and ingest["split"]["by"] == "timestamp"
    assert ingest["root"]["rows"]["test"] == 19 and ingest["n_items"] == 40
    metrics = json.loads((run / "evaluate" / "metrics.json").read_text())
    test_rows = pl.read_csv(next((FIXTURE / "test").glob("*.csv")), infer_schema=False)
    assert metrics["n_rows"]["test"] == test_rows.height  # every row of their test file
    assert metrics["n_users"]["test"] == test_rows["user_id"].n_unique() < test_rows.height
    table = metrics["splits"]["test"]
    for k in (3, 5, 10):
        assert {f"hr@{k}", f"ndcg@{k}"} <= set(table) and table[f"hr@{k}"] == table[f"recall@{k}"]
        for name in ("mostpop", "markov"):
            assert f"hr@{k}" in metrics["baselines"][name]["test"]
    recs = pl.read_parquet(run / "evaluate" / "recs.parquet")
    assert sorted(recs["target"].to_list()) == sorted(test_rows["item_id"].to_list())
