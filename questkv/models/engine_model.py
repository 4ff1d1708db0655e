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
from questkv.models.loader import _load_gguf, resolve_model_path
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
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        hf_config, tokenizer, name = model, None, getattr(model, "name_or_path", "") or model.model_type
        state = None
    else:
        name = str(model)
        path = resolve_model_path(name)
        if path.suffix == ".gguf":
            hf_model, tokenizer = _load_gguf(path, dtype)
            hf_config, state = hf_model.config, hf_model.state_dict()
        else:
            hf_config = AutoConfig.from_pretrained(path)
            tokenizer = AutoTokenizer.from_pretrained(path)
            state = path
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
    elif isinstance(state, dict):
        engine_model.load_weights(state.items())
    else:
        engine_model.load_weights(load_safetensors_weights(state, device))
    eos = _eos_ids(hf_config, tokenizer, None if isinstance(model, PretrainedConfig) else state, GenerationConfig)
    return EngineModel(engine_model.eval(), spec, tokenizer, eos, name)


def _eos_ids(hf_config, tokenizer, path, generation_config_cls) -> frozenset[int]:
    eos = None
    if path is not None and not isinstance(path, dict):
        try:
            eos = generation_config_cls.from_pretrained(path).eos_token_id
        except OSError:
            eos = None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
