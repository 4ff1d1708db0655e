"""The quantized linear ops on CUDA, with :mod:`questkv.ops.quant_reference`'s signatures (:mod:`questkv.ops`
dispatches to them for CUDA tensors): which kernel multiplies how many rows.

* ``int4``, one copy of the codes, :func:`~questkv.ops.quant_reference.pack_int4_k_major`'s words, by rows ``M``
  (:data:`INT4_KERNELS`; all linears of one llama3.1-8b token on an H200, LM head bf16, ms,
  ``benchmarks/results/linear-h200-mma.md``): the GEMV (:func:`~questkv.ops.triton.int4_gemv.int4_gemv`) for one
  row (1.94; torch's tinygemm 2.43), and there, where the 32-output tiles are at most two per SM, the CUDA C++ GEMV
  (:mod:`questkv.ops.cuda.int4_gemv`; µs per call, ``linear-h200-gemv-cuda.md``: llama3.1-8b's qkv / o / down 8.1 /
  5.8 / 13.2 against the Triton GEMV's 8.4 / 7.0 / 15.3, gate_up 22.9 against 22.5); the CUDA C++ tensor-core
  kernel (:mod:`questkv.ops.cuda.int4_mma`) for 2 to 32
  (2.19 / 2.24 / 2.36 / 3.13 at M = 2 / 4 / 8 / 16, against 3.88 / 3.93 / 4.00 / 4.21 for the Triton words kernel
  and 2.54 / 3.30 / 5.27 / 8.58 for tinygemm; at 17 / 24 / 32 rows on an H100, ``linear-h100-mma32.md``, 4.09 /
  4.37 / 4.75 against the words kernel's 5.43 / 5.57 / 5.83 and bf16's 5.40-5.47); the Triton tensor-core kernel over
  the words (:func:`~questkv.ops.triton.int4_words.int4_words_matmul`) up to :data:`TRITON_MAX_M` (7.23 at M = 64);
  above that (prefill) the float weight written from the words for one GEMM, whose cost the prompt's rows share
  (10.73 / 10.88 at M = 128 / 256, against 13.52 / 23.98 for the words kernel).
* ``int8`` and ``int8_grouped`` (imported GGUF ``Q8_0`` / ``Q6_K``): the Triton kernel
  (:func:`~questkv.ops.triton.quant_matmul.quant_matmul`: its FMA loop for one row, its ``tl.dot`` loop from two,
  :data:`~questkv.ops.triton.quant_matmul.FMA_MAX_M`) up to :data:`TRITON_MAX_M` rows and the float weight above
  (``linear-h200-dequant.md``: int8 5.55 against 10.05 ms at M = 64, 18.39 against 11.64 at M = 256).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from questkv.ops.cuda import int4_gemv as cuda_gemv
from questkv.ops.cuda import int4_mma as mma
from questkv.ops.quant_reference import check_int4_words, check_quant_args
from questkv.ops.triton import quant_matmul as loops
from questkv.ops.triton.int4_gemv import GEMV_MAX_M, int4_gemv
from questkv.ops.triton.int4_words import dequantize_k_major, int4_words_matmul

__all__ = ["INT4_KERNELS", "TRITON_MAX_M", "int4_matmul", "prepare_int4_matmul", "quant_matmul"]

TRITON_MAX_M = 64
"""Up to this many rows the kernels read the packed weight; above, the float weight is written for one GEMM."""

INT4_KERNELS: tuple[tuple[int, str], ...] = ((1, "gemv-cuda"), (1, "gemv"), (mma.MMA_MAX_M, "mma"),
                                             (GEMV_MAX_M, "gemv"), (TRITON_MAX_M, "words"))
"""``int4`` by rows of ``x``: ``(most rows, kernel)`` in order of preference; the first that takes ``M`` rows and
runs here multiplies them (``gemv-cuda``: :func:`~questkv.ops.cuda.int4_gemv.int4_gemv_cuda` where it is built,
:func:`~questkv.ops.cuda.int4_gemv.fits` and :func:`~questkv.ops.cuda.int4_gemv.takes` the shape, else the next;
``gemv``: :func:`~questkv.ops.triton.int4_gemv.int4_gemv`; ``mma``:
:func:`~questkv.ops.cuda.int4_mma.int4_mma` where it is built and :func:`~questkv.ops.cuda.int4_mma.fits`, else
the next: the GEMV for 2 rows, ``words``: :func:`~questkv.ops.triton.int4_words.int4_words_matmul` for more);
above the last, the float weight written from the words for one GEMM."""


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
                group_size: int = 128, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`questkv.ops.quant_reference.int4_matmul` on CUDA, by rows of ``x`` ``[M, K]`` (:data:`INT4_KERNELS`).

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    if x.dim() != 2:
        raise ValueError(f"int4_matmul: x must be [M, K], got shape {tuple(x.shape)}")
    n = check_int4_words(x.shape[1], words, scales, zeros, group_size, "int4_matmul")
    m = x.shape[0]
    if m == 0:
        return x.new_empty((0, n))
    for most, kernel in INT4_KERNELS:
        if m > most:
            continue
        if kernel == "gemv":
            return int4_gemv(x, words, scales, zeros, group_size, bias)
        if kernel == "gemv-cuda":
            if (cuda_gemv.fits(x, words, scales, zeros, group_size) and cuda_gemv.takes(words.shape[1], x.device)
                    and mma.available(x.device)):
                return cuda_gemv.int4_gemv_cuda(x, words, scales, zeros, group_size, bias)
            continue
        if kernel == "words":
            return int4_words_matmul(x, words, scales, zeros, group_size, bias)
        if mma.fits(x, words, scales, zeros, group_size) and mma.available(x.device):
            return mma.int4_mma(x, words, scales, zeros, group_size, bias)
    wt = dequantize_k_major(words, scales, zeros, group_size, dtype=x.dtype)  # [K, N]
    return x @ wt if bias is None else torch.addmm(bias, x, wt)


def prepare_int4_matmul(device: torch.device) -> None:
    """Build or load the tensor-core kernel :data:`INT4_KERNELS` names for ``device`` now, outside graph capture
    (a build that fails warns once and leaves its rows to the next kernel)."""
    mma.available(device)
