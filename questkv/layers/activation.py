"""The gated activation of the Llama-family MLP, on the fused gate/up projection's output."""

from __future__ import annotations

import torch
from torch import nn

from questkv import ops

__all__ = ["SiluAndMul"]


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where ``x = cat(gate, up)`` along the last dimension (``MergedLinear`` order), through
    :func:`questkv.ops.silu_and_mul` on ``backend`` (``"torch"`` unless the runner fuses the model's elementwise
    ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.backend = "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, 2 * intermediate_size]`` → ``[T, intermediate_size]``, same dtype."""
        return ops.silu_and_mul(x, backend=self.backend)
