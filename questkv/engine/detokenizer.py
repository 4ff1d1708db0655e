"""Incremental detokenisation: each step decodes a short window of a request's newest tokens, not all of them."""

from __future__ import annotations

from typing import Sequence

_INCOMPLETE = "\ufffd"  # what decoding the first bytes of a multi-byte character gives


class IncrementalDetokenizer:
    """The text of one request's output tokens, kept up to date a few tokens at a time.

    Decoding all output tokens at every step costs O(tokens) per step. Instead, :meth:`update` decodes the
    window from ``prefix_offset`` to the end twice, with and without the new tokens, and appends the
    difference. The window starts at the last tokens that added text (tokens that add none, such as skipped
    special tokens, widen it), so a tokenizer whose decoding of a token depends on the one before it
    (SentencePiece's leading spaces) gives the same text. New tokens
    that end inside a multi-byte character wait for the rest of it (until ``final``). The text equals
    ``tokenizer.decode(token_ids, skip_special_tokens=True)`` (when a window's text is not a prefix of the
    longer window's, as a tokenizer that cleans up spaces may give, the whole output is decoded instead).

    Args:
        tokenizer: a transformers tokenizer (``decode``).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self.prefix_offset = 0  # the first token of the context window
        self.read_offset = 0  # the first token not yet in ``text``

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def update(self, token_ids: Sequence[int], final: bool = False) -> str:
        """The text of ``token_ids``, all output tokens so far (the ones of earlier calls and the new ones);
        ``final``: no token follows, so a character left incomplete is decoded as it stands."""
        if len(token_ids) < self.read_offset:
            raise ValueError(f"update got {len(token_ids)} tokens, fewer than the {self.read_offset} already read")
        if len(token_ids) == self.read_offset:
            return self.text
        window = list(token_ids[self.prefix_offset:])
        context = self._decode(window[: self.read_offset - self.prefix_offset])
        longer = self._decode(window)
        if longer.endswith(_INCOMPLETE) and not final:
            return self.text
        if not longer.startswith(context):
            self.text = self._decode(token_ids)
        elif len(longer) > len(context):
            self.text += longer[len(context):]
            self.prefix_offset = self.read_offset  # the new tokens' text exists: the next window starts here
        self.read_offset = len(token_ids)
        return self.text
