"""Weight-only quantized matmul: the storage formats, round-to-nearest quantization and the torch reference.

Device-agnostic and clear: the CPU path of :class:`questkv.layers.quantized_linear.QuantizedLinear` and the
oracle of the Triton kernels (:mod:`questkv.ops.triton.quant_matmul`, same signature). Picking a backend is
:func:`questkv.layers.quantized_linear.quant_matmul`'s business; which module gets quantized is the layer's.

A linear layer's float ``weight`` is ``[N, K]`` (``out_features``, ``in_features``) and ``y = x @ weight.T``.
Formats (``method``):

* ``"int4"``: asymmetric, one scale and one zero point per group of ``group_size`` consecutive input features
  of a row (``K % group_size == 0``, :data:`GROUP_SIZES`; 128 by default).

  - ``qweight``: ``[N, K // 2]`` uint8; byte ``(n, j)`` holds ``q[n, 2j]`` in bits 0-3 and ``q[n, 2j + 1]`` in
    bits 4-7, ``q`` in ``0..15``. Read as little-endian int32 (``qweight.view(torch.int32)``, ``[N, K // 8]``),
    word ``(n, j)`` holds ``q[n, 8j + i]`` in bits ``4i .. 4i + 3``: the kernels load words.
  - ``scales``, ``zeros``: ``[K // group_size, N]`` (groups, then output features, as GPTQ stores them), in the
    model's float dtype; a zero point is an integer in ``0..15`` stored as a float.
  - ``w[n, k] = (q[n, k] - zeros[k // group_size, n]) * scales[k // group_size, n]``.

* ``"int8"``: symmetric, one scale per output feature (row).

  - ``qweight``: ``[N, K]`` int8, ``q`` in ``-127..127``; ``scales``: ``[N]`` model dtype; ``zeros``: ``None``.
  - ``w[n, k] = q[n, k] * scales[n]``.

Rounding: ``int4`` takes each group's min and max (widened to include 0), ``scale = (max - min) / 15`` rounded to
the stored dtype, ``zero = round(-min / scale)``, ``q = clamp(round(w / scale) + zero, 0, 15)``; ``int8`` takes
``scale = max|w| / 127`` rounded to the stored dtype and ``q = clamp(round(w / scale), -127, 127)``. A group
(row) of zeros gets scale 1 and dequantizes to zeros exactly.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from questkv.validation import check_choice

__all__ = [
    "GROUP_SIZES",
    "METHODS",
    "QuantizedWeight",
    "check_quant_args",
    "dequantize",
    "pack_int4",
    "quant_matmul",
    "quantize_weight",
    "unpack_int4",
]

METHODS: tuple[str, ...] = ("int4", "int8")
"""Weight formats (see the module docstring)."""

GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)
"""``int4`` group sizes the kernels support (powers of two, whole int32 words)."""

DEFAULT_GROUP_SIZE = 128


class QuantizedWeight(NamedTuple):
    """One quantized weight: ``qweight``, ``scales``, ``zeros`` (``None`` for ``int8``), as in the module docstring."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]


def check_method(method: str, group_size: int, in_features: int, owner: str = "QuantizedLinear") -> None:
    """``ValueError`` unless ``method`` is one of :data:`METHODS` and, for ``int4``, ``group_size`` is one of
    :data:`GROUP_SIZES` and divides ``in_features`` (for ``int8``, ``in_features`` must be even)."""
    check_choice("quantization", method, METHODS)
    if method == "int4":
        check_choice(f"{owner}.group_size", group_size, GROUP_SIZES)
        if in_features % group_size:
            raise ValueError(f"{owner}.in_features must be a multiple of the int4 group size {group_size}, "
                             f"got {in_features}")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``q`` ``[N, K]`` integers in ``0..15`` (any integer dtype, ``K`` even) → ``[N, K // 2]`` uint8, element
    ``2j`` in the low nibble of byte ``j`` and ``2j + 1`` in its high nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)  # [N, K // 2]


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """``qweight`` ``[N, K // 2]`` uint8 → ``[N, K]`` uint8 in ``0..15`` (the inverse of :func:`pack_int4`)."""
    n = qweight.shape[0]
    return torch.stack((qweight & 15, qweight >> 4), dim=-1).reshape(n, -1)  # [N, K // 2, 2] -> [N, K]


@torch.no_grad()
def quantize_weight(weight: torch.Tensor, method: str, group_size: int = DEFAULT_GROUP_SIZE,
                    dtype: Optional[torch.dtype] = None) -> QuantizedWeight:
    """Round-to-nearest quantization of a float ``weight`` ``[N, K]``.

    Args:
        weight: ``[N, K]`` any float dtype (quantized from its float32 values).
        method: one of :data:`METHODS`. group_size: ``int4`` group (ignored by ``int8``).
        dtype: dtype of ``scales`` / ``zeros`` (default ``weight.dtype``).

    Returns:
        A :class:`QuantizedWeight` on ``weight``'s device.
    """
    n, k = weight.shape
    check_method(method, group_size, k, owner="quantize_weight")
    dtype = dtype or weight.dtype
    w = weight.float()
    if method == "int8":
        scale = (w.abs().amax(dim=1) / 127).to(dtype).float()  # [N], as stored
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
        return QuantizedWeight(q.contiguous(), scale.to(dtype), None)
    groups = w.reshape(n, k // group_size, group_size)  # [N, G, g]
    lo = groups.amin(dim=2).clamp(max=0)
    hi = groups.amax(dim=2).clamp(min=0)
    scale = ((hi - lo) / 15).to(dtype).float()  # [N, G], as stored
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.clamp(torch.round(-lo / scale), 0, 15)  # [N, G]
    q = torch.clamp(torch.round(groups / scale[:, :, None]) + zero[:, :, None], 0, 15)  # [N, G, g]
    qweight = pack_int4(q.reshape(n, k))
    return QuantizedWeight(qweight.contiguous(), scale.t().contiguous().to(dtype), zero.t().contiguous().to(dtype))


def check_quant_args(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                     method: str, group_size: int) -> tuple[int, int]:
    """Check ``x`` ``[M, K]`` against a quantized weight (shapes, dtypes); returns ``(N, K)``."""
    check_choice("quantization", method, METHODS)
    if x.dim() != 2:
        raise ValueError(f"quant_matmul x must be [M, K], got shape {tuple(x.shape)}")
    k = x.shape[1]
    n = qweight.shape[0]
    if method == "int4":
        check_method(method, group_size, k, owner="quant_matmul")
        want = {"qweight": ((n, k // 2), torch.uint8), "scales": ((k // group_size, n), None),
                "zeros": ((k // group_size, n), None)}
        got = {"qweight": qweight, "scales": scales, "zeros": zeros}
    else:
        if zeros is not None:
            raise ValueError("quant_matmul zeros must be None for int8 (symmetric)")
        want = {"qweight": ((n, k), torch.int8), "scales": ((n,), None)}
        got = {"qweight": qweight, "scales": scales}
    for name, (shape, dtype) in want.items():
        tensor = got[name]
        if tensor is None or tuple(tensor.shape) != shape:
            raise ValueError(f"quant_matmul {name} must have shape {shape} for x {tuple(x.shape)} and {method}, "
                             f"got {None if tensor is None else tuple(tensor.shape)}")
        if dtype is not None and tensor.dtype != dtype:
            raise ValueError(f"quant_matmul {name} must be {dtype}, got {tensor.dtype}")
    return n, k


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], method: str,
               group_size: int = DEFAULT_GROUP_SIZE, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``[N, K]`` in ``dtype`` that a quantized weight stands for (computed in float32)."""
    check_choice("quantization", method, METHODS)
    if method == "int8":
        w = qweight.float() * scales.float()[:, None]
        return w.to(dtype)
    q = unpack_int4(qweight).float()  # [N, K]
    n, k = q.shape
    s = scales.float().t()[:, :, None]  # [N, G, 1]
    z = zeros.float().t()[:, :, None]
    w = (q.reshape(n, k // group_size, group_size) - z) * s  # [N, G, g]
    return w.reshape(n, k).to(dtype)


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                 method: str, group_size: int = DEFAULT_GROUP_SIZE,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y = x @ w.T + bias`` for the quantized weight ``w``: dequantized to float32, float32 matmul.

    Args:
        x: ``[M, K]`` float. qweight, scales, zeros, method, group_size: the weight (module docstring).
        bias: ``[N]`` or ``None``.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    check_quant_args(x, qweight, scales, zeros, method, group_size)
    w = dequantize(qweight, scales, zeros, method, group_size)  # [N, K] float32
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
