"""How many KV pages an engine gets: its memory budget, in pages (:func:`plan_cache`)."""

from __future__ import annotations

import math

import torch

from questkv.engine.engine_config import CacheSpec, EngineConfig
from questkv.models.llama import ModelSpec

__all__ = ["plan_cache"]

# Memory kept free for activations beside the KV cache on CUDA (weights are already loaded).
_ACTIVATION_RESERVE_BYTES = 2 << 30
_CPU_KV_CACHE_BYTES = 1 << 30


def plan_cache(config: EngineConfig, spec: ModelSpec, max_model_len: int, device: torch.device,
               weight_bytes: int = 0, reserved_bytes: int = 0, model_dtype_layers: tuple[int, ...] = ()) -> CacheSpec:
    """How many pages fit the memory budget (see :attr:`EngineConfig.kv_cache_memory`); an fp8 pool's
    ``model_dtype_layers`` take the model dtype's bytes.

    On CUDA without ``kv_cache_memory``, the engine may occupy ``gpu_memory_utilization`` of the GPU's whole
    memory (as vLLM): the KV cache gets that share less the engine's weights (``weight_bytes``, already loaded),
    other buffers it will allocate (``reserved_bytes``: Quest's selection memory), its activations and a reserve, and
    never more than is free now (less the activations and the reserve).

    Raises:
        ValueError: the budget cannot hold one sequence of ``max_model_len`` tokens.
    """
    page_size = config.page_size
    element = torch.empty(0, dtype=config.torch_dtype).element_size()
    kv_element = torch.empty(0, dtype=config.torch_kv_dtype).element_size()
    # K and V of page_size tokens plus the page's min and max key, in the KV dtype, in every layer.
    layer_bytes = (spec.num_layers - len(model_dtype_layers)) * kv_element + len(model_dtype_layers) * element
    page_bytes = layer_bytes * (2 * page_size + 2) * spec.num_kv_heads * spec.head_dim
    budget = config.kv_cache_memory
    where = "kv_cache_memory"
    if budget is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        tokens = config.prefill_tokens_per_step(max_model_len)
        # A prefill step's activations; a chunk (or a prefix hit) reads its context straight from the pages.
        activations = tokens * (6 * spec.hidden_size + 4 * spec.intermediate_size) * element
        share = int(total * config.gpu_memory_utilization) - weight_bytes - reserved_bytes
        budget = min(share, free) - activations - _ACTIVATION_RESERVE_BYTES
        where = (f"gpu_memory_utilization={config.gpu_memory_utilization} of {total / 2**30:.1f} GiB less "
                 f"{(weight_bytes + reserved_bytes) / 2**30:.2f} GiB of weights and buffers, "
                 f"{free / 2**30:.1f} GiB free")
    elif budget is None:
        budget = _CPU_KV_CACHE_BYTES
        where = "the CPU default of 1 GiB"
    max_pages_per_seq = math.ceil(max_model_len / page_size)
    num_pages = budget // page_bytes
    if num_pages < max_pages_per_seq + 1:  # one full-length sequence and the scratch page
        raise ValueError(
            f"the KV cache budget of {budget / 2**30:.2f} GiB ({where}) holds {max(num_pages, 0)} pages of "
            f"{page_size} tokens ({page_bytes} bytes each), fewer than one sequence of max_model_len={max_model_len} "
            f"tokens needs ({max_pages_per_seq + 1} with the scratch page); raise kv_cache_memory / "
            f"gpu_memory_utilization, free GPU memory or lower max_model_len"
        )
    return CacheSpec(num_pages=int(num_pages), max_pages_per_seq=max_pages_per_seq, max_model_len=max_model_len,
                     page_size=page_size, page_bytes=page_bytes, weight_bytes=weight_bytes,
                     kv_dtype="fp8_e4m3" if config.kv_cache_dtype != "auto" else config.dtype,
                     model_dtype_layers=tuple(model_dtype_layers))
