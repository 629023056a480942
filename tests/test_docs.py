"""The links into docs/decisions.md that the code and the docs hold name one of its headings."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DECISIONS = ROOT / "docs" / "decisions.md"


def anchor(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_into_decisions_names_a_heading():
    headings = {
        anchor(line.lstrip("#"))
        for line in DECISIONS.read_text().splitlines()
        if line.startswith("#")
    }
    files = [
        p
        for folder in ("asyncmoe", "benchmarks", "docs", "scripts", "tests")
        for p in (ROOT / folder).rglob("*")
        if p.suffix in (".py", ".md", ".h", ".c")
    ] + [ROOT / "README.md"]
    links = [
        (p.relative_to(ROOT), m.group(1))
        for p in files
        for m in re.finditer(r"decisions\.md#([\w\-]+)", p.read_text())
    ]
    assert len(links) > 20  # the scan finds the links
    assert [link for link in links if link[1] not in headings] == []
