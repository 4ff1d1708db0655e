"""An RMSNorm and the linear layer it feeds, as one op where a kernel takes both.

A decoder layer adds its residual stream and normalises it before the QKV and gate/up projections. On CUDA an int4
:class:`~questkv.layers.quantized_linear.QuantizedLinear` that multiplies one row (a decode step at batch 1) with
questkv's GEMV folds the norm into that GEMV: one launch where there were two. Everywhere else the norm runs, then
the linear. Which layers sit where is the model's business.
"""

from __future__ import annotations

import torch
from torch import nn

from questkv.layers.norm import RMSNorm
from questkv.layers.quantized_linear import QuantizedLinear

__all__ = ["rms_norm_linear"]


def rms_norm_linear(norm: RMSNorm, linear: nn.Module, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(norm(x + residual)), x + residual)``, for ``x`` and ``residual`` ``[T, hidden]`` of one dtype.

    Folded into one launch where the norm takes its kernels (``backend="auto"``, the engine's fused elementwise ops)
    and ``linear`` is a :class:`~questkv.layers.quantized_linear.QuantizedLinear` whose
    :meth:`~questkv.layers.quantized_linear.QuantizedLinear.takes_rms_norm` says so; that product skips the
    normalised row's two roundings to the dtype (float32 throughout, see
    :func:`questkv.ops.quant_reference.rms_norm_words_matmul`).
    """
    if norm.backend == "auto" and isinstance(linear, QuantizedLinear) and linear.takes_rms_norm(x):
        return linear.rms_norm_forward(x, residual, norm.weight, norm.eps)
    normed, residual = norm(x, residual)
    return linear(normed), residual
