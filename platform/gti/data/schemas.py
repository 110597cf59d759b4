"""The schemas of the contract files (docs/ARCHITECTURE.md, "Stage outputs"), defined once.

What it is for: every writer and reader of these tables uses the same pyarrow schema, whether it
is a stage or a command beside the pipeline (`gti refresh`, `gti vocab ground`): ingest's
items.parquet (`ITEMS_OUT_SCHEMA`), items_quarantine (`ITEMS_Q_SCHEMA`), interactions.parquet
(`INTER_OUT_SCHEMA`), interactions_quarantine (`INTER_Q_SCHEMA`) and sequences.parquet
(`SEQ_SCHEMA`); pairs.parquet (`PAIRS_SCHEMA`, token columns `PAIR_TOKEN_COLUMNS`); sid_map.parquet
(`SID_MAP_SCHEMA`). The item and interaction columns come from `gti.data.catalog`'s batch schemas.

What it does not know: how the rows are made, files, Ray.
"""

from __future__ import annotations

import pyarrow as pa

from gti.data import catalog as cat

ITEMS_OUT_SCHEMA = pa.schema([cat.ITEM_BATCH_SCHEMA.field(c) for c in cat.ITEMS_OUT_COLUMNS])
ITEMS_Q_SCHEMA = pa.schema([cat.ITEM_BATCH_SCHEMA.field(c) for c in cat.QUARANTINE_COLUMNS])
INTER_OUT_SCHEMA = pa.schema([("user_id", pa.string()), ("item_id", pa.string()), ("ts", pa.int64())])
INTER_Q_SCHEMA = pa.schema([cat.INTERACTION_BATCH_SCHEMA.field(c) for c in cat.INTERACTIONS_QUARANTINE_COLUMNS])
SEQ_SCHEMA = pa.schema(
    [("user_id", pa.string()), ("train_items", pa.list_(pa.string())),
     ("valid_item", pa.string()), ("test_item", pa.string()),
     # The periods' lists (gti.data.sequences): one item each for leave-one-out, any for global_time.
     ("valid_items", pa.list_(pa.string())), ("test_items", pa.list_(pa.string()))]
)

PAIR_TOKEN_COLUMNS = ("input_ids", "labels", "prompt_ids", "answer_ids")
PAIRS_SCHEMA = pa.schema(
    [("item_id", pa.string()), ("task", pa.string()), ("split", pa.string())]
    + [(c, pa.list_(pa.int32())) for c in PAIR_TOKEN_COLUMNS]
)

SID_MAP_SCHEMA = pa.schema([("item_id", pa.string()), ("codes", pa.list_(pa.int32())), ("sid", pa.string())])
