"""Paged KV cache with per-page key bounds."""

from questkv.cache.paged import CacheFullError, LayerPages, PagedKVCache

__all__ = ["CacheFullError", "LayerPages", "PagedKVCache"]
