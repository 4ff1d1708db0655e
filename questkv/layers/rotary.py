"""Rotary position embeddings (RoPE) of the Llama family, numerically identical to transformers'.

Owns the inverse frequencies of the three rope types questkv supports (``default``, ``linear``, ``llama3``),
and a cos/sin table up to the model's maximum position. The model computes the table rows of a step once
(:meth:`RotaryEmbedding.cos_sin`); every attention layer rotates its queries and keys by them as it stores
its keys and values (:func:`questkv.ops.rope_append_kv`; the rotation, in HF Llama's ``rotate_half``
convention, is :func:`questkv.ops.reference.rotate`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import nn

from questkv.validation import check_choice, check_float, check_int

__all__ = ["ROPE_TYPES", "RopeScaling", "RotaryEmbedding", "inverse_frequencies"]

ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How a scaled rope stretches the inverse frequencies (the ``rope_parameters`` of an HF config).

    Attributes:
        rope_type: ``"linear"`` (every frequency divided by ``factor``) or ``"llama3"`` (low frequencies divided
            by ``factor``, high ones kept, a smooth ramp between; Llama 3.1 and later).
        factor: the stretch factor, > 0.
        low_freq_factor, high_freq_factor: ``llama3`` only: the wavelength band, in units of
            ``original_max_position_embeddings``, over which the ramp goes from scaled to unscaled.
        original_max_position_embeddings: ``llama3`` only: the context length of pretraining.
    """

    rope_type: str
    factor: float
    low_freq_factor: Optional[float] = None
    high_freq_factor: Optional[float] = None
    original_max_position_embeddings: Optional[int] = None

    def __post_init__(self) -> None:
        check_choice("RopeScaling.rope_type", self.rope_type, ROPE_TYPES[1:])
        check_float("RopeScaling.factor", self.factor, low=0.0, low_open=True)
        if self.rope_type != "llama3":
            return
        for name in ("low_freq_factor", "high_freq_factor"):
            check_float(f"RopeScaling.{name}", getattr(self, name), low=0.0, low_open=True)
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"RopeScaling.high_freq_factor must be > low_freq_factor={self.low_freq_factor}, "
                f"got {self.high_freq_factor}"
            )
        check_int("RopeScaling.original_max_position_embeddings", self.original_max_position_embeddings, minimum=1)


def inverse_frequencies(head_dim: int, rope_theta: float, scaling: Optional[RopeScaling] = None) -> torch.Tensor:
    """The rope inverse frequencies, computed as transformers computes them (fp32, on the CPU).

    Mirrors ``compute_default_rope_parameters``, ``_compute_linear_scaling_rope_parameters`` and
    ``_compute_llama3_parameters`` of ``transformers.modeling_rope_utils`` operation for operation.

    Returns:
        ``[head_dim // 2]`` float32.
    """
    check_int("RotaryEmbedding.head_dim", head_dim, minimum=2)
    if head_dim % 2:
        raise ValueError(f"RotaryEmbedding.head_dim must be even, got {head_dim}")
    check_float("RotaryEmbedding.rope_theta", rope_theta, low=0.0, low_open=True)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)  # [D/2]
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)


class RotaryEmbedding(nn.Module):
    """A cos/sin table for positions ``0 .. max_position - 1`` (a module so that it moves with the model).

    The table is a non-persistent fp32 buffer of ``max_position x head_dim / 2`` entries each for cos and
    sin (``positions * inv_freq`` in fp32, as transformers computes it); rows are cast to the query dtype when
    read, which is where transformers casts too.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        rope_theta: float,
        scaling: Optional[RopeScaling] = None,
    ) -> None:
        super().__init__()
        check_int("RotaryEmbedding.max_position", max_position, minimum=1)
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq = inverse_frequencies(head_dim, rope_theta, scaling)
        device = torch.empty(0).device  # honours a `with torch.device(...)` around the model's construction
        inv_freq = inv_freq.to(device)
        freqs = torch.arange(max_position, dtype=torch.int64, device=device).float()[:, None] * inv_freq  # [P, D/2]
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)  # [P, D/2] float32
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the table for ``positions`` (``[T]`` int64, each < ``max_position``).

        Returns:
            ``(cos, sin)``, each ``[T, head_dim // 2]`` in ``dtype``.
        """
        return self.cos_cache[positions].to(dtype), self.sin_cache[positions].to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}"
