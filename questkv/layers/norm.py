"""RMSNorm as the Llama family computes it, with an optional fused residual add.

Owns the normalisation only; where it sits in a decoder layer is ``questkv.models.llama``'s business.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from questkv import ops
from questkv.validation import check_float, check_int

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, normalised in fp32 like transformers'
    ``LlamaRMSNorm``: the input is upcast, normalised, cast back to its dtype, then scaled by ``weight``
    (:func:`questkv.ops.rms_norm` on ``backend``: ``"torch"``, eager torch, unless the runner fuses the model's
    elementwise ops, ``"auto"``: on CUDA one Triton kernel).

    Args:
        hidden_size: size of the last dimension (``hidden_size``, or ``head_dim`` for Qwen3's q/k norms).
        eps: added to the mean square.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        check_int("RMSNorm.hidden_size", hidden_size, minimum=1)
        self.eps = check_float("RMSNorm.eps", eps, low=0.0, low_open=True)
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.backend = "torch"

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Normalise ``x`` ``[..., hidden_size]``.

        With ``residual`` (same shape and dtype), first ``x = x + residual`` in the input dtype, as a decoder
        layer adds its residual stream, and return ``(normed, x)``: the new residual stream comes back with
        its normalised copy. Without it, return ``normed`` alone. ``normed`` has the shape and dtype of ``x``.
        """
        return ops.rms_norm(x, self.weight, self.eps, residual, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
