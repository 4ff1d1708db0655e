"""The quantized linear ops on CUDA, with :mod:`questkv.ops.quant_reference`'s signatures (:mod:`questkv.ops`
dispatches to them for CUDA tensors): which kernel multiplies how many rows.

By rows ``M``, all linears of one llama3.1-8b token on an H200 (LM head bf16; ms):

* ``int4``, one copy of the codes, :func:`~questkv.ops.quant_reference.pack_int4_k_major`'s words: the GEMV
  (:func:`~questkv.ops.triton.int4_gemv.int4_gemv`) for one and two rows (1.94 ms at M = 1 against 2.43 for
  tinygemm; 3.19 at M = 2 against 4.13 on tensor cores: ``benchmarks/results/linear-h200-words-final.md``), tensor
  cores over the words (:func:`~questkv.ops.triton.int4_words.int4_words_matmul`) up to :data:`TRITON_MAX_M` rows
  (3.89 / 3.91 / 4.01 / 4.20 ms at M = 3 / 4 / 8 / 16, ``-words-plan2.md``; 5.73 / 7.18 at M = 32 / 64,
  ``-words-final.md``), and above that (prefill) the float weight written from the words for one GEMM, whose cost
  the prompt's rows share (``-words-dequant.md``: 10.8 / 48.9 ms at M = 256 / 2048). Where the caller holds
  tinygemm's copy (bf16, an engine that batches), 2 to :data:`TINYGEMM_MAX_M` rows take it instead (2.56 / 2.88 /
  3.30 ms at M = 2 / 3 / 4, ``-words-final.md`` and ``-words-plan2.md``; 5.21 at M = 8 against the words' 4.01).
* ``int8`` and ``int8_grouped`` (imported GGUF ``Q8_0`` / ``Q6_K``): the Triton kernel
  (:func:`~questkv.ops.triton.quant_matmul.quant_matmul`) up to :data:`TRITON_MAX_M` rows and the float weight above
  (``linear-h200-dequant.md``: int8 5.55 against 10.05 ms at M = 64, 18.39 against 11.64 at M = 256).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from questkv.ops.quant_reference import check_int4_words, check_quant_args, unpack_int4_k_major
from questkv.ops.triton import quant_matmul as loops
from questkv.ops.triton.int4_gemv import GEMV_MAX_M, int4_gemv
from questkv.ops.triton.int4_words import dequantize_k_major, int4_words_matmul
from questkv.ops.triton.tinygemm import tinygemm_matmul
from questkv.ops.triton.tinygemm import tinygemm_pack as pack_codes_for_tinygemm

__all__ = ["TINYGEMM_MAX_M", "TRITON_MAX_M", "int4_matmul", "quant_matmul", "tinygemm_pack"]

TINYGEMM_MAX_M = 4
"""tinygemm's copy, where there is one, takes 2 to this many rows of ``int4``."""

TRITON_MAX_M = 64
"""Up to this many rows the kernels read the packed weight; above, the float weight is written for one GEMM."""


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                 method: str, group_size: int = 128, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`questkv.ops.quant_reference.quant_matmul` on CUDA for ``int8`` and ``int8_grouped``: the Triton kernel
    up to :data:`TRITON_MAX_M` rows of ``x`` ``[M, K]``, the float weight in ``x``'s dtype and one GEMM above
    (``int4`` is held as words: :func:`int4_matmul`).

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    if x.dim() == 2 and x.shape[0] <= TRITON_MAX_M:
        return loops.quant_matmul(x, qweight, scales, zeros, method, group_size, bias)
    check_quant_args(x, qweight, scales, zeros, method, group_size)
    return F.linear(x, loops.dequantize(qweight, scales, zeros, method, group_size, dtype=x.dtype), bias)


def int4_matmul(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int = 128, bias: Optional[torch.Tensor] = None,
                tinygemm: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """:func:`questkv.ops.quant_reference.int4_matmul` on CUDA, by rows of ``x`` ``[M, K]``: ``tinygemm``'s copy
    (:func:`tinygemm_pack`, if given) for 2 to :data:`TINYGEMM_MAX_M`, the GEMV up to
    :data:`~questkv.ops.triton.int4_gemv.GEMV_MAX_M`, tensor cores up to :data:`TRITON_MAX_M`, the float weight
    written from the words and one GEMM above.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    if x.dim() != 2:
        raise ValueError(f"int4_matmul: x must be [M, K], got shape {tuple(x.shape)}")
    check_int4_words(x.shape[1], words, scales, zeros, group_size, "int4_matmul")
    m = x.shape[0]
    if tinygemm is not None and 1 < m <= TINYGEMM_MAX_M:
        return tinygemm_matmul(x, *tinygemm, group_size, bias)
    if 0 < m <= GEMV_MAX_M:
        return int4_gemv(x, words, scales, zeros, group_size, bias)
    if m <= TRITON_MAX_M:
        return int4_words_matmul(x, words, scales, zeros, group_size, bias)
    wt = dequantize_k_major(words, scales, zeros, group_size, dtype=x.dtype)  # [K, N]
    return x @ wt if bias is None else torch.addmm(bias, x, wt)


def tinygemm_pack(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """tinygemm's copy of an ``int4`` weight held as K-major words ``[K // 8, N]`` int32 (CUDA, bf16 ``scales``
    ``[K // group_size, N]``), for :func:`int4_matmul`: ``(packed, scales_and_zeros)``
    (:func:`questkv.ops.triton.tinygemm.tinygemm_pack`)."""
    if not words.is_cuda or scales.dtype != torch.bfloat16:
        raise ValueError(f"tinygemm_pack needs int4 words on CUDA with bf16 scales, got {words.device.type} and "
                         f"{scales.dtype}")
    return pack_codes_for_tinygemm(unpack_int4_k_major(words, group_size), scales, zeros, group_size)
