"""Elementwise fusion of a model's decode step: RMSNorm (with its residual add) and SiLU-and-multiply as one
Triton kernel each on CUDA (:mod:`questkv.ops.triton.elementwise`; RoPE is folded into the attention layer's K/V
append, :func:`questkv.ops.rope_append_kv`).

A model concern (which ops a layer runs on which backend); the engine decides when to apply it (with CUDA graphs).
"""

from __future__ import annotations

from questkv.layers.activation import SiluAndMul
from questkv.layers.norm import RMSNorm
from questkv.models.llama import LlamaForCausalLM

__all__ = ["fuse_elementwise"]


def fuse_elementwise(model: LlamaForCausalLM) -> None:
    """Put the model's RMSNorm and SiLU-and-multiply layers on the ``"auto"`` backend: on CUDA one kernel each
    where eager torch launches several (most of a decode step's launch count), under programmatic dependent
    launch, so that the GEMV after a norm streams its weights while the norm runs; on the CPU the torch ops."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, SiluAndMul)):
            module.backend = "auto"
