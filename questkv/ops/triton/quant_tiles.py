"""Pieces the quantized-matmul kernels share: a tiled program's ids and masks, the end of a tiled launch (its
split-K partials summed by the last program to arrive), and the loads of K-major int4 words and of their groups'
scales and zero points.

The kernels themselves: :mod:`questkv.ops.triton.quant_matmul` (``int8``, ``int8_grouped``),
:mod:`questkv.ops.triton.int4_gemv` and :mod:`questkv.ops.triton.int4_words` (``int4`` as
:func:`~questkv.ops.quant_reference.pack_int4_k_major`'s words).
"""

from __future__ import annotations

import triton
import triton.language as tl

from questkv.ops.triton._common import last_to_arrive, reset_ticket

__all__ = ["PROGRAMS_PER_SM", "group_scale_zero", "program_tile", "store_tile", "word_tile"]

PROGRAMS_PER_SM = 4
"""Split-K of the tiled kernels aims at this many programs per SM."""


@triton.jit
def program_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tiled launch's program on grid ``(output tiles, splits, row tiles)``: its program ids ``(n, split, m)``, its
    outputs ``rn`` and rows ``rm`` with their in-range masks."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return pid_n, pid_s, pid_m, rn, rn < N, rm, rm < M


@triton.jit
def store_tile(acc, rm, rn, mmask, nmask, M, N, stride_om, part_ptr, counter_ptr, bias_ptr, out_ptr, pid_s, pid_m,
               pid_n, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The end of a tiled launch: a float32 ``acc`` ``[BM, BN]`` (rows ``rm``, outputs ``rn``) plus the bias, stored in
    ``out_ptr``'s dtype. With ``SPLIT_K`` it is one split's partial: stored to ``part_ptr`` (``[split, M, N]``), and the
    last split of the tile to arrive (a ticket per tile) sums the partials in split order, stores and resets it."""
    omask = mmask[:, None] & nmask[None, :]
    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    if SPLIT_K:
        part_off = rm[:, None] * N + rn[None, :]  # [BM, BN] inside one split's [M, N]
        tl.store(part_ptr + pid_s * M * N + part_off, acc, mask=omask)
        num_splits = tl.num_programs(1)
        counter = counter_ptr + pid_m * tl.num_programs(0) + pid_n
        if last_to_arrive(counter, num_splits):
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for sp in range(0, num_splits):
                total += tl.load(part_ptr + sp * M * N + part_off, mask=omask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=omask)
            reset_ticket(counter)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def word_tile(w_ptrs, nmask, valid, EVEN_N: tl.constexpr):
    """A ``[rows, BLOCK_N]`` tile of K-major words (zeros where not ``valid``, or past ``N`` unless ``EVEN_N``)."""
    if EVEN_N:
        return tl.load(w_ptrs, mask=valid, other=0)
    return tl.load(w_ptrs, mask=valid & nmask[None, :], other=0)


@triton.jit
def group_scale_zero(s_ptr, z_ptr, g, N, rn, nmask, EVEN_N: tl.constexpr):
    """Group ``g``'s scales and zero points of outputs ``rn`` (``[BLOCK_N]``) in float32, from ``[K // GROUP, N]``
    (zero points in any dtype: bytes or the scales')."""
    if EVEN_N:
        return tl.load(s_ptr + g * N + rn).to(tl.float32), tl.load(z_ptr + g * N + rn).to(tl.float32)
    return (tl.load(s_ptr + g * N + rn, mask=nmask, other=0.0).to(tl.float32),
            tl.load(z_ptr + g * N + rn, mask=nmask, other=0.0).to(tl.float32))
