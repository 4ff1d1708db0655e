"""Build the engine's own model (:class:`~questkv.models.llama.LlamaForCausalLM`) from what users name.

A name, HF folder or ``.gguf`` (as :func:`questkv.load_model` takes) gives real weights and the
tokenizer; a ``transformers`` config with ``load_format="dummy"`` gives random weights at its shapes
and no tokenizer (token-id prompts only).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from questkv.config import QuestConfig
from questkv.models.llama import LlamaForCausalLM, ModelSpec
from questkv.models.loader import load_gguf, resolve_model_path
from questkv.models.weights import init_dummy_weights, load_safetensors_weights


@dataclasses.dataclass
class EngineModel:
    """A loaded model with what the engine needs around it.

    Attributes:
        model: on its device, in eval mode, weights in the requested dtype.
        spec: its shape and flags.
        tokenizer: a transformers tokenizer, or ``None`` for dummy weights.
        eos_token_ids: the end-of-sequence ids of the generation config (or the tokenizer's).
        name: what the user passed, for messages and results.
    """

    model: LlamaForCausalLM
    spec: ModelSpec
    tokenizer: Any
    eos_token_ids: frozenset[int]
    name: str


def load_engine_model(
    model: Any,
    quest: Optional[QuestConfig],
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
) -> EngineModel:
    """Build :class:`LlamaForCausalLM` for ``model`` (see the module docstring).

    Raises:
        ValueError: an unsupported architecture or rope type (naming what is supported), an unknown
            model name, or a dummy request for a name that is not a config.
    """
    from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

    folder, state = None, None  # where real weights come from: a safetensors folder or a GGUF's state dict
    if isinstance(model, PretrainedConfig):
        hf_config, tokenizer, name = model, None, getattr(model, "name_or_path", "") or model.model_type
    else:
        name = str(model)
        path = resolve_model_path(name)
        if path.suffix == ".gguf":
            hf_model, tokenizer = load_gguf(path, dtype)
            hf_config, state = hf_model.config, hf_model.state_dict()
        else:
            folder, hf_config = path, AutoConfig.from_pretrained(path)
            has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
            tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
    spec = ModelSpec.from_hf_config(hf_config)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters born in their dtype, on their device: no copy
    try:
        with torch.device(device):
            engine_model = LlamaForCausalLM(spec, quest)
    finally:
        torch.set_default_dtype(default_dtype)
    if load_format == "dummy":
        init_dummy_weights(engine_model, seed)
    elif state is not None:
        engine_model.load_weights(state.items())
    elif folder is not None:
        engine_model.load_weights(load_safetensors_weights(folder, device))
    else:
        raise ValueError(f"model {name!r} is a config without weights: pass load_format='dummy'")
    eos = _eos_ids(hf_config, tokenizer, folder)
    return EngineModel(engine_model.eval(), spec, tokenizer, eos, name)


def _eos_ids(hf_config, tokenizer, folder) -> frozenset[int]:
    """The generation config's end-of-sequence ids (a folder's ``generation_config.json``), else the
    model config's, else the tokenizer's."""
    from transformers import GenerationConfig

    eos = None
    if folder is not None and (folder / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(folder).eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
