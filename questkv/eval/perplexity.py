"""Long-text perplexity through the sparse decode path (the ``ppl`` task).

A text is tokenized once and cut into ``num_windows`` consecutive, non-overlapping windows of
``length`` tokens from its start. Each window's first ``length - score_tokens - 1`` tokens are
prefilled densely; the rest are fed one token per decode step (teacher forcing) and the last
``score_tokens`` of them are scored: every scored prediction comes from a decode step of the
setting under test, with ``length - score_tokens - 1`` to ``length - 2`` tokens of context.

The default text is the Python standard library's ``pydoc_data.topics`` (the language reference
topics, public documentation under the PSF licence that every Python install carries): its
topics joined with blank lines in the module's order. It differs between Python versions, so a
result records the Python version and the text's SHA-256. :data:`BOOK_TEXT` selects a public-domain
book instead (Newton's *Opticks*, the essay tasks' haystack, :mod:`questkv.eval.book`), long
enough for several 32k-token windows; any UTF-8 file works too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import platform
from pathlib import Path
from typing import Optional

import torch

from questkv.eval import book
from questkv.validation import check_int

STDLIB_TEXT = "stdlib:pydoc_data.topics"
BOOK_TEXT = book.SOURCE


@dataclasses.dataclass(frozen=True)
class Text:
    """A text to score. ``source``: the file path, :data:`STDLIB_TEXT` or :data:`BOOK_TEXT`; ``sha256`` of the UTF-8 text."""

    source: str
    text: str
    sha256: str
    python: Optional[str]  # the Python version, for the stdlib text


def load_text(text_file: Optional[str] = None) -> Text:
    """The text of ``text_file`` (UTF-8), the stdlib topics when it is ``None`` or :data:`STDLIB_TEXT`,
    the book when it is :data:`BOOK_TEXT`."""
    if text_file is None or text_file == STDLIB_TEXT:
        from pydoc_data import topics

        text = "\n\n".join(topics.topics.values())
        source, python = STDLIB_TEXT, platform.python_version()
    elif text_file == BOOK_TEXT:
        text, source, python = book.text(), BOOK_TEXT, None
    else:
        path = Path(text_file)
        if not path.is_file():
            raise FileNotFoundError(f"--text-file {text_file!r} is not a file (nor {STDLIB_TEXT} or {BOOK_TEXT})")
        text = path.read_text(encoding="utf-8")
        source, python = str(path), None
    return Text(source, text, hashlib.sha256(text.encode("utf-8")).hexdigest(), python)


def windows(tokenizer, text: str, length: int, num_windows: int) -> torch.Tensor:
    """``[num_windows, length]`` int64 token ids: consecutive windows from the text's start.

    Raises:
        ValueError: the text has fewer than ``length * num_windows`` tokens.
    """
    check_int("length", length, minimum=2)
    check_int("num_windows", num_windows, minimum=1)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) < length * num_windows:
        raise ValueError(
            f"the text has {len(ids)} tokens, fewer than {num_windows} windows x {length} tokens; "
            f"allowed: num_windows <= {len(ids) // length} at this length"
        )
    return torch.tensor(ids[: length * num_windows]).view(num_windows, length)
