"""The data section of the run config (gti/config/data.py): the split keys, data.root, and
defaults left out of the dump (so older runs keep their ingest fingerprint)."""

from __future__ import annotations

import pytest

from gti import config as C
from gti.config.data import DataConfig
from gti.common.errors import ConfigError


def test_split_defaults_to_leave_one_out_and_stays_out_of_the_dump():
    d = C.load(None).data
    assert isinstance(d, DataConfig) and d.split == "leave_one_out" and d.split_ratios == [8.0, 1.0, 1.0]
    dumped = C.load(None).model_dump()["data"]
    assert not {"split", "split_ratios", "root", "dataset"} & set(dumped)
    g = C.load(None, ["data.split=global_time", "data.split_ratios=[7,2,1]"]).model_dump()["data"]
    assert g["split"] == "global_time" and g["split_ratios"] == [7.0, 2.0, 1.0]


def test_bad_split_keys_are_named():
    with pytest.raises(ConfigError, match="data.split"):
        C.load(None, ["data.split=random"])
    with pytest.raises(ConfigError, match="data.split_ratios"):
        C.load(None, ["data.split_ratios=[8,1]"])
    with pytest.raises(ConfigError, match="every share must be > 0"):
        C.load(None, ["data.split_ratios=[8,0,1]"])
    with pytest.raises(ConfigError, match="data.root .* set data.split=global_time"):
        C.load(None, ["data.root=/tmp/x"])
    d = C.load(None, ["data.root=/tmp/x", "data.split=global_time", "data.dataset=Office"]).data
    assert (d.root, d.dataset) == ("/tmp/x", "Office")
