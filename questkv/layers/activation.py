"""The gated activation of the Llama-family MLP, on the fused gate/up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SiluAndMul"]


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where ``x = cat(gate, up)`` along the last dimension (``MergedLinear`` order)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, 2 * intermediate_size]`` → ``[T, intermediate_size]``, same dtype."""
        gate, up = x.chunk(2, dim=-1)  # [T, I] each
        return F.silu(gate) * up
