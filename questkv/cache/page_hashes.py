"""The hash chain that names a sequence's full pages for prefix caching (:func:`page_hashes`)."""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

__all__ = ["page_hashes"]


def page_hashes(token_ids: Sequence[int], page_size: int, salt: bytes = b"", parent: bytes = b"",
                start: int = 0) -> list[bytes]:
    """The hash chain of the full pages of ``token_ids`` from page ``start`` on: page ``j``'s hash is a digest of
    (page ``j - 1``'s hash, or ``salt`` for the first page; page ``j``'s token ids), so equal hashes mean equal
    tokens from the start of the sequence (``parent``: the hash of page ``start - 1``, unused for ``start=0``)."""
    full = len(token_ids) // page_size
    if full <= start:
        return []
    # The pages' token ids as little-endian int64, in one conversion: per page only the digest remains.
    data = np.asarray(token_ids[start * page_size:full * page_size], dtype="<i8").tobytes()
    width = 8 * page_size
    hashes = []
    for j in range(start, full):
        digest = hashlib.blake2b(parent if j else salt, digest_size=16)
        offset = (j - start) * width
        digest.update(data[offset:offset + width])
        parent = digest.digest()
        hashes.append(parent)
    return hashes
