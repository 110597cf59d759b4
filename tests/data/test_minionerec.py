"""gti/data/minionerec.py on the committed fixture in MiniOneRec's public format
(tests/data/fixtures/minionerec, written by its make.py): the files are found, the catalog and
interactions rebuilt, and the global time split with the files' cuts gives back exactly their
valid and test rows (history of <= 10 items, target); bad folders and rows fail naming them."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import polars as pl
import pytest

from gti.data import minionerec as M
from gti.data.sequences import build_sequences
from gti.common.errors import DataError
from gti.eval.slices import eval_windows
from gti.train.sft_data import training_windows

FIXTURE = Path(__file__).parent / "fixtures" / "minionerec"


def _csv_rows(split: str) -> list[tuple[str, list[str], str]]:
    df = pl.read_csv(next((FIXTURE / split).glob("*.csv")), infer_schema=False)
    return [(u, [str(i) for i in ast.literal_eval(h)], t)
            for u, h, t in df.select("user_id", "history_item_id", "item_id").iter_rows()]


def _split(conv: M.Converted):
    df = conv.interactions.with_row_index("order").with_columns(pl.col("order").cast(pl.Int64))
    return build_sequences(df, 2, None, "global_time", cuts=conv.cuts)


def test_the_fixture_is_found_and_read():
    files = M.find_files(FIXTURE)
    assert files.index_json is not None and files.item_json.name == "Tiny_Scientific.item.json"
    conv = M.read(files)
    assert conv.items.height == 40 and conv.items.columns == ["item_id", "title", "description", "category", "brand"]
    assert conv.items["item_id"].to_list()[:3] == ["0", "1", "2"]  # index.json's keys are item ids as they stand
    assert conv.facts["rows"] == {s: len(_csv_rows(s)) for s in ("train", "valid", "test")}
    assert conv.facts["users"] == 30


@pytest.mark.parametrize("split", ["valid", "test"])
def test_the_time_split_gives_back_every_row_of_their_files(split):
    """Every valid/test row of their CSVs, in their order per user, history and target alike."""
    res = _split(M.read(M.find_files(FIXTURE)))
    ours = eval_windows(res.sequences, split, 10)
    got = sorted(zip(ours["user_id"].to_list(), ours["history"].to_list(), ours["target"].to_list()))
    assert got == sorted(_csv_rows(split))
    assert res.split["interactions"][split] >= len(_csv_rows(split))  # + users' first items, no row


def test_training_windows_are_their_train_rows():
    res = _split(M.read(M.find_files(FIXTURE)))
    w = training_windows(res.sequences, 10)
    got = sorted(zip(w["user_id"].to_list(), w["history"].to_list(), w["target"].to_list()))
    assert got == sorted(_csv_rows("train"))


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "mo"
    shutil.copytree(FIXTURE, root, ignore=shutil.ignore_patterns("*.py"))
    return root


def test_bad_folders_and_rows_are_named(tmp_path):
    with pytest.raises(DataError, match="not a folder"):
        M.find_files(tmp_path / "nowhere")
    root = _copy(tmp_path)
    shutil.copy(next((root / "test").glob("*.csv")), root / "test" / "Other_5.csv")
    with pytest.raises(DataError, match="2 test CSV files .* set data.dataset"):
        M.find_files(root)
    assert M.find_files(root, "Tiny_Scientific").test.name.startswith("Tiny_Scientific")
    (root / "test" / "Other_5.csv").unlink()

    valid = next((root / "valid").glob("*.csv"))
    df = pl.read_csv(valid, infer_schema=False)
    df.with_columns(pl.when(pl.int_range(pl.len()) == 1).then(pl.lit("[39, 38]"))
                    .otherwise(pl.col("history_item_id")).alias("history_item_id")).write_csv(valid)
    with pytest.raises(DataError, match=r"valid/.*row 1: user .* history_item_id \['39', '38'\] is not the end"):
        M.read(M.find_files(root))
    df.with_columns(pl.when(pl.int_range(pl.len()) == 0).then(pl.lit("999"))
                    .otherwise(pl.col("item_id")).alias("item_id")).write_csv(valid)
    with pytest.raises(DataError, match="row 0: item 999 is not in Tiny_Scientific.item.json"):
        M.read(M.find_files(root))
    df.drop("history_item_id").write_csv(valid)
    with pytest.raises(DataError, match=r"missing column\(s\) \['history_item_id'\]"):
        M.read(M.find_files(root))
    (root / "index" / "Tiny_Scientific.item.json").unlink()
    with pytest.raises(DataError, match="no index/\\*.item.json"):
        M.find_files(root)
