"""Load causal LMs for questkv: HF folders, GGUF files, and offline-installable aliases."""

from questkv.models.loader import ALIASES, DEFAULT_MODEL, ModelAlias, cache_dir, load_model, resolve_model_path

__all__ = ["ALIASES", "DEFAULT_MODEL", "ModelAlias", "cache_dir", "load_model", "resolve_model_path"]
