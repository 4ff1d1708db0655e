"""The gated activation of the Llama-family MLP, on the fused gate/up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SiluAndMul"]


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where ``x = cat(gate, up)`` along the last dimension (``MergedLinear`` order)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = silu_and_mul  # the runner may swap in a compiled (fused) silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, 2 * intermediate_size]`` → ``[T, intermediate_size]``, same dtype."""
        return self.kernel(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """:meth:`SiluAndMul.forward` as a function."""
    gate, up = x.chunk(2, dim=-1)  # [T, I] each
    return F.silu(gate) * up
