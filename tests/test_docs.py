"""docs/ is the floor plan: README.md stays short and links every docs/ page, every relative link resolves,
docs/recipes.md is what `harness build` generates, and every docs/ page the code cites exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.config import recipes_doc

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
README_MAX_LINES = 200
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
CODE_DIRS = ("harness", "tests", "bench", "docker")


def links(page: Path) -> list[str]:
    """The relative link targets of a Markdown page (web links and pure anchors left out)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code blocks are not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+\s+(.*)$", page.read_text(), flags=re.M)
    return {re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", h.strip().lower())) for h in heads}


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.split("#")[0]).resolve() for t in links(README)}
    missing = [p.name for p in PAGES if p.resolve() not in linked]
    assert PAGES and not missing, f"docs/ pages not linked from README.md: {missing}"


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_recipes_page_is_in_sync_with_the_schema_and_recipes():
    page = ROOT / recipes_doc.DOC_PATH
    assert page.read_text() == recipes_doc.render(), "docs/recipes.md is out of date: run `harness build`"


def test_every_docs_page_the_code_cites_exists():
    """`docs/X.md` anywhere in the code, and the bare `deepspeed-facts.md` short form, name a page in docs/."""
    cited = set()
    for folder in CODE_DIRS:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".json", ".sh") or path == Path(__file__).resolve():
                continue
            text = path.read_text(errors="replace")  # a test fixture may hold latin-1 on purpose
            cited |= {(m, path) for m in re.findall(r"\bdocs/([\w.-]+\.md)", text)}
            cited |= {(m, path) for m in re.findall(r"(?<![\w/])(deepspeed-facts\.md)", text)}
    assert cited, "expected the code to cite docs/deepspeed-facts.md"
    missing = sorted(f"{p.relative_to(ROOT)} cites docs/{name}" for name, p in cited if not (DOCS / name).is_file())
    assert not missing, missing
