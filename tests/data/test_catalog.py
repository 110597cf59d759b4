"""gti.data.catalog: the pure row checks behind every quarantine reason."""

from __future__ import annotations

import datetime

import pytest

from gti.data import catalog as C


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("B00X", ("B00X", None)),
        ("  42 ", ("42", None)),
        (42, ("42", None)),
        (12.0, ("12", None)),
        ("12.0", ("12", None)),
        ("12.000", ("12", None)),
        ("007", ("007", None)),
        ("3.14", ("3.14", None)),  # a string id is kept verbatim
        (12.5, (None, C.FLOAT_ID)),
        (float("nan"), (None, C.MISSING_ID)),
        (float("inf"), (None, C.FLOAT_ID)),
        (None, (None, C.MISSING_ID)),
        ("   ", (None, C.MISSING_ID)),
        (True, (None, C.BAD_ID_TYPE)),
        ([1], (None, C.BAD_ID_TYPE)),
        (b"ok", ("ok", None)),
        (b"\xff\xfe", (None, C.INVALID_UTF8)),
    ],
)
def test_normalise_id(raw, expected):
    assert C.normalise_id(raw) == expected


def test_clean_text():
    assert C.clean_text("  a \n b  ", 100) == ("a b", None, False)
    assert C.clean_text("", 100) == (None, None, False)
    assert C.clean_text(float("nan"), 100) == (None, None, False)
    assert C.clean_text(5, 100) == (None, C.NON_STRING_TEXT, False)
    assert C.clean_text(["a"], 100) == (None, C.NON_STRING_TEXT, False)
    assert C.clean_text(b"caf\xc3\xa9", 100) == ("café", None, False)
    assert C.clean_text(b"caf\xe9", 100) == (None, C.INVALID_UTF8, False)
    text, reason, cut = C.clean_text("x" * 1_000_000, 2000)
    assert (len(text), reason, cut) == (2000, None, True)


def test_check_item_ok_and_pseudo_and_no_text():
    r = C.check_item("1", "Beaker", None, "Lab", {"brand": "Pyrex"}, 100)
    assert (r.reason, r.item_id, r.title, r.description, r.category) == (None, "1", "Beaker", "", "Lab")
    assert r.attributes_text == "brand: Pyrex" and not r.text_is_pseudo
    # Description only: not pseudo, title stays empty.
    r = C.check_item("2", None, "A glass beaker", None, {}, 100)
    assert r.reason is None and r.title == "" and not r.text_is_pseudo
    # Neither title nor description: pseudo-text from attributes and category.
    r = C.check_item("3", "", None, "Lab > Glass", {"brand": "Pyrex"}, 100)
    assert r.reason is None and r.text_is_pseudo and r.title == "Pyrex Lab > Glass"
    r = C.check_item("4", None, None, None, {"brand": None}, 100)
    assert r.reason == C.NO_TEXT
    r = C.check_item("5", 123, None, None, {}, 100)
    assert (r.reason, r.detail) == (C.NON_STRING_TEXT, "title")
    r = C.check_item("6", "ok", None, None, {"brand": b"\xff"}, 100)
    assert (r.reason, r.detail) == (C.INVALID_UTF8, "brand")
    r = C.check_item(None, "ok", None, None, {}, 100)
    assert r.reason == C.MISSING_ID
    r = C.check_item("7", "t" * 50, "d" * 50, None, {}, 10)
    assert r.truncated and len(r.title) == 10 and len(r.description) == 10


@pytest.mark.parametrize(
    "raw, expected",
    [
        (5, 5), (0, 0), (-1, None), (3.0, 3), (3.5, None), (float("nan"), None), ("17", 17),
        ("17.0", 17), ("-4", None), ("1970-01-01T00:00:10", 10), ("1969-12-31", None),
        ("yesterday", None), (None, None), (True, None), (b"\xff", None),
        (datetime.date(1970, 1, 2), 86400), (datetime.datetime(1970, 1, 1, 0, 1), 60),
    ],
)
def test_parse_ts(raw, expected):
    assert C.parse_ts(raw) == expected


def test_validate_items_batch_keeps_order_and_sets_reasons():
    raw = {
        "item_id": [b"a", None, 1.5, b"d"],
        "title": [b"A", b"B", b"C", None],
        "description": [None, None, None, None],
        "category": [None, None, None, None],
        "brand": [None, None, None, None],
    }
    t = C.validate_items(raw, ["brand"], 100, "f.csv", 10)
    assert t.schema == C.ITEM_BATCH_SCHEMA
    assert t.column("reason").to_pylist() == [None, C.MISSING_ID, C.FLOAT_ID, C.NO_TEXT]
    assert t.column("source_row").to_pylist() == [10, 11, 12, 13]
    raws = t.column("raw").to_pylist()
    assert raws[0] is None and '"title": "B"' in raws[1]


def test_validate_items_read_errors_and_huge_raw():
    raw = {"item_id": [b"\xff{bad", "x"], "title": [None, "y" * 5000], C.READ_ERROR: [C.INVALID_UTF8, None]}
    t = C.validate_items(raw, [], 100, "f.jsonl", 0)
    assert t.column("reason").to_pylist() == [C.INVALID_UTF8, None]
    assert "\\xff" in t.column("raw")[0].as_py()
    assert t.column("truncated").to_pylist() == [False, True]


def test_validate_interactions_batch():
    raw = {"user_id": ["u", None, "u", "u", "u"], "item_id": ["1", "2", None, "3.0", "4"],
           "ts": ["5", "6", "7", "-8", "x"]}
    t = C.validate_interactions(raw, True, "i.csv", 0)
    assert t.column("reason").to_pylist() == [None, C.MISSING_USER, C.MISSING_ITEM, C.INVALID_TS, C.INVALID_TS]
    assert t.column("ts").to_pylist()[0] == 5
    # Without a ts column the row position is the clock.
    t = C.validate_interactions({"user_id": ["u", "u"], "item_id": ["1", "2"]}, False, "i.csv", 7)
    assert t.column("ts").to_pylist() == [7, 8]
