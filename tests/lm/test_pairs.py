"""gti/lm/pairs.py: the grounding-pair renderer (the pairs stage maps it over the catalog, `gti
refresh` over its new items): seeded validation items, one-line errors naming an item without a
SID or with codes outside the codec."""

from __future__ import annotations

import pyarrow as pa
import pytest

from gti import config as C
from gti.lm.pairs import RenderPairs, is_val_item

LEVELS, K = 2, 4


def test_val_items_are_seeded_and_order_free():
    ids = [str(i) for i in range(4000)]
    a = {i for i in ids if is_val_item(i, 0, 0.1)}
    assert a == {i for i in reversed(ids) if is_val_item(i, 0, 0.1)}
    assert 300 < len(a) < 500
    assert a != {i for i in ids if is_val_item(i, 1, 0.1)}
    assert not any(is_val_item(i, 0, 0.0) for i in ids)


def test_item_without_sid_is_named(tmp_path):
    from gti.common.errors import DataError, user_error
    from gti.lm.models import build_tiny_tokenizer
    from gti.lm.new_rows import extend_tokenizer
    from gti.sid.codec import SidCodec

    tok = build_tiny_tokenizer()
    codec = SidCodec(LEVELS, [K, K])
    extend_tokenizer(tok, codec.tokens())
    fn = RenderPairs(tok, codec.code_to_token_id_table(tok).numpy(), C.PairsConfig().model_dump(), 0, None, set())
    batch = pa.table({"item_id": ["a", "it007"], "title": ["T", "U"], "description": ["", ""],
                      "category": ["", ""], "attributes_text": ["", ""],
                      "codes": pa.array([[1, 2], None], type=pa.list_(pa.int32()))})
    with pytest.raises(DataError, match="it007"):
        fn(batch)
    bad = batch.slice(0, 1).set_column(5, "codes", pa.array([[1, 9]], type=pa.list_(pa.int32())))
    with pytest.raises(DataError, match="item_id 'a' has codes"):
        fn(bad)
    ok = fn(batch.slice(0, 1))
    assert ok.num_rows == 6 and set(ok.column("split").to_pylist()) == {"train"}
    # Ray Data keeps a worker's DataError only as traceback text; the stage recovers it.
    wrapped = RuntimeError("UDF failed\nTraceback ...\ngti.common.errors.DataError: pairs: item_id 'it007' has no SID")
    assert str(user_error(wrapped)) == "pairs: item_id 'it007' has no SID"
