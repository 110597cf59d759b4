"""gti.data.bundled: `bundled:<name>` resolves inside the installed package, never ../shared."""

from pathlib import Path

import pyarrow.parquet as pq
import pytest

import gti
from gti.data import bundled
from gti.common.errors import DataError


def test_bundled_resolves_inside_package():
    pkg = Path(gti.__file__).resolve().parent
    for kind in ("items", "interactions"):
        p = Path(bundled.resolve("bundled:amazon-scientific", kind)).resolve()
        assert p.is_file()
        assert pkg in p.parents
        assert "shared" not in p.parts
    items = pq.read_table(bundled.resolve("bundled:amazon-scientific", "items"))
    assert items.num_rows == 4385
    assert items.column_names[0] == "item_id"
    assert "amazon-scientific" in bundled.available()


def test_plain_paths_pass_through():
    assert bundled.resolve("/data/items.csv", "items") == "/data/items.csv"


def test_unknown_bundled_name_is_one_line_error():
    with pytest.raises(DataError, match="unknown bundled data set 'bundled:nope'.*amazon-scientific"):
        bundled.resolve("bundled:nope", "items")
