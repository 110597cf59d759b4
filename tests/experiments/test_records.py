"""gti/experiments/records.py: the parts of a record check that need no run (config diffs,
order-free table hashes, where records live)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from gti import config as C
from gti.experiments.records import (
    NON_SEMANTIC_KEYS, RECORD_FORMAT, config_diff, read_record, record_path, records_dir, table_hash,
)


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


def test_table_hash_of_columns_is_the_hash_of_the_table_without_the_others(tmp_path):
    """A table that gained a column (sequences.parquet's valid_items, fb92f2e) hashes as before
    on its old columns, so records made before can still be matched (bench/proof/proof_sasrec.py)."""
    df = pl.DataFrame({"item_id": ["a", "b", "c"], "n": [1, 2, 3]})
    df.write_parquet(tmp_path / "old.parquet")
    df.with_columns(pl.lit("x").alias("new")).write_parquet(tmp_path / "new.parquet")
    old = table_hash(tmp_path / "old.parquet")
    assert table_hash(tmp_path / "new.parquet") != old
    assert table_hash(tmp_path / "new.parquet", ["item_id", "n"]) == old
    assert table_hash(tmp_path / "new.parquet", ["item_id"]) != old


def test_records_live_under_out_or_compare_records_dir(tmp_path):
    cfg = C.RunConfig()
    assert records_dir(cfg, tmp_path) == tmp_path / "records"
    cfg2 = C.validate({"compare": {"records_dir": str(tmp_path / "kept")}}, "t")
    assert records_dir(cfg2, tmp_path) == (tmp_path / "kept").resolve()
    assert record_path(Path("/r"), "gti+multitask", 3) == Path("/r/gti_multitask/seed3.json")
    # on one of several SID maps the map is part of the path, so maps never share a record
    assert record_path(Path("/r"), "gti+multitask", 3, 2) == Path("/r/sid2/gti_multitask/seed3.json")


def test_old_records_without_an_rl_section_still_stand_for_non_rl_arms(tmp_path):
    """Records made before the rl stage existed have no `rl` section in their config: validated
    today it counts at its defaults (rl.enabled false), which is what every non-rl arm sets, so
    they still stand for their runs; such a record never stands for a gti+rl run."""
    import json

    from gti.experiments.compare import ARMS, plan

    cfg = C.validate({"run_dir": str(tmp_path / "base"), "model": {"name": "tiny"}}, "t")
    rdir = tmp_path / "rec"

    def write(arm: str, config: dict) -> None:
        path = record_path(rdir, arm, cfg.seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": RECORD_FORMAT, "shared": {}, "facts": {},
                                    "record": {"arm": arm, "seed": cfg.seed, "config": config}}))

    old = {}
    for r in plan(cfg, [a for a in ARMS if a != "gti+rl"], 1, tmp_path / "out"):
        old[r.arm] = r.cfg.model_dump(mode="json")
        del old[r.arm]["rl"]
        write(r.arm, old[r.arm])
        rec, _, why = read_record(r, rdir, {})
        assert why == "" and rec.arm == r.arm
    rl_run = plan(cfg, ["gti+rl"], 1, tmp_path / "out")[0]
    write("gti+rl", old["gti"])
    rec, _, why = read_record(rl_run, rdir, {})
    assert rec is None and "rl" in why
    # Other rl keys change nothing while RL does not train: the old records still stand.
    tuned = C.validate({"run_dir": str(tmp_path / "base"), "model": {"name": "tiny"},
                        "rl": {"steps": 10, "lr": 1e-4}}, "t")
    for r in plan(tuned, ["mean", "gti"], 1, tmp_path / "out"):
        rec, _, why = read_record(r, rdir, {})
        assert why == "" and rec.arm == r.arm
