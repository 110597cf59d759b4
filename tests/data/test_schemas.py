"""gti/data/schemas.py: the contract files' schemas say what docs/ARCHITECTURE.md's "Stage
outputs" table says, and the item and interaction ones follow the row checks' batch schemas."""

from __future__ import annotations

import pyarrow as pa

from gti.data import catalog as cat
from gti.data import schemas as S


def test_ingest_outputs_have_the_documented_columns():
    assert S.ITEMS_OUT_SCHEMA.names == cat.ITEMS_OUT_COLUMNS == [
        "item_id", "title", "description", "category", "attributes_text", "text_is_pseudo"]
    assert S.ITEMS_OUT_SCHEMA.field("text_is_pseudo").type == pa.bool_()
    assert S.ITEMS_Q_SCHEMA.names == ["source_file", "source_row", "item_id", "reason", "detail", "raw"]
    assert S.INTER_OUT_SCHEMA.names == ["user_id", "item_id", "ts"]
    assert S.INTER_OUT_SCHEMA.field("ts").type == pa.int64()
    assert S.INTER_Q_SCHEMA.names == ["source_file", "source_row", "user_id", "item_id", "reason", "detail", "raw"]
    assert S.SEQ_SCHEMA.names == ["user_id", "train_items", "valid_item", "test_item", "valid_items", "test_items"]
    assert S.SEQ_SCHEMA.field("train_items").type == pa.list_(pa.string())


def test_pairs_and_sid_map_columns():
    assert S.PAIRS_SCHEMA.names == ["item_id", "task", "split", *S.PAIR_TOKEN_COLUMNS]
    assert S.PAIR_TOKEN_COLUMNS == ("input_ids", "labels", "prompt_ids", "answer_ids")
    assert all(S.PAIRS_SCHEMA.field(c).type == pa.list_(pa.int32()) for c in S.PAIR_TOKEN_COLUMNS)
    assert S.SID_MAP_SCHEMA.names == ["item_id", "codes", "sid"]
    assert S.SID_MAP_SCHEMA.field("codes").type == pa.list_(pa.int32())
