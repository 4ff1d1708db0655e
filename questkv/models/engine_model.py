"""Build the engine's own model (the family's class, :mod:`questkv.models.families`: all
:class:`~questkv.models.llama.LlamaForCausalLM` today) from what users name.

A name, HF folder or ``.gguf`` (as :func:`questkv.load_model` takes) gives real weights and the
tokenizer; a ``transformers`` config with ``load_format="dummy"`` gives random weights at its shapes
and no tokenizer (token-id prompts only).

Packed checkpoints load packed: an HF folder whose ``config.json`` has a ``quantization_config`` (AWQ, GPTQ,
compressed-tensors; :mod:`questkv.models.quantized_checkpoints`) always, a GGUF file or alias with
``quantization="gguf"`` (:mod:`questkv.models.gguf_native`; without it transformers dequantizes the GGUF, as the
committed evaluations did). Either way the format is checked before the model is built.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

import torch

from questkv.config import QuestConfig
from questkv.distributed.group import TensorParallel
from questkv.layers.quantized_linear import QuantizedLinear
from questkv.models.families import model_family
from questkv.models.llama import ModelSpec
from questkv.models.loader import load_gguf, resolve_model_path
from questkv.models.quantized_checkpoints import (
    METHODS as CHECKPOINT_METHODS,
    QuantizedCheckpoint,
    checkpoint_quantization,
)
from questkv.models.weights import init_dummy_weights, load_safetensors_weights

if TYPE_CHECKING:
    from questkv.models.llama import LlamaForCausalLM

PACKED_FORMATS = ("gguf",) + CHECKPOINT_METHODS
"""``quantization`` values that name how a checkpoint is stored: its packed weights are loaded as they are."""


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
    quantization: Optional[str] = None,
    tp: Optional[TensorParallel] = None,
) -> EngineModel:
    """Build the model of ``model``'s family (:meth:`~questkv.models.families.ModelFamily.model_class`; see the
    module docstring).

    Args:
        quantization: the engine's: one of :data:`PACKED_FORMATS` asks for (and must match) a packed checkpoint;
            ``None`` or one of :data:`~questkv.engine.engine_config.ROUND_TO_NEAREST` loads float weights, unless the
            folder is packed.
        tp: build rank ``tp.rank``'s tensor-parallel shard (:class:`LlamaForCausalLM`'s ``tp``), or ``None``.

    Raises:
        ValueError: an unsupported architecture or rope type (naming what is supported), an unknown
            model name, a dummy request for a name that is not a config, a ``quantization`` that contradicts
            the checkpoint, or a packed checkpoint of an unsupported format (each before the model is built).
    """
    from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

    folder, state, packed = None, None, None  # weights from a safetensors folder, a GGUF's state dict, or packed
    if isinstance(model, PretrainedConfig):
        if quantization in PACKED_FORMATS:
            raise ValueError(f"EngineConfig.quantization={quantization!r} names a checkpoint format, but the model "
                             "is a config without weights")
        hf_config, tokenizer, name = model, None, getattr(model, "name_or_path", "") or model.model_type
    elif quantization == "gguf":
        from questkv.models.gguf_native import GGUFWeights, gguf_config_and_tokenizer, resolve_gguf

        name = str(model)
        path = resolve_gguf(name)
        hf_config, tokenizer = gguf_config_and_tokenizer(path)
        packed = GGUFWeights(path, hf_config.num_attention_heads,
                             getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)
    else:
        name = str(model)
        path = resolve_model_path(name)
        if path.suffix == ".gguf":
            if quantization in PACKED_FORMATS:
                raise ValueError(f"EngineConfig.quantization={quantization!r} does not match {path.name}, a GGUF file; "
                                 "use quantization='gguf' (packed) or None (dequantized)")
            hf_model, tokenizer = load_gguf(path, dtype)
            hf_config, state = hf_model.config, hf_model.state_dict()
        else:
            folder, hf_config = path, AutoConfig.from_pretrained(path)
            has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
            tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
            packed = _packed_folder(path, quantization)
    spec = ModelSpec.from_hf_config(hf_config)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters born in their dtype, on their device: no copy
    try:
        with torch.device(device):
            engine_model = model_family(spec.model_type).model_class()(spec, quest, tp)
    finally:
        torch.set_default_dtype(default_dtype)
    if load_format == "dummy":
        if packed is not None:
            raise ValueError(f"load_format='dummy' gives random float weights; {name!r} is a packed checkpoint")
        init_dummy_weights(engine_model, seed)
    elif packed is not None:
        names = engine_model.use_packed_linears(packed.layouts)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the swapped float linears' blocks: the KV pool is sized from what is free
        engine_model.load_weights(packed.weights(names, device))
        for module in engine_model.modules():
            if isinstance(module, QuantizedLinear):
                module.set_backend("auto")  # filled now
    elif state is not None:
        engine_model.load_weights(state.items())
    elif folder is not None:
        engine_model.load_weights(load_safetensors_weights(folder, device))
    else:
        raise ValueError(f"model {name!r} is a config without weights: pass load_format='dummy'")
    eos = _eos_ids(hf_config, tokenizer, folder)
    return EngineModel(engine_model.eval(), spec, tokenizer, eos, name)


def _packed_folder(folder, quantization: Optional[str]) -> Optional[QuantizedCheckpoint]:
    """The folder's packed checkpoint, when its ``config.json`` has a ``quantization_config``, after checking that
    ``quantization`` is ``None`` or names the same method."""
    config = checkpoint_quantization(folder)
    method = None if config is None else config.get("quant_method")
    if config is None:
        if quantization in PACKED_FORMATS:
            raise ValueError(f"EngineConfig.quantization={quantization!r} names a checkpoint format, but "
                             f"{str(folder)!r} has no quantization_config in its config.json")
        return None
    if quantization is not None and quantization != method:
        raise ValueError(f"EngineConfig.quantization={quantization!r} does not match the checkpoint's "
                         f"quantization_config.quant_method={method!r}: pass None (detected) or {method!r}")
    return QuantizedCheckpoint(folder, config)


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
