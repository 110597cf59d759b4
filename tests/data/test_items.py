"""gti/data/items.py: the items pass of ingest on its own, in process (what `gti refresh` runs on
its new items): the first of duplicate ids kept, `data.max_items` ending the catalog, every row
read counted once, and no valid item as one line. (Through the whole ingest body:
tests/data/test_bad_inputs.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gti import config
from gti.data.batches import local_stream
from gti.data.items import ingest_items
from gti.data.schemas import ITEMS_OUT_SCHEMA, ITEMS_Q_SCHEMA
from gti.common.errors import DataError

ITEMS = "item_id,title\n1,Beaker\n2,Flask\n1,Again\n3,Pipette\n"


def _items_pass(tmp_path, text: str, *overrides):
    items = tmp_path / "items.csv"
    items.write_text(text)
    cfg = config.load(None, [f"run_dir={tmp_path / 'run'}", f"data.items.path={items}", *overrides])
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    logs: list[str] = []
    counts, kept = ingest_items(SimpleNamespace(cfg=cfg, log=logs.append), out, local_stream)
    return counts, kept, out, logs


def test_duplicates_first_kept_and_every_row_counted_once(tmp_path):
    counts, kept, out, logs = _items_pass(tmp_path, ITEMS)
    ok, q = pq.read_table(out / "items.parquet"), pq.read_table(out / "items_quarantine.parquet")
    assert ok.schema == ITEMS_OUT_SCHEMA and q.schema == ITEMS_Q_SCHEMA
    assert ok.column("item_id").to_pylist() == ["1", "2", "3"] and ok.column("title").to_pylist()[0] == "Beaker"
    assert q.column("reason").to_pylist() == ["duplicate_id"] and q.column("detail").to_pylist() == ["id"]
    assert (counts.rows_in, counts.ok, counts.quarantined) == (4, 3, 1) and counts.rows_in == ok.num_rows + q.num_rows
    assert dict(counts.reasons) == {"duplicate_id": 1} and not counts.limit_reached
    assert len(kept) == 3 and kept.contains(pa.array(["1", "3", "4"])).tolist() == [True, True, False]
    assert any("read task" in line for line in logs)


def test_max_items_ends_the_catalog_at_its_nth_kept_item(tmp_path):
    counts, kept, out, _ = _items_pass(tmp_path, ITEMS, "data.max_items=2")
    assert pq.read_table(out / "items.parquet").column("item_id").to_pylist() == ["1", "2"]
    assert counts.limit_reached and (counts.rows_in, counts.ok, counts.quarantined) == (2, 2, 0)
    assert len(kept) == 2


def test_no_valid_item_is_one_line_naming_the_path(tmp_path):
    with pytest.raises(DataError) as e:
        _items_pass(tmp_path, "item_id,title\n,Beaker\n")
    assert "no valid items (1 rows read" in str(e.value) and "items.csv" in str(e.value)
    assert "\n" not in str(e.value)
