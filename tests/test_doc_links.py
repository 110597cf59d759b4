"""The documents' links: every relative link names a file that exists, and every `#anchor` a
heading of that file (as GitHub makes anchors from headings). Three links into bench/RESULTS.md
pointed at no heading before this test."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "bench" / "RESULTS.md", ROOT / "tests" / "README.md",
        *sorted((ROOT / "bench").glob("*/*.md")), *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]*)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor, with GitHub's -1, -2 ... for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slug_matches_github():
    assert slug(" Clean-clone `.ci/run` of b12bede (2026-12-04 07:15-07:32 UTC)") == \
        "clean-clone-cirun-of-b12bede-2026-12-04-0715-0732-utc"
    assert slug("A sid driver: 1M and 10M items") == "a-sid-driver-1m-and-10m-items"


def test_every_relative_link_and_anchor_resolves():
    bad = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            path = (doc.parent / file_part).resolve() if file_part else doc
            if not path.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_findings_and_limitations_link_no_dated_anchor():
    """docs/findings.md and docs/limitations.md cite bench/RESULTS.md (a section of it) or a topic
    page without an anchor: the anchor of a dated entry moves when the entry is rewritten or
    deleted (issue 53 item 2)."""
    bad = []
    for doc in (ROOT / "docs" / "findings.md", ROOT / "docs" / "limitations.md"):
        for target in LINK.findall(doc.read_text()):
            file_part, _, anchor = target.partition("#")
            if file_part.endswith("RESULTS.md") and re.search(r"\d{4}-\d{2}-\d{2}", anchor):
                bad.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not bad, "dated anchors (link the page, bench/RESULTS.md):\n" + "\n".join(bad)
