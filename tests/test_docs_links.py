"""Every relative link of the README and of ``docs/*.md`` points to a file of the checkout, and every ``#anchor`` to a
heading of its page (GitHub's anchor for it)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^()\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()  # a link's text only
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on ``page``, repeated headings numbered as GitHub numbers them (``-1``, ``-2``)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        anchor = github_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    """The links of ``page`` outside code blocks that are not URLs."""
    return [target for target in LINK.findall(FENCE.sub("", page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def test_anchor_rule():
    assert github_anchor("Selection reuse (`selection_interval`)") == "selection-reuse-selection_interval"
    assert github_anchor("Accuracy: Qwen2.5-Coder-1.5B at 16k") == "accuracy-qwen25-coder-15b-at-16k"
    assert github_anchor("Command line: `generate`, `bench latency`") == "command-line-generate-bench-latency"


@pytest.mark.parametrize("page", PAGES, ids=[page.relative_to(ROOT).as_posix() for page in PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)
