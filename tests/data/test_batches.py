"""gti.data.batches: sources planned before any row is read, read tasks into validated batches in
process, file-level errors as one marker row (raised on the driver), skip mode's restarts, and
the raw JSON given to rows quarantined after the row check. (The ingest stage's own use is in
tests/data/test_bad_inputs.py; its Ray stream against this one in tests/stages/test_ingest.py.)"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from gti import config
from gti.data import catalog as cat
from gti.data.batches import (
    FILE_ERROR, UNREADABLE_FILE, SkipFile, Source, fill_interaction_raw, fill_item_raw, iterate, local_stream,
    raise_file_error, validated_batches,
)
from gti.common.errors import DataError, UnreadableFileError


def _data(items, interactions="unused.csv", *overrides):
    return config.load(None, [f"data.items.path={items}", f"data.interactions.path={interactions}",
                              *overrides]).data


def _concat(batches) -> pa.Table:
    return pa.concat_tables(list(batches))


def test_local_stream_validates_rows_in_input_order(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("item_id,title\n1,Beaker\n,No id\n2,Flask\n")
    b.write_text("item_id,title\n3,Pipette\n")
    d = _data(f"{tmp_path}/*.csv")
    src = Source(d, "items", log=lambda m: None)
    assert [t.file for t in src.tasks] == [str(a), str(b)] and src.skipped == []
    t = _concat(local_stream(src.tasks, "items", d.items.columns, d.max_text_chars))
    assert t.column("item_id").to_pylist() == ["1", None, "2", "3"]
    assert t.column("reason").to_pylist() == [None, cat.MISSING_ID, None, None]
    assert t.column("source_file").to_pylist() == [str(a)] * 3 + [str(b)]
    assert t.column("source_row").to_pylist() == [0, 1, 2, 0]


def test_interactions_without_ts_column_are_validated(tmp_path):
    p = tmp_path / "i.csv"
    p.write_text("user_id,item_id\nu,1\n,2\n")
    d = _data(tmp_path / "items.csv", p, "data.interactions.columns.ts=null")
    src = Source(d, "interactions", log=lambda m: None)
    t = _concat(local_stream(src.tasks, "interactions", d.interactions.columns, d.max_text_chars))
    assert t.column("user_id").to_pylist() == ["u", None]
    assert t.column("reason").to_pylist() == [None, cat.MISSING_USER]


def test_a_file_damaged_mid_read_ends_with_one_marker_row(damaged):
    parts = damaged.parquet_parts("catalog", n_parts=2, damage=(1, 2))
    d = _data(parts)
    src = Source(d, "items", log=lambda m: None)  # the footer is intact: the header check passes
    bad = next(t for t in src.tasks if t.file.endswith("part-1.parquet"))
    batches = list(validated_batches([bad], "items", d.items.columns, d.max_text_chars, batch_rows=100))
    assert sum(b.num_rows for b in batches[:-1]) == 500  # row groups 0 and 1 read before the damage
    (mark,) = batches[-1].to_pylist()
    assert mark["reason"] == UNREADABLE_FILE and mark["source_file"] == bad.file
    assert mark["raw"].startswith("row group 2 (data rows 500-749) is damaged: ")
    with pytest.raises(UnreadableFileError, match=r"part-1\.parquet: row group 2"):
        raise_file_error(pa.concat_tables(batches))
    with pytest.raises(SkipFile) as e:
        raise_file_error(batches[-1], skip=True)
    assert e.value.file == bad.file and e.value.what == mark["raw"]
    raise_file_error(batches[0])  # no marker: nothing raised


def test_file_error_marker_is_a_data_error():
    row = {f.name: None for f in cat.ITEM_BATCH_SCHEMA}
    row.update(reason=FILE_ERROR, detail="x.csv: missing column 'item_id'", source_file="x.csv")
    ok = {f.name: None for f in cat.ITEM_BATCH_SCHEMA}
    batch = pa.Table.from_pylist([ok, row], schema=cat.ITEM_BATCH_SCHEMA)
    with pytest.raises(DataError, match="missing column 'item_id'") as e:
        raise_file_error(batch, skip=True)  # not a skippable file: a column error is the user's
    assert not isinstance(e.value, UnreadableFileError)


def test_skip_mode_leaves_unreadable_files_out_and_passes_restart(damaged):
    parts = damaged.parquet_parts("catalog", n_parts=3, damage=(1, 2))
    (parts / "part-9.parquet").write_bytes(b"")  # found by the header check
    with pytest.raises(UnreadableFileError, match="part-9.parquet: not a readable parquet file"):
        Source(_data(parts), "items", log=lambda m: None)
    logs: list[str] = []
    d = _data(parts, "unused.csv", "data.on_unreadable_file=skip")
    src = Source(d, "items", log=logs.append)
    assert [s["file"] for s in src.skipped] == [str(parts / "part-9.parquet")]
    seen: list[list[str]] = []

    def body(tasks):
        seen.append([t.file for t in tasks])
        rows = 0
        for batch in iterate(local_stream, tasks, "items", d.items.columns, d.max_text_chars, None):
            raise_file_error(batch, src.skip)
            rows += batch.num_rows
        return rows

    assert src.passes(body) == 2000
    assert len(seen) == 2 and str(parts / "part-1.parquet") in seen[0]
    assert str(parts / "part-1.parquet") not in seen[1]
    assert [s["file"] for s in src.skipped] == [str(parts / "part-9.parquet"), str(parts / "part-1.parquet")]
    assert any("skipped unreadable file" in m and "part-1.parquet" in m for m in logs)
    assert any(m.startswith("items: reading again without") for m in logs)


def test_all_files_unreadable_is_one_data_error(tmp_path):
    (tmp_path / "a.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"all 1 file\(s\) are unreadable \(first: .*a\.parquet"):
        Source(_data(tmp_path / "a.parquet", "unused.csv", "data.on_unreadable_file=skip"), "items",
               log=lambda m: None)


def test_iterate_closes_the_stream_when_the_caller_stops():
    closed = []

    def stream(tasks, kind, columns, max_text_chars, parallelism):
        try:
            yield from tasks
        finally:
            closed.append(True)

    it = iterate(stream, [1, 2, 3], "items", None, 0, None)
    assert next(it) == 1 and not closed
    it.close()
    assert closed == [True]


def test_fill_raw_only_where_missing():
    t = pa.table({"user_id": ["u", "v"], "item_id": ["1", "2"], "ts": pa.array([5, None], pa.int64()),
                  "raw": ["kept", None]})
    out = fill_interaction_raw(t)
    assert out.column("raw")[0].as_py() == "kept"
    assert json.loads(out.column("raw")[1].as_py()) == json.loads(cat.raw_json({"user_id": "v", "item_id": "2",
                                                                                "ts": None}))
    full = t.set_column(3, "raw", pa.array(["a", "b"]))
    assert fill_interaction_raw(full) is full
    items = pa.table({c: ["x"] for c in ("item_id", "title", "description", "category", "attributes_text")}
                     | {"raw": pa.array([None], pa.string())})
    assert json.loads(fill_item_raw(items).column("raw")[0].as_py())["title"] == "x"
    assert pc.all(pc.is_valid(fill_item_raw(items).column("raw"))).as_py()
