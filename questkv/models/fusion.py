"""Elementwise fusion of a model's decode step: RMSNorm and SiLU-and-multiply as ``torch.compile``d kernels (RoPE
is folded into the attention layer's K/V append, :func:`questkv.ops.rope_append_kv`).

A model concern (which functions a layer calls); the engine decides when to apply it (with CUDA graphs).
"""

from __future__ import annotations

import types

import torch

from questkv.layers.activation import SiluAndMul, silu_and_mul
from questkv.layers.norm import RMSNorm, rms_norm
from questkv.models.llama import LlamaForCausalLM

__all__ = ["fuse_elementwise"]


def fuse_elementwise(model: LlamaForCausalLM) -> None:
    """Swap the model's RMSNorm and SiLU-and-multiply functions for ``torch.compile``d ones (one compiled
    function each, shared by every layer, dynamic in the token count): each becomes one fused kernel instead
    of several small ones, which is most of a decode step's launch count."""
    norm, act = _compiled(rms_norm), _compiled(silu_and_mul)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = norm
        elif isinstance(module, SiluAndMul):
            module.kernel = act


def _compiled(function):
    """``function`` compiled for one model. It compiles a copy with a code object of its own: torch.compile
    keys its cache and its recompile limit on the code object, so models of other families built in the same
    process (other ranks, dtypes, head counts) never add up to the limit (fullgraph raises when it is hit)."""
    copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    # emulate_precision_casts: round where the eager code rounds (e.g. to bf16 before the norm's weight),
    # so the fused kernels give the eager (and transformers') numbers; without it the engine's bf16
    # logits drifted 6 % from HF's on the 8B shape (benchmarks/e2e.py's check).
    return torch.compile(copy, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})
