"""``int4`` decode rows on CUDA: the GEMV over K-major words for one and two rows of ``x``.

The weight is :func:`~questkv.ops.quant_reference.pack_int4_k_major`'s int32 words ``[K // 8, N]``, an ``int4``
layer's one copy of its codes (:mod:`questkv.ops.triton.int4_words` multiplies more rows from the same words;
:mod:`questkv.ops.triton.quant_ops` picks which takes how many rows). A program owns ``BLOCK_N`` outputs (4
consecutive per thread, one 128-bit load per word row) and a range of groups, so every thread reads whole groups
of its outputs (no cross-thread reduction) and every ``x`` value it needs is the same for the whole warp (a
broadcast load). Each word gives its nibbles ``(e, e + 4)`` in pairs: one shift and one ``lop3`` (``(w >> 4e) &
0x000F000F | 0x43004300``) leave two 16-bit fields ``0x4300 | q``; the 32-bit word as a float is ``128.26171875 +
q[e + 4] + q[e] / 65536`` (the low half only perturbs the mantissa's last bits, 1.5e-5 of a unit), the word shifted
left by 16 is exactly ``128 + q[e]``; both are multiplied by ``x`` in float32, and per group the offsets come off
once with the zero point: ``s * (sum(f * x) - (z + 128) * sum(x) - 0.26171875 * sum(x_high))``. About 3
instructions per weight, plus one FMA per weight for the second row. The split over groups ends as the tiled
kernels' do (the last program to arrive sums the partials in a fixed order); the first word tile is loaded before
the programmatic-launch wait and each later one a tile ahead.

Three and four rows had variants of this kernel too; they were removed: the tensor-core kernel over the same words
is faster there (all linears of one llama3.1-8b token at M = 3 / 4: 3.89 / 3.91 ms against 4.02 / 4.75,
``benchmarks/results/linear-h200-words-plan2.md``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from questkv.ops.quant_reference import check_int4_words
from questkv.ops.triton._common import (
    interpreting,
    last_to_arrive,
    num_sms,
    reset_ticket,
    split_reduction,
    sum_split_partials,
    use_pdl,
)
from questkv.ops.triton.quant_tiles import group_scale_zero, word_tile

__all__ = ["GEMV_MAX_M", "GEMV_PROGRAMS_PER_SM", "Int4GemvConfig", "int4_gemv", "plan_int4_gemv"]

GEMV_MAX_M = 2
""":func:`int4_gemv` takes up to this many rows (one accumulator per row; the codes are unpacked once for both)."""

GEMV_PROGRAMS_PER_SM = 8
""":func:`int4_gemv`'s split aims at this many programs per SM (llama3.1-8b's gate/up projection on an H200: 22.5 µs
with 8, 23.9 with 4)."""

_HIGH_OFFSET = tl.constexpr(17152.0 / 65536.0)  # the 0x4300 of a pair's low half, seen in the float's mantissa


@triton.jit
def _nibble_pair(words, e: tl.constexpr, ASM: tl.constexpr):
    """Nibbles ``e`` and ``e + 4`` of every word as float32: ``(128.26171875 + q[e + 4] + q[e] / 65536,
    128 + q[e])``."""
    v = words >> (4 * e) if e > 0 else words
    if ASM:  # one lop3 where the compiler emits an and and an or (two immediates)
        t = tl.inline_asm_elementwise("lop3.b32 $0, $1, 983055, 1124090624, 234;", "=r,r", [v], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:
        t = (v & 0x000F000F) | 0x43004300
    return t.to(tl.float32, bitcast=True), (t << 16).to(tl.float32, bitcast=True)


@triton.jit
def _gemv_row(high, low, x_ptr, x_off, HIGH_OFF: tl.constexpr, d, x_low, x_high):
    """One row of ``x``: ``d += high * x[x_off + HIGH_OFF] + low * x[x_off]`` (``[ROWS, BN]``) and the sums of
    the ``x`` values taken."""
    xl = tl.load(x_ptr + x_off).to(tl.float32)  # [ROWS], the same for the whole warp
    xh = tl.load(x_ptr + x_off + HIGH_OFF).to(tl.float32)
    d += high * xh[:, None]
    d += low * xl[:, None]
    return d, x_low + xl, x_high + xh


@triton.jit
def _gemv_group(acc, d, x_low, x_high, s, z):
    """``acc`` plus one group of one row: its scale times the dot of the codes, less the zero point's and the
    nibble floats' offsets (``(z + 128) * sum(x) + 0.26171875 * sum(x_high)``)."""
    x_high_sum = tl.sum(x_high, axis=0)
    x_sum = tl.sum(x_low, axis=0) + x_high_sum
    return acc + s * (tl.sum(d, axis=0) - (z + 128.0) * x_sum - _HIGH_OFFSET * x_high_sum)


@triton.jit
def _gemv_store(acc, row, rn, nmask, out_ptr, stride_om, bias_ptr, HAS_BIAS: tl.constexpr):
    """Row ``row`` of the output: ``acc`` ``[BLOCK_N]`` float32 plus the bias, in ``out_ptr``'s dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _int4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, part_ptr, counter_ptr, out_ptr,
    M, N, groups, groups_per_split, stride_xm, stride_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SPLIT_K: tl.constexpr,
    REDUCE_CHUNK: tl.constexpr, EVEN_N: tl.constexpr, HAS_BIAS: tl.constexpr, ASM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), split)``; ``x_ptr`` ``[M, K]`` with ``M == BLOCK_M`` (1 or 2: one accumulator
    per row, the codes unpacked once for both); ``w_ptr`` int32 ``[K // 8, N]``
    (:func:`~questkv.ops.quant_reference.pack_int4_k_major`); ``s_ptr``, ``z_ptr`` ``[K // GROUP, N]``;
    ``part_ptr`` float32 ``[split, M, N]``; ``counter_ptr`` one zeroed int32 per output block; ``ROWS`` word
    rows per load (a divisor of ``GROUP // 8``)."""
    WPG: tl.constexpr = GROUP // 8  # words per group, per output
    TILES: tl.constexpr = WPG // ROWS  # word tiles per group
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    j = tl.arange(0, ROWS)
    g_start = pid_s * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, groups)
    w_ptrs = w_ptr + (g_start * WPG + j)[:, None] * N + rn[None, :]  # [ROWS, BN], advanced one tile at a time
    # each tile is loaded one tile ahead of its use; the first before waiting for the kernels this launch may
    # overlap (weights are never written on the device: only x is theirs)
    words = word_tile(w_ptrs, nmask, True, EVEN_N)
    if USE_PDL:
        gdc_wait()
    acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1 = acc0
    for g in range(g_start, g_end):
        d0 = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)  # sum(f * x) per word row, reduced once per group
        d1 = d0
        xl0 = tl.zeros([ROWS], dtype=tl.float32)
        xl1 = xl0
        xh0 = xl0
        xh1 = xl0
        for h in tl.static_range(TILES):
            w_ptrs += ROWS * N
            more = (g + 1 < g_end) | (h + 1 < TILES)  # the split's last tile has no next one
            next_words = word_tile(w_ptrs, nmask, more, EVEN_N)
            for e in tl.static_range(4):
                high, low = _nibble_pair(words, e, ASM)
                x_off = g * GROUP + e * WPG + h * ROWS + j  # [ROWS] features of nibble e
                d0, xl0, xh0 = _gemv_row(high, low, x_ptr, x_off, 4 * WPG, d0, xl0, xh0)
                if BLOCK_M > 1:
                    d1, xl1, xh1 = _gemv_row(high, low, x_ptr + stride_xm, x_off, 4 * WPG, d1, xl1, xh1)
            words = next_words
        s, z = group_scale_zero(s_ptr, z_ptr, g, N, rn, nmask, EVEN_N)
        acc0 = _gemv_group(acc0, d0, xl0, xh0, s, z)
        if BLOCK_M > 1:
            acc1 = _gemv_group(acc1, d1, xl1, xh1, s, z)
    if SPLIT_K:
        part = part_ptr + pid_s * M * N + rn
        tl.store(part, acc0, mask=nmask)
        if BLOCK_M > 1:
            tl.store(part + N, acc1, mask=nmask)
        counter = counter_ptr + pid_n
        splits = tl.num_programs(1)
        if last_to_arrive(counter, splits):
            for row in tl.static_range(BLOCK_M):
                total = sum_split_partials(part_ptr + row * N, M * N, rn, nmask, splits, REDUCE_CHUNK)
                _gemv_store(total, row, rn, nmask, out_ptr, stride_om, bias_ptr, HAS_BIAS)
            reset_ticket(counter)
    else:
        _gemv_store(acc0, 0, rn, nmask, out_ptr, stride_om, bias_ptr, HAS_BIAS)
        if BLOCK_M > 1:
            _gemv_store(acc1, 1, rn, nmask, out_ptr, stride_om, bias_ptr, HAS_BIAS)
    if USE_PDL:
        gdc_launch_dependents()


@dataclasses.dataclass(frozen=True)
class Int4GemvConfig:
    """One :func:`int4_gemv` launch: ``block_n`` outputs per program (4 per thread: ``128 * num_warps``),
    ``rows`` word rows per load, ``split`` programs per output block (each a range of whole groups)."""

    block_n: int
    num_warps: int
    rows: int
    split: int


def plan_int4_gemv(n: int, k: int, group_size: int = 128, device: Optional[torch.device] = None) -> Int4GemvConfig:
    """The launch :func:`int4_gemv` uses (``benchmarks/results/linear-h200-gemv.md``'s sweep of llama3.1-8b's
    shapes at one row on an H200: 8 word rows per load everywhere, or a group's 4 at group 32; 256 outputs per
    program up to 8192 outputs and 512 above; as many groups per program as give :data:`GEMV_PROGRAMS_PER_SM`
    programs per SM, at most one group each). ``device`` sets the SM count (``None`` or a CPU: an H200's 132)."""
    num_warps = 2 if n <= 8192 else 4
    if n < 1024:
        num_warps = 1
    block_n = 128 * num_warps
    groups = k // group_size
    tiles = math.ceil(n / block_n)
    split = min(groups, max(1, math.ceil(GEMV_PROGRAMS_PER_SM * num_sms(device or torch.device("cpu")) / tiles)))
    return Int4GemvConfig(block_n, num_warps, min(8, group_size // 8), split)


def int4_gemv(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int = 128, bias: Optional[torch.Tensor] = None,
              config: Optional[Int4GemvConfig] = None) -> torch.Tensor:
    """``y = x @ w.T + bias`` for up to :data:`GEMV_MAX_M` rows ``x`` ``[M, K]`` and an ``int4`` weight whose
    codes are ``words`` (``[K // 8, N]`` int32, :func:`~questkv.ops.quant_reference.pack_int4_k_major`),
    ``scales`` and ``zeros`` ``[K // group_size, N]`` as the ``int4`` format; ``config`` overrides
    :func:`plan_int4_gemv`.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    if x.dim() != 2 or not 1 <= x.shape[0] <= GEMV_MAX_M:
        raise ValueError(f"int4_gemv takes 1 to {GEMV_MAX_M} rows, x [M, K]; got shape {tuple(x.shape)}")
    m, k = x.shape
    n = check_int4_words(k, words, scales, zeros, group_size, "int4_gemv")
    x = x.contiguous()
    cfg = config or plan_int4_gemv(n, k, group_size, x.device)
    groups = k // group_size
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(n, cfg.block_n)
    per_split, split, part, counters = split_reduction(groups, cfg.split, out, tiles, placeholder=out)
    grid = (tiles, split)
    _int4_gemv_kernel[grid](
        x, words, scales, zeros, bias if bias is not None else scales, part, counters, out,
        m, n, groups, per_split, x.stride(0), out.stride(0),
        GROUP=group_size, BLOCK_M=m, BLOCK_N=cfg.block_n, ROWS=cfg.rows, SPLIT_K=split > 1, REDUCE_CHUNK=16,
        EVEN_N=n % cfg.block_n == 0, HAS_BIAS=bias is not None, ASM=not interpreting(), USE_PDL=use_pdl(x.device),
        num_warps=cfg.num_warps, launch_pdl=use_pdl(x.device),
    )
    return out


