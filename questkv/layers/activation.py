"""The gated activation of the Llama-family MLP, on the fused gate/up projection's output."""

from __future__ import annotations

import torch
from torch import nn

from questkv.ops.reference import silu_and_mul

__all__ = ["SiluAndMul", "silu_and_mul"]


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where ``x = cat(gate, up)`` along the last dimension (``MergedLinear`` order)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = silu_and_mul  # the runner may swap in a compiled (fused) silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, 2 * intermediate_size]`` → ``[T, intermediate_size]``, same dtype."""
        return self.kernel(x)
