"""Weight-only quantized matmul: the storage formats, round-to-nearest quantization and the torch reference.

Device-agnostic and clear: the CPU path of :class:`questkv.layers.quantized_linear.QuantizedLinear` and the
oracle of the CUDA kernels. :func:`quant_matmul` and :func:`int4_matmul` are the references of the ops of the same
names (:mod:`questkv.ops` picks this module or their CUDA twins, :mod:`questkv.ops.triton.quant_ops`, by device);
which module gets quantized is the layer's.

A linear layer's float ``weight`` is ``[N, K]`` (``out_features``, ``in_features``) and ``y = x @ weight.T``.
Formats (``method``):

* ``"int4"``: asymmetric, one scale and one zero point per group of ``group_size`` consecutive input features
  of a row (``K % group_size == 0``, :data:`GROUP_SIZES`; 128 by default).

  - ``qweight``: ``[N, K // 2]`` uint8; byte ``(n, j)`` holds ``q[n, 2j]`` in bits 0-3 and ``q[n, 2j + 1]`` in
    bits 4-7, ``q`` in ``0..15``. Read as little-endian int32 (``qweight.view(torch.int32)``, ``[N, K // 8]``),
    word ``(n, j)`` holds ``q[n, 8j + i]`` in bits ``4i .. 4i + 3``.
  - ``scales``, ``zeros``: ``[K // group_size, N]`` (groups, then output features, as GPTQ stores them), in the
    model's float dtype. A zero point is any float: round to nearest makes integers in ``0..15``, imported
    checkpoints others (GGUF ``Q4_1`` / ``Q4_K`` offsets give fractions, GPTQ's v1 format ``1..16``). Integer zero
    points may also be uint8 (a :class:`~questkv.layers.quantized_linear.QuantizedLinear` holds them so): the
    reference and the kernels read either.
  - ``w[n, k] = (q[n, k] - zeros[k // group_size, n]) * scales[k // group_size, n]``.
  - A layer holds the codes as :func:`pack_int4_k_major`'s int32 words ``[K // 8, N]``, the one copy every
    ``int4`` kernel reads (:func:`int4_matmul`); checkpoints and state dicts hold ``qweight``.

* ``"int8"``: symmetric, one scale per output feature (row).

  - ``qweight``: ``[N, K]`` int8, ``q`` in ``-127..127``; ``scales``: ``[N]`` model dtype; ``zeros``: ``None``.
  - ``w[n, k] = q[n, k] * scales[n]``.

* ``"int8_grouped"``: symmetric, one scale per group of ``group_size`` consecutive input features of a row
  (:data:`INT8_GROUP_SIZES`), for checkpoints stored that way (GGUF ``Q8_0``: groups of 32, ``Q6_K``: 16). Not
  made by :func:`quantize_weight`; the Triton kernel reads it as ``int8`` with a scale per group.

  - ``qweight``: ``[N, K]`` int8, ``q`` in ``-128..127``; ``scales``: ``[K // group_size, N]`` model dtype;
    ``zeros``: ``None``.
  - ``w[n, k] = q[n, k] * scales[k // group_size, n]``.

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
    "ALL_METHODS",
    "GROUP_SIZES",
    "INT8_GROUP_SIZES",
    "METHODS",
    "QuantizedWeight",
    "check_int4_words",
    "check_quant_args",
    "dequantize",
    "dequantize_k_major",
    "int4_matmul",
    "pack_int4",
    "pack_int4_k_major",
    "quant_matmul",
    "quantize_weight",
    "unpack_int4",
    "unpack_int4_k_major",
]

METHODS: tuple[str, ...] = ("int4", "int8")
"""The formats :func:`quantize_weight` makes (see the module docstring)."""

ALL_METHODS: tuple[str, ...] = METHODS + ("int8_grouped",)
"""Every format a :class:`~questkv.layers.quantized_linear.QuantizedLinear` holds and the kernels read:
:data:`METHODS` and those of imported checkpoints."""

GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)
"""``int4`` group sizes (powers of two, whole int32 words)."""

INT8_GROUP_SIZES: tuple[int, ...] = (16, 32, 64, 128, 256)
"""``int8_grouped`` group sizes (GGUF ``Q6_K`` scales groups of 16, ``Q8_0`` groups of 32; powers of two, whole
int32 words, at least the 16 of a ``tl.dot``)."""

DEFAULT_GROUP_SIZE = 128


class QuantizedWeight(NamedTuple):
    """One quantized weight: ``qweight``, ``scales``, ``zeros`` (``None`` for ``int8``), as in the module docstring."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]


def check_method(method: str, group_size: int, in_features: int, owner: str = "QuantizedLinear",
                 methods: tuple[str, ...] = METHODS) -> None:
    """``ValueError`` unless ``method`` is one of ``methods`` and, for a grouped format, ``group_size`` is one of
    its group sizes (:data:`GROUP_SIZES`, :data:`INT8_GROUP_SIZES`) and divides ``in_features``."""
    check_choice("quantization", method, methods)
    if method != "int8":
        check_choice(f"{owner}.group_size", group_size, GROUP_SIZES if method == "int4" else INT8_GROUP_SIZES)
        if in_features % group_size:
            raise ValueError(f"{owner}.in_features must be a multiple of the {method} group size {group_size}, "
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


def pack_int4_k_major(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    """An ``int4`` ``qweight`` ``[N, K // 2]`` as an int4 layer holds it: int32 words ``[K // 8, N]``.

    Input features run down the words (consecutive ``N`` are contiguous: a row of words is one coalesced load for
    many outputs) and, inside each group of ``G = group_size`` features, across a word's nibbles by stride
    ``G // 8``: word ``(g * G // 8 + j, n)`` holds in bits ``4e .. 4e + 3`` the code of feature
    ``g * G + e * G // 8 + j``, so the features of nibble ``e`` over ``j`` are contiguous in ``x``.
    """
    q = unpack_int4(qweight)  # [N, K]
    n, k = q.shape
    per = group_size // 8
    t = q.view(n, k // group_size, 8, per).permute(1, 3, 0, 2)  # [G, per, N, 8]: nibble e of word (g, j, n)
    pairs = (t[..., 0::2] | (t[..., 1::2] << 4)).contiguous()  # [G, per, N, 4] uint8, little-endian bytes
    return pairs.view(torch.int32).view(k // 8, n)


def unpack_int4_k_major(words: torch.Tensor, group_size: int) -> torch.Tensor:
    """The inverse of :func:`pack_int4_k_major`: words ``[K // 8, N]`` int32 → ``qweight`` ``[N, K // 2]`` uint8."""
    return pack_int4(_k_major_codes(words, group_size))


def _k_major_codes(words: torch.Tensor, group_size: int) -> torch.Tensor:
    """The codes ``q`` ``[N, K]`` uint8 in ``0..15`` of :func:`pack_int4_k_major`'s words ``[K // 8, N]`` int32."""
    kw, n = words.shape
    per = group_size // 8
    pairs = words.contiguous().view(torch.uint8).view(kw // per, per, n, 4)  # [G, per, N, 4]
    t = torch.stack((pairs & 15, pairs >> 4), dim=-1).view(kw // per, per, n, 8)  # [G, per, N, 8]
    return t.permute(2, 0, 3, 1).reshape(n, kw * 8)  # [N, G, 8, per] -> [N, K]


@torch.no_grad()
def quantize_weight(weight: torch.Tensor, method: str, group_size: int = DEFAULT_GROUP_SIZE,
                    dtype: Optional[torch.dtype] = None, row_absmax: Optional[torch.Tensor] = None) -> QuantizedWeight:
    """Round-to-nearest quantization of a float ``weight`` ``[N, K]``.

    Args:
        weight: ``[N, K]`` any float dtype (quantized from its float32 values).
        method: one of :data:`METHODS`. group_size: ``int4`` group (ignored by ``int8``).
        dtype: dtype of ``scales`` / ``zeros`` (default ``weight.dtype``).
        row_absmax: ``int8`` only: ``[N]`` float32, each row's largest magnitude when ``weight`` holds part of
            longer rows (a tensor-parallel shard of input features): the scales are then the whole rows'.
            ``None``: ``weight``'s own.

    Returns:
        A :class:`QuantizedWeight` on ``weight``'s device.
    """
    n, k = weight.shape
    check_method(method, group_size, k, owner="quantize_weight")
    dtype = dtype or weight.dtype
    w = weight.float()
    if method == "int8":
        absmax = w.abs().amax(dim=1) if row_absmax is None else row_absmax.float()  # [N]
        scale = (absmax / 127).to(dtype).float()  # [N], as stored
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
    """Check ``x`` ``[M, K]`` against a quantized weight (shapes, dtypes) whose format is one of
    :data:`ALL_METHODS`; returns ``(N, K)``."""
    check_choice("quantization", method, ALL_METHODS)
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
            raise ValueError(f"quant_matmul zeros must be None for {method} (symmetric)")
        if method == "int8_grouped":
            check_method(method, group_size, k, owner="quant_matmul", methods=ALL_METHODS)
        scale_shape = (n,) if method == "int8" else (k // group_size, n)
        want = {"qweight": ((n, k), torch.int8), "scales": (scale_shape, None)}
        got = {"qweight": qweight, "scales": scales}
    for name, (shape, dtype) in want.items():
        tensor = got[name]
        if tensor is None or tuple(tensor.shape) != shape:
            raise ValueError(f"quant_matmul {name} must have shape {shape} for x {tuple(x.shape)} and {method}, "
                             f"got {None if tensor is None else tuple(tensor.shape)}")
        if dtype is not None and tensor.dtype != dtype:
            raise ValueError(f"quant_matmul {name} must be {dtype}, got {tensor.dtype}")
    return n, k


def check_int4_words(k: int, words: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                     group_size: int, owner: str) -> int:
    """Check an ``int4`` weight of ``k`` input features held as :func:`pack_int4_k_major`'s words (``words``
    ``[K // 8, N]`` int32, ``scales`` and ``zeros`` ``[K // group_size, N]``); returns its ``N``. ``ValueError``
    naming ``owner`` otherwise."""
    if group_size not in GROUP_SIZES or k % group_size:
        raise ValueError(f"{owner}: group_size must be one of {GROUP_SIZES} dividing K={k}, got {group_size}")
    n = words.shape[-1]
    if words.dim() != 2 or tuple(words.shape) != (k // 8, n) or words.dtype != torch.int32:
        raise ValueError(f"{owner}: words must be int32 [K // 8, N] = [{k // 8}, N], got {words.dtype} "
                         f"{tuple(words.shape)}")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is None or tuple(t.shape) != (k // group_size, n):
            raise ValueError(f"{owner}: {name} must be [{k // group_size}, {n}], got "
                             f"{None if t is None else tuple(t.shape)}")
    return n


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], method: str,
               group_size: int = DEFAULT_GROUP_SIZE, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``[N, K]`` in ``dtype`` that a quantized weight (any of :data:`ALL_METHODS`) stands for
    (computed in float32)."""
    check_choice("quantization", method, ALL_METHODS)
    if method == "int8":
        w = qweight.float() * scales.float()[:, None]
        return w.to(dtype)
    if method == "int8_grouped":
        n, k = qweight.shape
        # an int8 times a scale of <= 16 bits is exact in float32: computed in a 16-bit dtype that holds the scales,
        # it rounds once, to the same value, with no float32 copy of the weight (the dequant backend's cost)
        work = dtype if dtype in (torch.float16, torch.bfloat16) and scales.dtype == dtype else torch.float32
        w = qweight.to(work).view(n, k // group_size, group_size) * scales.to(work).t()[:, :, None]  # [N, G, g]
        return w.view(n, k).to(dtype)
    return _dequantize_codes(unpack_int4(qweight), scales, zeros, group_size, dtype)


def _dequantize_codes(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """``int4`` codes ``q`` ``[N, K]`` (``0..15``) → the float weight ``[N, K]`` in ``dtype`` (float32 math)."""
    n, k = q.shape
    s = scales.float().t()[:, :, None]  # [N, G, 1]
    z = zeros.float().t()[:, :, None]
    w = (q.float().reshape(n, k // group_size, group_size) - z) * s  # [N, G, g]
    return w.reshape(n, k).to(dtype)


def dequantize_k_major(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       group_size: int = DEFAULT_GROUP_SIZE, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight, transposed, that an ``int4`` weight held as :func:`pack_int4_k_major`'s words ``[K // 8,
    N]`` int32 stands for: ``[K, N]`` contiguous in ``dtype`` (``x @`` it is ``x @ w.T``; computed in float32)."""
    return _dequantize_codes(_k_major_codes(words, group_size), scales, zeros, group_size, dtype).t().contiguous()


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                 method: str, group_size: int = DEFAULT_GROUP_SIZE,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y = x @ w.T + bias`` for the quantized weight ``w``: dequantized to float32, float32 matmul.

    Args:
        x: ``[M, K]`` float. qweight, scales, zeros, method, group_size: the weight (module docstring, any of
            :data:`ALL_METHODS`). bias: ``[N]`` or ``None``.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    check_quant_args(x, qweight, scales, zeros, method, group_size)
    w = dequantize(qweight, scales, zeros, method, group_size)  # [N, K] float32
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def int4_matmul(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int = DEFAULT_GROUP_SIZE, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y = x @ w.T + bias`` for an ``int4`` weight held as :func:`pack_int4_k_major`'s words: dequantized to
    float32, float32 matmul.

    Args:
        x: ``[M, K]`` float. words: ``[K // 8, N]`` int32. scales, zeros: ``[K // group_size, N]`` (zero points
            in the scales' dtype or uint8). bias: ``[N]`` or ``None``.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    if x.dim() != 2:
        raise ValueError(f"int4_matmul: x must be [M, K], got shape {tuple(x.shape)}")
    check_int4_words(x.shape[1], words, scales, zeros, group_size, "int4_matmul")
    y = x.float() @ dequantize_k_major(words, scales, zeros, group_size)  # [M, N] float32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
