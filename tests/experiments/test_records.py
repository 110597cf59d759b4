"""gti/experiments/records.py: the parts of a record check that need no run (config diffs,
order-free table hashes, where records live)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from gti import config as C
from gti.experiments.records import NON_SEMANTIC_KEYS, config_diff, record_path, records_dir, table_hash


def test_config_diff_names_dotted_keys_and_missing_ones():
    a = {"sft": {"lr": 1, "steps": 2}, "seed": 0}
    b = {"sft": {"lr": 1, "steps": 3}, "seed": 0, "extra": {"x": 1}}
    assert config_diff(a, b) == ["extra", "sft.steps"]
    assert config_diff(a, a) == []
    assert {"run_dir", "compare", "embed", "sid"} <= set(NON_SEMANTIC_KEYS)


def test_table_hash_ignores_row_order_but_not_content(tmp_path):
    df = pl.DataFrame({"item_id": ["a", "b", "c"], "n": [1, 2, 3]})
    df.write_parquet(tmp_path / "a.parquet")
    df.reverse().write_parquet(tmp_path / "b.parquet")
    df.with_columns(pl.lit(9).alias("n")).write_parquet(tmp_path / "c.parquet")
    assert table_hash(tmp_path / "a.parquet") == table_hash(tmp_path / "b.parquet")
    assert table_hash(tmp_path / "a.parquet") != table_hash(tmp_path / "c.parquet")


def test_records_live_under_out_or_compare_records_dir(tmp_path):
    cfg = C.RunConfig()
    assert records_dir(cfg, tmp_path) == tmp_path / "records"
    cfg2 = C.validate({"compare": {"records_dir": str(tmp_path / "kept")}}, "t")
    assert records_dir(cfg2, tmp_path) == (tmp_path / "kept").resolve()
    assert record_path(Path("/r"), "gti+multitask", 3) == Path("/r/gti_multitask/seed3.json")
