"""Python source as a long real text: questkv's own modules at a recorded commit (the ``agreement_code`` text).

The text is every ``questkv/**/*.py`` file in path order, each after a line ``# file: PATH``, joined with
newlines. Files are read with ``git show COMMIT:PATH`` where git and the commit are at hand; where they are not
(the GPU machine's copy of the working tree has no usable ``.git``) from the installed package's tree, and the
commit is then :func:`questkv.eval.provenance.git_commit`'s (``$QUESTKV_COMMIT`` there). Either way the result
records the commit, where the files came from (``"git"`` or ``"tree"``: a tree may hold edits not committed)
and the text's SHA-256, so that two runs can tell whether they scored the same text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
from pathlib import Path
from typing import Optional

from questkv.eval.provenance import git_commit

SOURCE = "code:questkv"
PACKAGE = "questkv"
ROOT = Path(__file__).resolve().parents[2]
"""The folder holding the ``questkv`` package (the repository root in a checkout)."""


@dataclasses.dataclass(frozen=True)
class CodeText:
    """The code text and where it came from: ``commit``, ``origin`` (``"git"`` or ``"tree"``), ``files``
    (how many), ``sha256`` of the UTF-8 text."""

    text: str
    commit: str
    origin: str
    files: int
    sha256: str

    def record(self) -> dict:
        """What a result stores about the text (all but the text)."""
        return {"source": SOURCE, "commit": self.commit, "origin": self.origin, "files": self.files,
                "sha256": self.sha256, "characters": len(self.text)}


def _git(root: Path, *args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout


def load(commit: Optional[str] = None, root: Path = ROOT) -> CodeText:
    """The text at ``commit`` (``None``: the tree's commit, :func:`git_commit`) read with git, or from the tree
    under ``root`` when git cannot read it and ``commit`` is ``None`` or the tree's commit.

    Raises:
        ValueError: ``commit`` is neither readable with git nor the tree's commit.
    """
    top = _git(root, "rev-parse", "--show-toplevel")  # a copy of the tree inside another repository is not its history
    own = top is not None and Path(top.strip()).resolve() == root.resolve()
    resolved = _git(root, "rev-parse", "--verify", "--quiet", f"{commit or git_commit()}^{{commit}}") if own else None
    paths = None if resolved is None else _git(root, "ls-tree", "-r", "--name-only", resolved.strip(), "--", PACKAGE)
    if paths is not None:
        sha = resolved.strip()
        names = sorted(p for p in paths.splitlines() if p.endswith(".py"))
        bodies = [_git(root, "show", f"{sha}:{name}") for name in names]
        if all(body is not None for body in bodies):
            return _text(names, bodies, sha, "git")
    tree_commit = git_commit()
    if commit is not None and not (tree_commit.startswith(commit) or commit.startswith(tree_commit)):
        raise ValueError(f"code_commit {commit!r} cannot be read with git here and the tree is at {tree_commit!r}; "
                         "run where the repository's history is, or leave code_commit unset")
    names = sorted(p.relative_to(root).as_posix() for p in (root / PACKAGE).rglob("*.py")
                   if "__pycache__" not in p.parts)
    return _text(names, [(root / name).read_text(encoding="utf-8") for name in names], tree_commit, "tree")


def _text(names: list[str], bodies: list[str], commit: str, origin: str) -> CodeText:
    text = "\n".join(f"# file: {name}\n{body}" for name, body in zip(names, bodies))
    return CodeText(text, commit, origin, len(names), hashlib.sha256(text.encode("utf-8")).hexdigest())
