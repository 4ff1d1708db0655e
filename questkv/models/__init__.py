"""Models for questkv: loading HF causal LMs (folders, GGUF files, offline aliases) for the drop-in, and the
engine's own Llama-family modules, weights and dummy shapes."""

from questkv.models.loader import ALIASES, DEFAULT_MODEL, ModelAlias, cache_dir, load_model, resolve_model_path

__all__ = ["ALIASES", "DEFAULT_MODEL", "ModelAlias", "cache_dir", "load_model", "resolve_model_path"]
