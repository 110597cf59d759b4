"""gti/data/descriptions.py: the one wording of an item's description."""

from gti.data.descriptions import description_text


def test_own_description_then_pseudo_then_title_and_the_cut():
    assert description_text("T", "  A glass beaker. ", "Lab", "Brand", 100) == ("A glass beaker.", "description")
    assert description_text("T", "", "Lab", "Brand X", 100) == ("Lab. Brand X", "pseudo")
    assert description_text("Title only", " ", "", "", 100) == ("Title only", "title")
    assert description_text("T", "abcdef ghij", "", "", 7) == ("abcdef", "description")


def test_description_fallbacks():
    assert description_text("T", "Real desc", "Cat", "brand: X", 100) == ("Real desc", "description")
    assert description_text("T", "", "Lab > Glass", "brand: X", 100) == ("Lab > Glass. brand: X", "pseudo")
    assert description_text("T", " ", "", "", 100) == ("T", "title")
    assert description_text("T", "abcdef", "", "", 3) == ("abc", "description")
