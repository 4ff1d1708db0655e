"""questkv: query-aware KV-cache page sparsity (Quest) for long-context decoding."""

from questkv.cache import CacheFullError, PagedKVCache
from questkv.config import QuestConfig
from questkv.decode import quest_decode

__version__ = "0.1.0"

__all__ = [
    "CacheFullError",
    "LLM",
    "PagedKVCache",
    "QuestCache",
    "QuestConfig",
    "SamplingParams",
    "disable",
    "enable",
    "load_model",
    "quest_decode",
    "__version__",
]

# These need transformers, which takes seconds to import: loaded on first use.
_LAZY = {
    "enable": "questkv.integrations.hf",
    "disable": "questkv.integrations.hf",
    "QuestCache": "questkv.integrations.hf",
    "load_model": "questkv.models",
    "LLM": "questkv.engine.llm",
    "SamplingParams": "questkv.engine.sampling_params",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'questkv' has no attribute {name!r}")
