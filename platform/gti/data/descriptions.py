"""The description an item is grounded with: its own text, else a pseudo-description.

What it is for: one wording of an item's description, shared by the grounding pairs
(`pairs` stage: the desc2sid / sid2desc tasks) and the `description` init method (`ground`
stage: the mean of the description's token rows), so both see exactly the same text.

What it does not know: tokenizers, templates, or where the catalog comes from.
"""

from __future__ import annotations


def description_text(title: str, description: str, category: str, attributes_text: str,
                     max_chars: int) -> tuple[str, str]:
    """(description used for the pairs, source): source is "description", "pseudo" or "title"."""
    d = (description or "").strip()
    src = "description"
    if not d:
        parts = [p.strip() for p in (category or "", attributes_text or "") if p and p.strip()]
        d, src = (". ".join(parts), "pseudo") if parts else ((title or "").strip(), "title")
    if len(d) > max_chars:
        d = d[:max_chars].rstrip()
    return d, src
