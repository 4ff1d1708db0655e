"""Weight-only quantized matmul on CUDA: one Triton kernel with two inner loops, and torch's int4 kernel.

Formats: :mod:`questkv.ops.quant_reference` (same signature as its ``quant_matmul``), all three: ``int4``,
``int8`` and ``int8_grouped``. The kernel reads the packed weight as int32 words (8 int4 or 4 int8 values each)
and never writes a dequantized weight. ``int8`` has one scale per row, applied once at the end, and is reduced in
chunks of :data:`INT8_CHUNK` as if they were groups; ``int4`` and ``int8_grouped`` apply a scale per group:

* ``use_dot=False`` (small ``M``, a GEMV): each program loads a ``[BLOCK_N, groups_per_iter, words per group]``
  tile of words (128-bit loads along ``K``), turns every 4- or 8-bit field into a float with a shift, one
  ``lop3`` and one add (``(field ^ 0x4B000000)`` is the float ``2**23 + field``, exact), multiplies by ``x`` in
  float32 and reduces each group; the group's scale and zero point apply once per group:
  ``s * (sum(q * x) - z * sum(x))`` (``int8_grouped``: ``s * sum(q * x)``). Costs ~4 instructions per weight
  plus one FMA per row of ``x``.
* ``use_dot=True`` (more rows, and prefill): per group, the integers ``q`` (exact in bf16 / fp16) go through
  ``tl.dot`` with the ``x`` tile (fp32 accumulation), then the same per-group scale and zero correction.
  ``int8_grouped``'s groups (16 or 32) are too short for one dot each: the codes of :data:`DOT_CHUNK` input
  features are multiplied by their groups' scales in float32, rounded once to ``x``'s dtype (as the ``dequant``
  backend rounds) and go through one dot.

Both split the reduction over ``K`` across ``split_k`` programs per output tile (many programs for a GEMV on
132 SMs): each writes a float32 partial, and the last one to arrive (an ``acq_rel`` ticket per tile) sums the
partials in split order (deterministic), adds the bias, writes the output in ``x``'s dtype and resets its
ticket, so one launch does everything and graphs need no memset. The tickets live in one int32 buffer per
device shared by every launch: launches must not run concurrently on two streams.

One to four rows of ``int4`` (decode steps at small batches; batch 1 above all) have a kernel of their own,
:func:`int4_gemv`, over a second copy of the weight in :func:`~questkv.ops.quant_reference.pack_int4_k_major`'s
layout: a program owns ``BLOCK_N`` outputs (4 consecutive per thread, one 128-bit load per word row) and a range
of groups, so every thread reads whole groups of its outputs (no cross-thread reduction) and every ``x`` value it
needs is the same for the whole warp (a broadcast load). Each word gives its nibbles ``(e, e + 4)`` in pairs: one shift and one ``lop3``
(``(w >> 4e) & 0x000F000F | 0x43004300``) leave two 16-bit fields ``0x4300 | q``; the 32-bit word as a float is
``128.26171875 + q[e + 4] + q[e] / 65536`` (the low half only perturbs the mantissa's last bits, 1.5e-5 of a
unit), the word shifted left by 16 is exactly ``128 + q[e]``; both are multiplied by ``x`` in float32, and per
group the offsets come off once with the zero point: ``s * (sum(f * x) - (z + 128) * sum(x) - 0.26171875 *
sum(x_high))``. About 3 instructions per weight against 4.3 for the FMA loop above, plus one FMA per weight for
each further row (so tinygemm serves bf16 at 2 to 4 rows). The split over groups ends as the main kernel's does,
the partials summed in fixed chunks; the first word tile is loaded before the programmatic-launch wait and each
later one a tile ahead.

More rows of ``int4`` go through tensor cores over the same words, :func:`int4_words_matmul`: per group, each
nibble ``e`` of a ``[G // 8, BLOCK_N]`` word tile is a ``[G // 8, BLOCK_N]`` slab of 16-bit floats ``OFFSET16 + q``
(``(q | 0x4300)`` is bf16 ``128 + q`` exactly; fp16: ``0x6400``, ``1024 + q``) for the features ``e * G // 8 + j``,
which are contiguous in ``x``: eight ``tl.dot`` calls of ``K = G // 8`` (the weight as the ``A`` operand, so a
few rows of ``x`` are the narrow ``B`` of a ``wgmma m64nBMk16``), then the group's scale and zero point as in the
dot loop above. An int4 layer then needs no other copy of its codes for any number of rows.

``tinygemm_pack`` / ``tinygemm_matmul`` convert an ``int4`` weight for ``torch.ops.aten._weight_int4pack_mm``
(bf16 only), the CUDA backend for bf16 at 2 to 4 rows.

Prefill (more than 64 rows) multiplies by the float weight: :func:`dequantize` writes it in one launch (every format;
the reference's values, float32 math and one rounding) for one GEMM, whose cost the prompt's rows share;
:func:`dequantize_k_major` writes it, transposed, from the GEMV's words (a layer that holds no other copy).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from questkv.ops.quant_reference import ALL_METHODS, GROUP_SIZES, check_quant_args, unpack_int4
from questkv.ops.triton._common import (
    interpreting,
    last_to_arrive,
    next_pow2,
    num_sms,
    reset_ticket,
    sum_split_partials,
    ticket_counters,
    use_pdl,
)
from questkv.validation import check_choice

__all__ = [
    "DEQUANT_BLOCK",
    "DEQUANT_K_MAJOR_BLOCK_N",
    "FMA_MAX_M",
    "GEMV_MAX_M",
    "Int4GemvConfig",
    "Int4WordsConfig",
    "int4_gemv",
    "int4_words_matmul",
    "plan_int4_gemv",
    "plan_int4_words_matmul",
    "QuantMatmulConfig",
    "dequantize",
    "dequantize_k_major",
    "plan_quant_matmul",
    "quant_matmul",
    "tinygemm_matmul",
    "tinygemm_pack",
]

FMA_MAX_M = {"int4": 4, "int8": 4, "int8_grouped": 1}
"""Per format, the rows of ``x`` up to which :func:`plan_quant_matmul` picks the FMA loop (above: the ``tl.dot``
loop). ``int8_grouped`` keeps it for one row only: its groups of 16 or 32 make the FMA loop reduce and scale every
group per row, 11.3 ms over the 8B's linears at 4 rows on an H200 against 5.9 ms for the dot loop at 16 rows
(``benchmarks/results/linear-int8g-h200.md``)."""

INT8_CHUNK = 128
"""``int8`` (one scale per row) is reduced in chunks of this many input features, as ``int4`` in its groups."""

DOT_CHUNK = 64
"""Input features per ``tl.dot`` of the ``int8_grouped`` loop (its groups of 16 or 32 are scaled into the weight
tile first; ``int4`` keeps one group per dot, its zero points are corrected after it)."""

PROGRAMS_PER_SM = 4
"""Split-K aims at this many programs per SM."""

GEMV_MAX_M = 4
""":func:`int4_gemv` takes up to this many rows (one accumulator per row; the codes are unpacked once for all)."""

GEMV_PROGRAMS_PER_SM = 8
""":func:`int4_gemv`'s split aims at this many programs per SM (llama3.1-8b's gate/up projection on an H200: 22.5 µs
with 8, 23.9 with 4)."""

_MAGIC = tl.constexpr(0x4B000000)  # float32 2**23: its low mantissa bits take the integer field exactly


@dataclasses.dataclass(frozen=True)
class QuantMatmulConfig:
    """One launch's tiling. ``block_m`` rows of ``x`` and ``block_n`` outputs per program; ``groups_per_iter``
    groups (``int8``: chunks of :data:`INT8_CHUNK`) per loop iteration (with ``use_dot``: 1 for ``int4`` and
    ``int8``, whose dot takes one group); ``split_k`` programs share one output tile's reduction."""

    block_m: int
    block_n: int
    groups_per_iter: int
    split_k: int
    use_dot: bool
    num_warps: int = 4
    num_stages: int = 2
    swap_ab: bool = False


@triton.jit
def _quant_matmul_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, part_ptr, counter_ptr, out_ptr,
    M, N, K, k_words, words_per_split,
    stride_xm, stride_wn, stride_sg, stride_om,
    BITS: tl.constexpr, GROUP: tl.constexpr, GROUP_SCALES: tl.constexpr, GROUPS_PER_ITER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr,
    MAGIC16: tl.constexpr, OFFSET16: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), split_k, cdiv(M, BLOCK_M))``; ``w_ptr`` int32 words ``[N, k_words]``;
    ``s_ptr`` ``[K // GROUP, N]`` with ``GROUP_SCALES`` (``int4``, ``int8_grouped``), else ``[N]`` (``int8``,
    ``GROUP`` the chunk); ``z_ptr`` ``[K // GROUP, N]`` (``BITS == 4`` only); ``part_ptr`` float32
    ``[split_k, M, N]``; ``counter_ptr`` one zeroed int32 per output tile."""
    EPW: tl.constexpr = 32 // BITS  # values per word
    WPG: tl.constexpr = GROUP // EPW  # words per group
    FIELD: tl.constexpr = (1 << BITS) - 1
    # int8 fields are two's complement: flipping bit 7 makes them q + 128, which the offset removes
    MAGIC: tl.constexpr = _MAGIC | (128 if BITS == 8 else 0)
    OFFSET: tl.constexpr = 8388608.0 + (128.0 if BITS == 8 else 0.0)
    pid_n, pid_s, pid_m, rn, nmask, rm, mmask = _tile(M, N, BLOCK_M, BLOCK_N)
    kw_start = pid_s * words_per_split
    kw_end = tl.minimum(kw_start + words_per_split, k_words)
    e = tl.arange(0, EPW)
    shifts = e * BITS
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    if USE_DOT:
        # int4 / int8: one group (chunk) per iteration; int8_grouped: GROUPS_PER_ITER small groups, each scaled
        # into the weight tile before one wider tl.dot
        CHUNK: tl.constexpr = GROUP * GROUPS_PER_ITER
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # SWAP_AB's accumulator
        kk = tl.arange(0, CHUNK)
        wi = tl.arange(0, WPG * GROUPS_PER_ITER)
        for kw in range(kw_start, kw_end, WPG * GROUPS_PER_ITER):
            words_idx = kw + wi  # [CW] words of the chunk
            wmask = nmask[:, None]
            xmask = mmask[:, None]
            if not EVEN_K:
                wmask = wmask & (words_idx < kw_end)[None, :]
                xmask = xmask & (kw * EPW + kk < K)[None, :]
            words = tl.load(w_ptr + rn[:, None] * stride_wn + words_idx[None, :], mask=wmask, other=0)  # [BN, CW]
            xt = tl.load(x_ptr + rm[:, None] * stride_xm + (kw * EPW + kk)[None, :], mask=xmask, other=0.0)
            fields = (words[:, :, None] >> shifts[None, None, :]) & FIELD  # [BN, CW, EPW]
            if GROUP_SCALES:
                group = kw // WPG + tl.arange(0, GROUPS_PER_ITER)  # [G]
                smask = nmask[:, None]
                if not EVEN_K:
                    smask = smask & (group * WPG < kw_end)[None, :]
                sptrs = group[None, :] * stride_sg + rn[:, None]  # [BN, G]
                s = tl.load(s_ptr + sptrs, mask=smask, other=0.0).to(tl.float32)
            if MAGIC16 != 0:
                # 16-bit floats straight from the bits: (field | MAGIC16) is OFFSET16 + q exactly (bf16: 128 + q,
                # fp16: 1024 + q); the zero-point correction below removes OFFSET16
                b = tl.reshape((fields | MAGIC16).to(tl.int16).to(xt.dtype, bitcast=True), [BLOCK_N, CHUNK])
                a = xt
            else:
                q = tl.reshape((fields ^ MAGIC).to(tl.float32, bitcast=True) - OFFSET, [BLOCK_N, CHUNK])
                if BITS == 8 and GROUP_SCALES:  # w = q * s, rounded once to x's dtype (as the dequant backend)
                    q = tl.reshape(tl.reshape(q, [BLOCK_N, GROUPS_PER_ITER, GROUP]) * s[:, :, None],
                                   [BLOCK_N, CHUNK])
                if UPCAST or IEEE:
                    a = xt.to(tl.float32)
                    b = q
                else:
                    a = xt
                    b = q.to(xt.dtype)
            if BITS == 4:  # GROUPS_PER_ITER == 1
                s = tl.reshape(s, [BLOCK_N])
                z = tl.reshape(tl.load(z_ptr + sptrs, mask=smask, other=0.0), [BLOCK_N]).to(tl.float32)
                xs = tl.sum(xt.to(tl.float32), axis=1)  # [BM]
                z = z + OFFSET16
            if SWAP_AB:  # the weight tile is the MMA's A operand (rows = outputs), x the narrow B
                if UPCAST or IEEE:
                    d = tl.dot(b, tl.trans(a), input_precision="ieee")  # [BN, BM]
                else:
                    d = tl.dot(b, tl.trans(a))
                if BITS == 4:
                    d = (d - z[:, None] * xs[None, :]) * s[:, None]
                acc_t += d
            else:
                if UPCAST or IEEE:
                    d = tl.dot(a, tl.trans(b), input_precision="ieee")  # [BM, BN]
                else:
                    d = tl.dot(a, tl.trans(b))
                if BITS == 4:
                    d = (d - xs[:, None] * z[None, :]) * s[None, :]
                acc += d
        if SWAP_AB:
            acc += tl.trans(acc_t)
    else:
        g = tl.arange(0, GROUPS_PER_ITER)
        wi = tl.arange(0, WPG)
        word_off = g[:, None] * WPG + wi[None, :]  # [G, WPG]
        rows = tl.arange(0, BLOCK_M)
        acc_g = tl.zeros([BLOCK_N, GROUPS_PER_ITER], dtype=tl.float32)  # BLOCK_M == 1: reduced once, at the end
        STEP: tl.constexpr = GROUPS_PER_ITER * WPG
        w_ptrs = w_ptr + rn[:, None, None] * stride_wn + word_off[None, :, :]  # [BN, G, WPG]
        wmask = nmask[:, None, None] & (kw_start + word_off < kw_end)[None, :, :]
        next_words = tl.load(w_ptrs + kw_start, mask=wmask, other=0)
        for kw in range(kw_start, kw_end, STEP):
            words = next_words  # [BN, G, WPG], loaded one iteration ahead
            wmask = nmask[:, None, None] & (kw + STEP + word_off < kw_end)[None, :, :]
            next_words = tl.load(w_ptrs + (kw + STEP), mask=wmask, other=0)
            words_idx = kw + word_off  # [G, WPG]
            kidx = words_idx[:, :, None] * EPW + e[None, None, :]  # [G, WPG, EPW] input feature of each value
            # one float tensor per field position, each in the words' own layout (no [.., EPW] axis to reduce)
            q0 = _field(words, 0, BITS, MAGIC, OFFSET)
            q1 = _field(words, 1, BITS, MAGIC, OFFSET)
            q2 = _field(words, 2, BITS, MAGIC, OFFSET)
            q3 = _field(words, 3, BITS, MAGIC, OFFSET)
            if EPW == 8:
                q4 = _field(words, 4, BITS, MAGIC, OFFSET)
                q5 = _field(words, 5, BITS, MAGIC, OFFSET)
                q6 = _field(words, 6, BITS, MAGIC, OFFSET)
                q7 = _field(words, 7, BITS, MAGIC, OFFSET)
            if GROUP_SCALES:
                group = kw // WPG + g  # [G]
                smask = nmask[:, None]
                if not EVEN_K:
                    smask = smask & (group * WPG < kw_end)[None, :]
                sptrs = group[None, :] * stride_sg + rn[:, None]  # [BN, G]
                s = tl.load(s_ptr + sptrs, mask=smask, other=0.0).to(tl.float32)
            if BITS == 4:
                z = tl.load(z_ptr + sptrs, mask=smask, other=0.0).to(tl.float32)
            for i in tl.static_range(BLOCK_M):
                row = pid_m * BLOCK_M + i
                xmask = (kidx < K) & (row < M)
                xv = tl.load(x_ptr + row * stride_xm + kidx, mask=xmask, other=0.0).to(tl.float32)  # [G, WPG, EPW]
                # x of field position p: split the EPW axis by its bits (p = 4a + 2b + c)
                if EPW == 8:
                    xc0, xc1 = tl.split(tl.reshape(xv, [GROUPS_PER_ITER, WPG, 2, 2, 2]))  # c = 0 / 1
                    x_04, x_26 = tl.split(xc0)
                    x_15, x_37 = tl.split(xc1)
                    x0, x4 = tl.split(x_04)
                    x2, x6 = tl.split(x_26)
                    x1, x5 = tl.split(x_15)
                    x3, x7 = tl.split(x_37)
                    prod = (q0 * x0[None] + q1 * x1[None] + q2 * x2[None] + q3 * x3[None]
                            + q4 * x4[None] + q5 * x5[None] + q6 * x6[None] + q7 * x7[None])  # [BN, G, WPG]
                else:
                    xb0, xb1 = tl.split(tl.reshape(xv, [GROUPS_PER_ITER, WPG, 2, 2]))  # b = 0 / 1
                    x0, x2 = tl.split(xb0)
                    x1, x3 = tl.split(xb1)
                    prod = q0 * x0[None] + q1 * x1[None] + q2 * x2[None] + q3 * x3[None]
                d = tl.sum(prod, axis=2)  # [BN, G]
                if BITS == 4:
                    if EPW == 8:
                        xs = tl.sum(x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7, axis=1)  # [G]
                    else:
                        xs = tl.sum(x0 + x1 + x2 + x3, axis=1)
                    d = (d - z * xs[None, :]) * s
                elif GROUP_SCALES:
                    d = d * s
                if BLOCK_M == 1:
                    acc_g += d
                else:
                    acc += tl.where(rows[:, None] == i, tl.sum(d, axis=1)[None, :], 0.0)
        if BLOCK_M == 1:
            acc += tl.sum(acc_g, axis=1)[None, :]

    if not GROUP_SCALES:  # int8: one scale per row
        s = tl.load(s_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        acc = acc * s[None, :]
    _store_tile(acc, rm, rn, mmask, nmask, M, N, stride_om, part_ptr, counter_ptr, bias_ptr, out_ptr, pid_s, pid_m,
                pid_n, SPLIT_K, HAS_BIAS)


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tiled launch's program on grid ``(output tiles, splits, row tiles)``: its program ids ``(n, split, m)``, its
    outputs ``rn`` and rows ``rm`` with their in-range masks."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return pid_n, pid_s, pid_m, rn, rn < N, rm, rm < M


@triton.jit
def _store_tile(acc, rm, rn, mmask, nmask, M, N, stride_om, part_ptr, counter_ptr, bias_ptr, out_ptr, pid_s, pid_m,
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
def _field(words, pos: tl.constexpr, BITS: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr):
    """The ``pos``-th ``BITS``-wide field of every int32 word, as an exact float32 (``int8``: signed)."""
    return (((words >> (pos * BITS)) & ((1 << BITS) - 1)) ^ MAGIC).to(tl.float32, bitcast=True) - OFFSET


def _group(method: str, group_size: int) -> int:
    """The ``K`` the kernel reduces before a scale applies: ``method``'s group (``int8``: :data:`INT8_CHUNK`)."""
    return INT8_CHUNK if method == "int8" else group_size


def plan_quant_matmul(m: int, n: int, k: int, method: str, group_size: int = 128,
                      device: Optional[torch.device] = None, use_dot: Optional[bool] = None) -> QuantMatmulConfig:
    """The tiling :func:`quant_matmul` launches for ``x`` ``[m, k]`` and a weight of ``n`` outputs (not tuned on a
    GPU yet: ``benchmarks/linear.py`` times alternatives). ``device`` sets the SM count the split aims at (``None``
    or a CPU: an H200's 132); ``use_dot`` forces a loop (default: FMA up to :data:`FMA_MAX_M` rows)."""
    group = _group(method, group_size)
    if use_dot is None:
        use_dot = m > FMA_MAX_M[method]
    if use_dot:
        block_m = min(max(16, next_pow2(m)), 64 if m <= 64 else 128)
        block_n = 64 if m <= 64 else 128
        # int8_grouped's small groups are scaled into the weight tile: one dot over DOT_CHUNK input features
        groups_per_iter = max(1, DOT_CHUNK // group) if method == "int8_grouped" else 1
        num_warps, num_stages = 4, 3
        if m > 64:
            num_warps = 8
    else:
        block_m = next_pow2(m)
        block_n = 32 if block_m <= 2 else 16
        groups_per_iter = max(1, 256 // group)
        num_warps, num_stages = 4, 2
    iters = math.ceil(k / (group * groups_per_iter))
    tiles = math.ceil(n / block_n) * math.ceil(m / block_m)
    split = 1
    if m <= 64:
        split = min(iters, max(1, math.ceil(PROGRAMS_PER_SM * num_sms(device or torch.device("cpu")) / tiles)))
    # swap_ab: the weight tile as the MMA's 64-row A operand and x as a narrow B (wgmma m64nBMk16) while M is small
    return QuantMatmulConfig(block_m, block_n, groups_per_iter, split, use_dot, num_warps, num_stages,
                             swap_ab=use_dot and block_m <= 64)


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                 method: str, group_size: int = 128, bias: Optional[torch.Tensor] = None,
                 config: Optional[QuantMatmulConfig] = None) -> torch.Tensor:
    """``y = x @ w.T + bias`` for a quantized ``w`` (:func:`questkv.ops.quant_reference.quant_matmul`'s
    signature), in one launch; ``config`` overrides :func:`plan_quant_matmul`.

    Args:
        x: ``[M, K]`` bf16 / fp16 / fp32, last dimension contiguous.
        qweight, scales, zeros, method, group_size: the weight (contiguous).
        bias: ``[N]`` or ``None``.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    n, k = check_quant_args(x, qweight, scales, zeros, method, group_size)
    m = x.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if k % 4:
        raise ValueError(f"quant_matmul (triton) needs in_features divisible by 4 (int32 words), got {k}")
    cfg = config or plan_quant_matmul(m, n, k, method, group_size, x.device)
    bits = 4 if method == "int4" else 8
    group = _group(method, group_size)
    words = qweight.view(torch.int32)  # [N, K * bits // 32] little-endian words
    k_words = k * bits // 32
    step_words = cfg.groups_per_iter * group * bits // 32
    iters = math.ceil(k_words / step_words)
    per_split = math.ceil(iters / cfg.split_k)
    split = math.ceil(iters / per_split)  # no empty split
    words_per_split = per_split * step_words
    even_k = k_words % step_words == 0
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, cfg.block_m))
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = ticket_counters(x.device, grid[0] * grid[2])
    else:
        part = counters = out  # never read
    upcast = interpreting() and x.dtype == torch.bfloat16  # the interpreter's bf16 dot is wrong; fp16's is right
    magic16, offset16 = 0, 0.0
    if cfg.use_dot and bits == 4 and not upcast:
        magic16, offset16 = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}.get(x.dtype, (0, 0.0))
    _quant_matmul_kernel[grid](
        x, words, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, part,
        counters, out,
        m, n, k, k_words, words_per_split,
        x.stride(0), words.stride(0), scales.stride(0) if method != "int8" else 0, out.stride(0),
        BITS=bits, GROUP=group, GROUP_SCALES=method != "int8", GROUPS_PER_ITER=cfg.groups_per_iter,
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT_K=split > 1, USE_DOT=cfg.use_dot,
        UPCAST=upcast, IEEE=x.dtype == torch.float32, EVEN_K=even_k, SWAP_AB=cfg.swap_ab,
        MAGIC16=magic16, OFFSET16=offset16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# prefill: the float weight, written once per call for one bf16 GEMM

DEQUANT_BLOCK = (64, 256)
""":func:`dequantize`'s tile: output rows x input features per program."""


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_qn, stride_sg, stride_on,
                       BITS: tl.constexpr, GROUP: tl.constexpr, GROUP_SCALES: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK_N), cdiv(K, BLOCK_K))``: ``out[n, k] = (q - z) * s`` (``int4``; ``int8``:
    ``q * s[n]``; ``int8_grouped``: ``q * s``) in float32, rounded once to ``out``'s dtype. ``q_ptr``: ``int4``
    bytes ``[N, K // 2]`` (feature ``2j`` in byte ``j``'s low nibble), else int8 ``[N, K]``; ``s_ptr``, ``z_ptr``:
    ``[K // GROUP, N]`` (``int8``: ``s_ptr`` ``[N]``)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rk = k0 + tl.arange(0, BLOCK_K)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    if BITS == 4:
        rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        byte = tl.load(q_ptr + rn[:, None] * stride_qn + rb[None, :],
                       mask=(rn < N)[:, None] & (rb < K // 2)[None, :], other=0).to(tl.int32)
        q = tl.reshape(tl.join(byte & 15, byte >> 4), [BLOCK_N, BLOCK_K]).to(tl.float32)  # features 2j, 2j + 1
    else:
        q = tl.load(q_ptr + rn[:, None] * stride_qn + rk[None, :], mask=mask, other=0).to(tl.float32)
    if GROUP_SCALES:
        sg = (rk // GROUP)[None, :] * stride_sg + rn[:, None]  # [BN, BK]: every feature's group
        s = tl.load(s_ptr + sg, mask=mask, other=0.0).to(tl.float32)
        if BITS == 4:
            q = q - tl.load(z_ptr + sg, mask=mask, other=0.0).to(tl.float32)
        w = q * s
    else:
        w = q * tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rn[:, None] * stride_on + rk[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], method: str,
               group_size: int = 128, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton :func:`questkv.ops.quant_reference.dequantize`: the float weight ``[N, K]`` in ``dtype`` (float32
    math, one rounding: the reference's values), in one launch that reads the packed weight once and writes the
    float one once (prefill's dequantize-then-GEMM: about 2.5 bytes per int4 weight of traffic)."""
    check_choice("quantization", method, ALL_METHODS)
    qweight, scales = qweight.contiguous(), scales.contiguous()  # no-ops for a layer's buffers
    zeros = zeros.contiguous() if zeros is not None else None
    n = qweight.shape[0]
    k = qweight.shape[1] * (2 if method == "int4" else 1)
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    if n == 0 or k == 0:
        return out
    block_n, block_k = DEQUANT_BLOCK
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight, scales, zeros if zeros is not None else scales, out, n, k, qweight.stride(0),
        scales.stride(0) if method != "int8" else 0, out.stride(0),
        BITS=4 if method == "int4" else 8, GROUP=group_size, GROUP_SCALES=method != "int8",
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, enable_fp_fusion=False,
    )
    return out


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
    an ``int4`` weight held as :func:`int4_gemv`'s K-major words, in one launch (the reference's values: float32
    math, one rounding). The prefill path of a layer whose only copy of the codes is the GEMV's."""
    k = words.shape[0] * 8
    n = _check_k_major(k, words, scales, zeros, group_size, "dequantize_k_major")
    scales, zeros = scales.contiguous(), zeros.contiguous()  # no-ops for a layer's buffers
    out = torch.empty((k, n), dtype=dtype, device=words.device)
    if n == 0 or k == 0:
        return out
    _dequantize_k_major_kernel[(triton.cdiv(n, DEQUANT_K_MAJOR_BLOCK_N), k // group_size)](
        words.contiguous(), scales, zeros, out, n, GROUP=group_size, BLOCK_N=DEQUANT_K_MAJOR_BLOCK_N, num_warps=4,
        enable_fp_fusion=False,
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# one row of int4: the K-major GEMV

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
def _word_tile(w_ptrs, nmask, valid, EVEN_N: tl.constexpr):
    """A ``[rows, BLOCK_N]`` tile of K-major words (zeros where not ``valid``, or past ``N`` unless ``EVEN_N``)."""
    if EVEN_N:
        return tl.load(w_ptrs, mask=valid, other=0)
    return tl.load(w_ptrs, mask=valid & nmask[None, :], other=0)


@triton.jit
def _group_scale_zero(s_ptr, z_ptr, g, N, rn, nmask, EVEN_N: tl.constexpr):
    """Group ``g``'s scales and zero points of outputs ``rn`` (``[BLOCK_N]``) in float32, from ``[K // GROUP, N]``
    (zero points in any dtype: bytes or the scales')."""
    if EVEN_N:
        return tl.load(s_ptr + g * N + rn).to(tl.float32), tl.load(z_ptr + g * N + rn).to(tl.float32)
    return (tl.load(s_ptr + g * N + rn, mask=nmask, other=0.0).to(tl.float32),
            tl.load(z_ptr + g * N + rn, mask=nmask, other=0.0).to(tl.float32))


@triton.jit
def _gemv_store(acc, row, rn, nmask, out_ptr, stride_om, bias_ptr, HAS_BIAS: tl.constexpr):
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
    """Grid ``(cdiv(N, BLOCK_N), split)``; ``x_ptr`` ``[M, K]`` with ``M == BLOCK_M`` (1 to 4: one accumulator
    per row, the codes unpacked once for all); ``w_ptr`` int32 ``[K // 8, N]``
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
    words = _word_tile(w_ptrs, nmask, True, EVEN_N)
    if USE_PDL:
        gdc_wait()
    acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for g in range(g_start, g_end):
        d0 = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)  # sum(f * x) per word row, reduced once per group
        d1 = d0
        d2 = d0
        d3 = d0
        xl0 = tl.zeros([ROWS], dtype=tl.float32)
        xl1 = xl0
        xl2 = xl0
        xl3 = xl0
        xh0 = xl0
        xh1 = xl0
        xh2 = xl0
        xh3 = xl0
        for h in tl.static_range(TILES):
            w_ptrs += ROWS * N
            more = (g + 1 < g_end) | (h + 1 < TILES)  # the split's last tile has no next one
            next_words = _word_tile(w_ptrs, nmask, more, EVEN_N)
            for e in tl.static_range(4):
                high, low = _nibble_pair(words, e, ASM)
                x_off = g * GROUP + e * WPG + h * ROWS + j  # [ROWS] features of nibble e
                d0, xl0, xh0 = _gemv_row(high, low, x_ptr, x_off, 4 * WPG, d0, xl0, xh0)
                if BLOCK_M > 1:
                    d1, xl1, xh1 = _gemv_row(high, low, x_ptr + stride_xm, x_off, 4 * WPG, d1, xl1, xh1)
                if BLOCK_M > 2:
                    d2, xl2, xh2 = _gemv_row(high, low, x_ptr + 2 * stride_xm, x_off, 4 * WPG, d2, xl2, xh2)
                if BLOCK_M > 3:
                    d3, xl3, xh3 = _gemv_row(high, low, x_ptr + 3 * stride_xm, x_off, 4 * WPG, d3, xl3, xh3)
            words = next_words
        s, z = _group_scale_zero(s_ptr, z_ptr, g, N, rn, nmask, EVEN_N)
        acc0 = _gemv_group(acc0, d0, xl0, xh0, s, z)
        if BLOCK_M > 1:
            acc1 = _gemv_group(acc1, d1, xl1, xh1, s, z)
        if BLOCK_M > 2:
            acc2 = _gemv_group(acc2, d2, xl2, xh2, s, z)
        if BLOCK_M > 3:
            acc3 = _gemv_group(acc3, d3, xl3, xh3, s, z)
    if SPLIT_K:
        part = part_ptr + pid_s * M * N + rn
        tl.store(part, acc0, mask=nmask)
        if BLOCK_M > 1:
            tl.store(part + N, acc1, mask=nmask)
        if BLOCK_M > 2:
            tl.store(part + 2 * N, acc2, mask=nmask)
        if BLOCK_M > 3:
            tl.store(part + 3 * N, acc3, mask=nmask)
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
        if BLOCK_M > 2:
            _gemv_store(acc2, 2, rn, nmask, out_ptr, stride_om, bias_ptr, HAS_BIAS)
        if BLOCK_M > 3:
            _gemv_store(acc3, 3, rn, nmask, out_ptr, stride_om, bias_ptr, HAS_BIAS)
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


def plan_int4_gemv(n: int, k: int, group_size: int = 128, device: Optional[torch.device] = None,
                   m: int = 1) -> Int4GemvConfig:
    """The launch :func:`int4_gemv` uses for ``m`` rows (``benchmarks/results/linear-h200-gemv.md``'s sweep of
    llama3.1-8b's shapes at one row on an H200: 8 word rows per load everywhere; 256 outputs per program up to
    8192 outputs and 512 above; as many groups per program as give :data:`GEMV_PROGRAMS_PER_SM` programs per SM,
    at most one group each). Three and four rows load 4 word rows at a time (their accumulators take the
    registers). ``device``: as :func:`plan_quant_matmul`."""
    num_warps = 2 if n <= 8192 else 4
    if n < 1024:
        num_warps = 1
    block_n = 128 * num_warps
    groups = k // group_size
    tiles = math.ceil(n / block_n)
    split = min(groups, max(1, math.ceil(GEMV_PROGRAMS_PER_SM * num_sms(device or torch.device("cpu")) / tiles)))
    return Int4GemvConfig(block_n, num_warps, min(8 if m <= 2 else 4, group_size // 8), split)


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
    n = _check_k_major(k, words, scales, zeros, group_size, "int4_gemv")
    x = x.contiguous()
    cfg = config or plan_int4_gemv(n, k, group_size, x.device, m)
    groups = k // group_size
    per_split = math.ceil(groups / cfg.split)
    split = math.ceil(groups / per_split)  # no empty split
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), split)
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = ticket_counters(x.device, grid[0])
    else:
        part = counters = out  # never read
    _int4_gemv_kernel[grid](
        x, words, scales, zeros, bias if bias is not None else scales, part, counters, out,
        m, n, groups, per_split, x.stride(0), out.stride(0),
        GROUP=group_size, BLOCK_M=m, BLOCK_N=cfg.block_n, ROWS=cfg.rows, SPLIT_K=split > 1, REDUCE_CHUNK=16,
        EVEN_N=n % cfg.block_n == 0, HAS_BIAS=bias is not None, ASM=not interpreting(), USE_PDL=use_pdl(x.device),
        num_warps=cfg.num_warps, launch_pdl=use_pdl(x.device),
    )
    return out


def _check_k_major(k: int, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                   owner: str) -> int:
    """Check an ``int4`` weight of ``k`` input features held as K-major words; returns its ``N``."""
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


# ----------------------------------------------------------------------------------------------------------------
# several rows of int4: tensor cores over the GEMV's words


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
    pid_n, pid_s, pid_m, rn, nmask, rm, mmask = _tile(M, N, BLOCK_M, BLOCK_N)
    j = tl.arange(0, WPG)
    r = tl.arange(0, GROUP)
    feature = (r % 8) * WPG + r // 8  # row r = 8 j + e of the reshaped tile holds nibble e of word row j
    g_start = pid_s * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, groups)
    w_ptrs = w_ptr + (g_start * WPG + j)[:, None] * N + rn[None, :]  # [WPG, BN], advanced one group at a time
    words = _word_tile(w_ptrs, nmask, True, EVEN_N)
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(g_start, g_end):
        w_ptrs += WPG * N
        next_words = _word_tile(w_ptrs, nmask, g + 1 < g_end, EVEN_N)
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
        s, z = _group_scale_zero(s_ptr, z_ptr, g, N, rn, nmask, EVEN_N)
        z += OFFSET16
        if SWAP_AB:
            acc += (d - z[:, None] * x_sum[None, :]) * s[:, None]
        else:
            acc += (d - x_sum[:, None] * z[None, :]) * s[None, :]
        words = next_words
    if SWAP_AB:
        acc = tl.trans(acc)  # [BM, BN]
    _store_tile(acc, rm, rn, mmask, nmask, M, N, stride_om, part_ptr, counter_ptr, bias_ptr, out_ptr, pid_s, pid_m,
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
    """``y = x @ w.T + bias`` for ``x`` ``[M, K]`` (bf16 / fp16 / fp32) and an ``int4`` weight held as
    :func:`int4_gemv`'s words (``[K // 8, N]`` int32), ``scales`` and ``zeros`` ``[K // group_size, N]``, on
    tensor cores; ``config`` overrides :func:`plan_int4_words_matmul`.

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
    n = _check_k_major(k, words, scales, zeros, group_size, "int4_words_matmul")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or plan_int4_words_matmul(m, n, k, group_size, x.device)
    if cfg.slabs and group_size // 8 < 16:
        raise ValueError(f"int4_words_matmul: slabs need group_size >= 128 (tl.dot's K >= 16), got {group_size}")
    x = x.contiguous()
    groups = k // group_size
    per_split = math.ceil(groups / cfg.split)
    split = math.ceil(groups / per_split)  # no empty split
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, cfg.block_m))
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = ticket_counters(x.device, grid[0] * grid[2])
    else:
        part = counters = out  # never read
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
# torch's int4 kernel (tinygemm), CUDA and bf16 only


def tinygemm_pack(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int = 128,
                  inner_k_tiles: Optional[int] = None,
                  high_nibble_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``int4`` weight (:mod:`questkv.ops.quant_reference` format) in ``_weight_int4pack_mm``'s layout.

    tinygemm computes ``w = (q - 8) * s + z'``; ours ``(q - z) * s``, so ``z' = (8 - z) * s`` (rounded to bf16).
    Its packer takes ``uint8 [N, K // 2]`` with element ``2j`` in the high nibble (torchao's order;
    ``high_nibble_first=False`` keeps ours, for a check of that order on the GPU).

    Returns:
        ``(packed, scales_and_zeros)``: the packer's output and ``[K // group_size, N, 2]`` bf16.
    """
    q = unpack_int4(qweight)  # [N, K]
    k = q.shape[1]
    if high_nibble_first:
        pairs = (q[:, 0::2] << 4) | q[:, 1::2]
    else:
        pairs = q[:, 0::2] | (q[:, 1::2] << 4)
    if inner_k_tiles is None:
        inner_k_tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
    packed = torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), inner_k_tiles)
    s = scales.float()
    scales_and_zeros = torch.stack((s, (8 - zeros.float()) * s), dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_and_zeros


def tinygemm_matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int = 128,
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` ``[M, K]`` bf16 through ``torch.ops.aten._weight_int4pack_mm`` → ``[M, N]`` bf16."""
    y = torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)
    return y if bias is None else y + bias
