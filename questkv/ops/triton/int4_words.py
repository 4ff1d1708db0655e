"""``int4`` from K-major words on CUDA for more than two rows: tensor cores for a decode step's rows, and the float
weight written in one launch for prefill.

The weight is :func:`~questkv.ops.quant_reference.pack_int4_k_major`'s int32 words ``[K // 8, N]``, an ``int4``
layer's one copy of its codes (one and two rows: :mod:`questkv.ops.triton.int4_gemv`; which takes how many rows:
:mod:`questkv.ops.triton.quant_ops`).

:func:`int4_words_matmul`: per group, each nibble ``e`` of a ``[G // 8, BLOCK_N]`` word tile is a ``[G // 8,
BLOCK_N]`` slab of 16-bit floats ``OFFSET16 + q`` (``(q | 0x4300)`` is bf16 ``128 + q`` exactly; fp16: ``0x6400``,
``1024 + q``) for the features ``e * G // 8 + j``, which are contiguous in ``x``: eight ``tl.dot`` calls of ``K = G
// 8`` (the weight as the ``A`` operand, so a few rows of ``x`` are the narrow ``B`` of a ``wgmma m64nBMk16``), then
the group's scale and zero point: ``acc += s * (d - (z + OFFSET16) * sum(x_g))``. The split over groups ends as
:mod:`questkv.ops.triton.quant_matmul`'s does.

:func:`dequantize_k_major` writes the float weight, transposed (``[K, N]``), for one GEMM whose cost the prompt's
rows share: the reference's values (float32 math, one rounding).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from questkv.ops.quant_reference import check_int4_words
from questkv.ops.triton._common import interpreting, next_pow2, num_sms, split_reduction
from questkv.ops.triton.quant_tiles import PROGRAMS_PER_SM, group_scale_zero, program_tile, store_tile, word_tile

__all__ = [
    "DEQUANT_K_MAJOR_BLOCK_N",
    "Int4WordsConfig",
    "dequantize_k_major",
    "int4_words_matmul",
    "plan_int4_words_matmul",
]


@dataclasses.dataclass(frozen=True)
class Int4WordsConfig:
    """One :func:`int4_words_matmul` launch: ``block_m`` rows and ``block_n`` outputs per program, ``split``
    programs per output tile (each a range of whole groups); ``slabs``: one ``tl.dot`` per nibble (``K = G // 8``
    features each, the words' own layout) rather than one per group over the tile reshaped to ``[G, block_n]``;
    ``swap_ab``: the weight tile is the MMA's ``A`` operand (rows = outputs) and ``x`` the narrow ``B``."""

    block_m: int
    block_n: int
    split: int
    num_warps: int = 4
    num_stages: int = 2
    slabs: bool = True
    swap_ab: bool = True


@triton.jit
def _int4_words_dot_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, part_ptr, counter_ptr, out_ptr,
    M, N, groups, groups_per_split, stride_xm, stride_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    SLABS: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_N: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr, MAGIC16: tl.constexpr, OFFSET16: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), split, cdiv(M, BLOCK_M))``; ``x_ptr`` ``[M, K]``; ``w_ptr`` int32 ``[K // 8, N]``
    (:func:`~questkv.ops.quant_reference.pack_int4_k_major`); ``s_ptr``, ``z_ptr`` ``[K // GROUP, N]``;
    ``part_ptr`` float32 ``[split, M, N]``; ``counter_ptr`` one zeroed int32 per output tile.

    Per group, ``d = x_g @ (OFFSET16 + q_g)`` through ``tl.dot`` (``(q | MAGIC16)`` is that 16-bit float exactly;
    ``UPCAST``: ``q`` in float32 and ``OFFSET16 == 0``), then ``acc += s * (d - (z + OFFSET16) * sum(x_g))``."""
    WPG: tl.constexpr = GROUP // 8
    pid_n, pid_s, pid_m, rn, nmask, rm, mmask = program_tile(M, N, BLOCK_M, BLOCK_N)
    j = tl.arange(0, WPG)
    r = tl.arange(0, GROUP)
    feature = (r % 8) * WPG + r // 8  # row r = 8 j + e of the reshaped tile holds nibble e of word row j
    g_start = pid_s * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, groups)
    w_ptrs = w_ptr + (g_start * WPG + j)[:, None] * N + rn[None, :]  # [WPG, BN], advanced one group at a time
    words = word_tile(w_ptrs, nmask, True, EVEN_N)
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(g_start, g_end):
        w_ptrs += WPG * N
        next_words = word_tile(w_ptrs, nmask, g + 1 < g_end, EVEN_N)
        x_base = x_ptr + rm[:, None] * stride_xm + g * GROUP  # [BM, 1]
        if SLABS:
            d = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], dtype=tl.float32)
            x_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
            for e in tl.static_range(8):
                xe = tl.load(x_base + (e * WPG + j)[None, :], mask=mmask[:, None], other=0.0)  # [BM, WPG]
                x_sum += tl.sum(xe.to(tl.float32), axis=1)
                b = _int4_words_nibble(words, e, xe.dtype, UPCAST, MAGIC16)  # [WPG, BN]
                if UPCAST:
                    xe = xe.to(tl.float32)
                if SWAP_AB:
                    d = tl.dot(tl.trans(b), tl.trans(xe), d, input_precision="ieee" if UPCAST else None)
                else:
                    d = tl.dot(xe, b, d, input_precision="ieee" if UPCAST else None)
        else:
            xt = tl.load(x_base + feature[None, :], mask=mmask[:, None], other=0.0)  # [BM, GROUP], tile order
            x_sum = tl.sum(xt.to(tl.float32), axis=1)
            b = tl.reshape(_int4_words_nibbles(words, xt.dtype, UPCAST, MAGIC16), [GROUP, BLOCK_N])
            if UPCAST:
                xt = xt.to(tl.float32)
            if SWAP_AB:
                d = tl.dot(tl.trans(b), tl.trans(xt), input_precision="ieee" if UPCAST else None)
            else:
                d = tl.dot(xt, b, input_precision="ieee" if UPCAST else None)
        s, z = group_scale_zero(s_ptr, z_ptr, g, N, rn, nmask, EVEN_N)
        z += OFFSET16
        if SWAP_AB:
            acc += (d - z[:, None] * x_sum[None, :]) * s[:, None]
        else:
            acc += (d - x_sum[:, None] * z[None, :]) * s[None, :]
        words = next_words
    if SWAP_AB:
        acc = tl.trans(acc)  # [BM, BN]
    store_tile(acc, rm, rn, mmask, nmask, M, N, stride_om, part_ptr, counter_ptr, bias_ptr, out_ptr, pid_s, pid_m,
               pid_n, SPLIT_K, HAS_BIAS)


@triton.jit
def _int4_words_nibble(words, e: tl.constexpr, dtype: tl.constexpr, UPCAST: tl.constexpr, MAGIC16: tl.constexpr):
    """Nibble ``e`` of every word: ``OFFSET16 + q`` in ``dtype`` (``UPCAST``: ``q`` in float32)."""
    q = (words >> (4 * e)) & 15 if e > 0 else words & 15
    if UPCAST:
        b = q.to(tl.float32)
    else:
        b = (q | MAGIC16).to(tl.int16).to(dtype, bitcast=True)
    return b


@triton.jit
def _int4_words_nibbles(words, dtype: tl.constexpr, UPCAST: tl.constexpr, MAGIC16: tl.constexpr):
    """Every nibble: ``[WPG, 8, BN]``, ``[j, e]`` = nibble ``e`` of word row ``j``, as :func:`_int4_words_nibble`."""
    q = (words[:, None, :] >> (4 * tl.arange(0, 8))[None, :, None]) & 15
    if UPCAST:
        b = q.to(tl.float32)
    else:
        b = (q | MAGIC16).to(tl.int16).to(dtype, bitcast=True)
    return b


def plan_int4_words_matmul(m: int, n: int, k: int, group_size: int = 128,
                           device: Optional[torch.device] = None) -> Int4WordsConfig:
    """The launch :func:`int4_words_matmul` uses for ``x`` ``[m, k]`` and ``n`` outputs, from sweeps of
    llama3.1-8b's shapes on an H200 (``benchmarks/results/linear-h200-words.md``: 2, 8, 16 and 64 rows;
    ``-words-plan.md``: 32; ``-words-dotk.md``: 8 and 16):

    * 16 to 64 rows per program; one dot per nibble (a dot over the whole group, or over nibbles joined, goes
      through shared memory: gate/up at 8 rows 88 and 337 µs against 64); the weight as the MMA's ``A`` operand;
    * up to 16 rows, 64 outputs and 4 warps, or 128 where there are more than 16384 outputs (gate/up 51.5 against
      54.6 µs at 2 rows, the LM head 194 against 230), those with 3 pipeline stages (gate/up 62.3 against 64.0 µs
      at 8 rows, the LM head 195 against 200);
    * more rows, 128 outputs and 8 warps (64 rows: qkv 26.2 against 34.9 µs with 64 outputs and 4 warps, gate/up
      100 against 137; down 65.3 against the best 62.1);
    * the tile's ``K`` split to reach :data:`PROGRAMS_PER_SM` programs per SM; twice as many for 128 outputs up to
      16 rows where the tiles alone do not reach that (gate/up at 8 rows: 58.2 µs split 6 ways against 64.0 split
      3 ways; the LM head's tiles are enough), half as many from 32 rows (32 rows: qkv 21.6 against 23.3 µs, o 15.6
      against 20.0, down 39.0 against 43.4)."""
    block_m = min(64, max(16, next_pow2(m)))
    block_n, num_warps = (64, 4) if block_m <= 16 and n <= 16384 else (128, 4) if block_m <= 16 else (128, 8)
    num_stages = 3 if block_m <= 16 and block_n == 128 else 2
    tiles = math.ceil(n / block_n) * math.ceil(m / block_m)
    groups = k // group_size
    programs = PROGRAMS_PER_SM * num_sms(device or torch.device("cpu"))
    if block_m > 16:
        programs //= 2
    elif block_n == 128 and tiles < programs:
        programs *= 2
    split = min(groups, max(1, math.ceil(programs / tiles)))
    return Int4WordsConfig(block_m, block_n, split, num_warps, num_stages, slabs=group_size // 8 >= 16)


def int4_words_matmul(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      group_size: int = 128, bias: Optional[torch.Tensor] = None,
                      config: Optional[Int4WordsConfig] = None) -> torch.Tensor:
    """``y = x @ w.T + bias`` for ``x`` ``[M, K]`` (bf16 / fp16 / fp32) and an ``int4`` weight held as K-major
    words (``[K // 8, N]`` int32), ``scales`` and ``zeros`` ``[K // group_size, N]``, on tensor cores; ``config``
    overrides :func:`plan_int4_words_matmul`.

    Launched without programmatic dependent launch, unlike the GEMV: in the engine (llama3.1-8b int4, B=16/32k on
    an H200, ``benchmarks/results/e2e-h200-int4-b16-new.md`` against ``-nopdl.md``) it cost 0.4–0.5 ms a step
    (dense 21.41 against 20.90 ms, Quest 9.30 against 8.91), its programs launched early holding SMs that the
    kernel before still needed.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    if x.dim() != 2:
        raise ValueError(f"int4_words_matmul: x must be [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    n = check_int4_words(k, words, scales, zeros, group_size, "int4_words_matmul")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or plan_int4_words_matmul(m, n, k, group_size, x.device)
    if cfg.slabs and group_size // 8 < 16:
        raise ValueError(f"int4_words_matmul: slabs need group_size >= 128 (tl.dot's K >= 16), got {group_size}")
    x = x.contiguous()
    groups = k // group_size
    tiles_n, tiles_m = triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m)
    per_split, split, part, counters = split_reduction(groups, cfg.split, out, tiles_n * tiles_m, placeholder=out)
    grid = (tiles_n, split, tiles_m)
    upcast = x.dtype == torch.float32 or (interpreting() and x.dtype == torch.bfloat16)
    magic16, offset16 = (0, 0.0) if upcast else {torch.bfloat16: (0x4300, 128.0),
                                                  torch.float16: (0x6400, 1024.0)}[x.dtype]
    _int4_words_dot_kernel[grid](
        x, words, scales, zeros, bias if bias is not None else scales, part, counters, out,
        m, n, groups, per_split, x.stride(0), out.stride(0),
        GROUP=group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT_K=split > 1, SLABS=cfg.slabs,
        SWAP_AB=cfg.swap_ab, EVEN_N=n % cfg.block_n == 0, HAS_BIAS=bias is not None, UPCAST=upcast,
        MAGIC16=magic16, OFFSET16=offset16, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# prefill: the float weight from the words, written once per call for one GEMM

DEQUANT_K_MAJOR_BLOCK_N = 256
""":func:`dequantize_k_major`'s outputs per program (each takes one group)."""


@triton.jit
def _dequantize_k_major_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK_N), K // GROUP)``: one group's word rows ``[GROUP // 8, BLOCK_N]`` of ``w_ptr``
    (int32 ``[K // 8, N]``, :func:`~questkv.ops.quant_reference.pack_int4_k_major`) to rows ``g * GROUP ..
    (g + 1) * GROUP`` of ``out_ptr`` ``[K, N]``: nibble ``e`` of word row ``j`` is row ``g * GROUP + e * GROUP // 8
    + j``, ``(q - z) * s`` in float32 rounded once; ``s_ptr``, ``z_ptr`` ``[K // GROUP, N]``."""
    WPG: tl.constexpr = GROUP // 8
    g = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = (rn < N)[None, :]
    j = tl.arange(0, WPG)
    words = tl.load(w_ptr + (g * WPG + j)[:, None] * N + rn[None, :], mask=nmask, other=0)  # [WPG, BN]
    s = tl.load(s_ptr + g * N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    z = tl.load(z_ptr + g * N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    for e in tl.static_range(8):
        w = (((words >> (4 * e)) & 15).to(tl.float32) - z) * s
        tl.store(out_ptr + (g * GROUP + e * WPG + j)[:, None] * N + rn[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=nmask)


def dequantize_k_major(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int = 128,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton :func:`questkv.ops.quant_reference.dequantize_k_major`: the float weight, transposed (``[K, N]``), of
    an ``int4`` weight held as K-major words, in one launch (the reference's values: float32 math, one
    rounding): an ``int4`` layer's prefill."""
    k = words.shape[0] * 8
    n = check_int4_words(k, words, scales, zeros, group_size, "dequantize_k_major")
    scales, zeros = scales.contiguous(), zeros.contiguous()  # no-ops for a layer's buffers
    out = torch.empty((k, n), dtype=dtype, device=words.device)
    if n == 0 or k == 0:
        return out
    _dequantize_k_major_kernel[(triton.cdiv(n, DEQUANT_K_MAJOR_BLOCK_N), k // group_size)](
        words.contiguous(), scales, zeros, out, n, GROUP=group_size, BLOCK_N=DEQUANT_K_MAJOR_BLOCK_N, num_warps=4,
        enable_fp_fusion=False,
    )
    return out
