"""Paged KV cache with per-page key bounds."""

from questkv.cache.paged import CacheFullError, PagedKVCache

__all__ = ["CacheFullError", "PagedKVCache"]
