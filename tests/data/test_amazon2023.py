"""gti.data.amazon2023: the Amazon Reviews 2023 metadata/reviews layout, record by record and
through ingest."""

from __future__ import annotations

from gti.data import amazon2023

from .conftest import FIXTURES


def test_item_record_flattens_lists_and_details():
    rec = amazon2023.item_record({
        "parent_asin": "B1", "title": "Beaker", "description": ["Glass.", " ", "Graduated."],
        "features": ["Heat resistant", ""], "categories": [], "main_category": "Industrial",
        "details": {"Brand": "LabPro", "Weight": 1.2, "Flag": True, "Empty": ""}, "store": "LabPro Store",
    })
    assert rec == {
        "item_id": "B1", "title": "Beaker", "description": "Glass. Graduated. Features: Heat resistant",
        "category": "Industrial", "brand": "LabPro", "store": "LabPro Store",
        "details": "Brand: LabPro; Weight: 1.2", "main_category": "Industrial",
    }
    # No Brand in details: the store stands in; categories win over main_category.
    rec = amazon2023.item_record({"asin": "A9", "categories": ["A", "B"], "store": "S", "details": None})
    assert (rec["item_id"], rec["category"], rec["brand"], rec["details"], rec["description"]) == ("A9", "A > B", "S", None, None)


def test_review_record():
    assert amazon2023.review_record({"user_id": "U", "parent_asin": "P", "asin": "A", "timestamp": 1588615855070}) == {
        "user_id": "U", "item_id": "P", "ts": 1588615855070}


def test_ingest_amazon2023_metadata_and_reviews(run_ingest):
    r = run_ingest(FIXTURES / "amazon2023_meta.jsonl", FIXTURES / "amazon2023_reviews.jsonl",
                   "data.items.format=amazon2023", "data.interactions.format=amazon2023",
                   "data.items.columns.attributes=[brand,details]")
    r.check_accounting()
    items = {i["item_id"]: i for i in r.table("items").to_pylist()}
    assert set(items) == {"B0A1", "B0A2", "B0A3", "B0A4", "B0A5", "B0A6"}
    assert items["B0A1"]["description"] == ("Lab-grade beakers for chemistry. Dishwasher safe. "
                                            "Features: Heat resistant to 500 C; Printed graduations")
    assert items["B0A1"]["category"] == "Industrial & Scientific > Lab & Scientific Products > Beakers"
    assert items["B0A2"]["category"] == "Industrial & Scientific"  # empty categories: main_category
    assert "brand: Mitutoyo" in items["B0A3"]["attributes_text"]  # Manufacturer as the brand
    assert "Battery: SR44" in items["B0A3"]["attributes_text"]
    # No title or text, but main_category: kept with a pseudo-text title from it.
    assert items["B0A5"]["text_is_pseudo"] and items["B0A5"]["title"].startswith("Industrial & Scientific")
    assert r.reasons("items_quarantine") == ["malformed_record"]
    inter = r.table("interactions").to_pylist()
    assert len(inter) == 16 and {x["user_id"] for x in inter} == {"AG1", "AG2", "AG3", "AG4"}
    assert min(x["ts"] for x in inter) == 1588615855070 + 86400000
    assert r.reasons("interactions_quarantine") == ["invalid_ts"]
    assert r.facts["n_users"] == 4
