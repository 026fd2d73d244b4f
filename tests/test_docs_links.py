"""The user documents link only inside the repository, and every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench/results/README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(doc: Path) -> list[str]:
    links = [m.group(1).split("#")[0] for m in LINK.finditer(doc.read_text())]
    return [t for t in links if t and not re.match(r"[a-z]+:", t)]  # http:, https:, mailto:


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(doc: Path) -> None:
    assert doc.is_file()
    for target in relative_links(doc):
        path = (doc.parent / target).resolve()
        assert path.is_relative_to(ROOT), f"{doc.name} links outside the repository: {target}"
        assert path.exists(), f"{doc.name} links to a missing path: {target}"


def test_readme_names_no_path_outside_the_repository() -> None:
    text = (ROOT / "README.md").read_text()
    assert "../" not in text and "/work/" not in text
