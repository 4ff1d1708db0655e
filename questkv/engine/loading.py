"""One rank's model as the engine's configuration asks: what rank 0 (:class:`~questkv.engine.llm_engine.LLMEngine`)
and every tensor-parallel worker (:func:`~questkv.engine.tp_workers.worker_main`) build alike.

:func:`load_shard` loads the model (rank ``tp.rank``'s shard with tensor parallelism), :func:`quantize_shard` then
rounds its linears when ``EngineConfig.quantization`` rounds to nearest at load. Checkpoint formats and the model
itself are :mod:`questkv.models`' and the rounding :mod:`questkv.layers.quantized_linear`'s; the processes are the
engine's.
"""

from __future__ import annotations

from typing import Optional

import torch

from questkv.distributed.group import TensorParallel
from questkv.engine.engine_config import ROUND_TO_NEAREST, EngineConfig
from questkv.layers.parallel import row_absmax
from questkv.layers.quantized_linear import quantize_linears
from questkv.models.engine_model import EngineModel, load_engine_model
from questkv.models.llama import LlamaForCausalLM

__all__ = ["load_shard", "quantize_shard", "skipped_linears"]


def load_shard(config: EngineConfig, tp: Optional[TensorParallel]) -> EngineModel:
    """The engine's model as ``config`` asks (rank ``tp.rank``'s shard with tensor parallelism), before
    :func:`quantize_shard`."""
    return load_engine_model(
        config.model, config.quest, config.torch_dtype, config.torch_device, config.load_format, config.seed,
        config.quantization, tp,
    )


def skipped_linears(config: EngineConfig) -> tuple[str, ...]:
    """The linears left in float when the engine rounds at load: the LM head unless ``quantize_lm_head``."""
    return () if config.quantize_lm_head else ("lm_head",)


def quantize_shard(model: LlamaForCausalLM, config: EngineConfig, tp: Optional[TensorParallel]) -> None:
    """Quantize ``model``'s linears when ``config.quantization`` rounds to nearest (packed formats were loaded
    packed). With tensor parallelism ``tp`` must be connected: int8 row scales of row-parallel layers are the
    whole rows' (one all-reduce per layer, :func:`~questkv.layers.parallel.row_absmax`)."""
    if config.quantization not in ROUND_TO_NEAREST:
        return
    quantize_linears(model, config.quantization, skip=skipped_linears(config),
                     row_absmax=None if tp is None else row_absmax(tp))
    if config.torch_device.type == "cuda":
        torch.cuda.empty_cache()  # the float weights' blocks: the KV pool is sized from what is free
