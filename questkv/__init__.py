"""questkv: query-aware KV-cache page sparsity (Quest) for long-context decoding."""

from questkv.cache import CacheFullError, PagedKVCache
from questkv.config import QuestConfig
from questkv.ops.decode import quest_decode

__version__ = "0.1.0"

__all__ = ["CacheFullError", "PagedKVCache", "QuestConfig", "quest_decode", "__version__"]
