"""Weight-only quantized matmul on CUDA: one Triton kernel with two inner loops, and torch's int4 kernel.

Formats: :mod:`questkv.ops.quant_reference` (same signature as its ``quant_matmul``). The kernel reads the
packed weight as int32 words (8 int4 or 4 int8 values each) and never writes a dequantized weight:

* ``use_dot=False`` (small ``M``, a GEMV): each iteration of a program reads one group (``int8``: a chunk of
  :data:`INT8_CHUNK`) of ``block_n`` rows as a ``[block_n, words per group]`` tile, four consecutive words per
  thread (one 128-bit load) and, at ``M = 1``, several rows per thread so that each ``x`` value loaded serves
  them all. Every field becomes a float with one shift and one ``lop3`` (``_field16``: the field lands in the
  mantissa of 128.0, or 256.0 for ``int8``), then one FMA with its ``x``: three instructions per weight, the
  least a float-FMA GEMV can do (the H200 issues ~3.9 per weight at its HBM bandwidth). The offset and the
  zero point come off once per group: ``s * (sum((128 + q) * x) - (z + 128) * sum(x))``.
* ``use_dot=True`` (more rows, and prefill): per group, the integers ``q`` (exact in bf16 / fp16) go through
  ``tl.dot`` with the ``x`` tile (fp32 accumulation), then the same per-group scale and zero correction.

Both split the reduction over ``K`` across ``split_k`` programs per output tile (many programs for a GEMV on
132 SMs): each writes a float32 partial, and the last one to arrive (an ``acq_rel`` ticket per tile) sums the
partials in split order (deterministic), adds the bias, writes the output in ``x``'s dtype and resets its
ticket, so one launch does everything and graphs need no memset. The tickets live in one int32 buffer per
device shared by every launch: launches must not run concurrently on two streams.

``tinygemm_pack`` / ``tinygemm_matmul`` convert an ``int4`` weight for ``torch.ops.aten._weight_int4pack_mm``
(bf16 only), a second CUDA backend for the benchmark.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from questkv.ops.quant_reference import check_quant_args, unpack_int4
from questkv.ops.triton._common import interpreting, next_pow2, num_sms

__all__ = [
    "FMA_MAX_M",
    "QuantMatmulConfig",
    "plan_quant_matmul",
    "quant_matmul",
    "tinygemm_matmul",
    "tinygemm_pack",
]

FMA_MAX_M = 4
"""Rows of ``x`` up to which :func:`plan_quant_matmul` picks the FMA loop (above: the ``tl.dot`` loop)."""

INT8_CHUNK = 128
"""``int8`` (one scale per row) is reduced in chunks of this many input features, as ``int4`` in its groups."""

PROGRAMS_PER_SM = 4
"""Split-K aims at this many programs per SM."""

_MAGIC = tl.constexpr(0x4B000000)  # float32 2**23: its low mantissa bits take the integer field exactly


@dataclasses.dataclass(frozen=True)
class QuantMatmulConfig:
    """One launch's tiling. ``block_m`` rows of ``x`` and ``block_n`` outputs per program, one group (``int8``: a
    chunk of :data:`INT8_CHUNK`) per loop iteration; ``split_k`` programs share one output tile's reduction."""

    block_m: int
    block_n: int
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
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr,
    MAGIC16: tl.constexpr, OFFSET16: tl.constexpr, USE_ASM: tl.constexpr, X_PAIRS: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), split_k, cdiv(M, BLOCK_M))``; ``w_ptr`` int32 words ``[N, k_words]``;
    ``s_ptr`` / ``z_ptr`` ``[K // GROUP, N]`` (``BITS == 4``) or ``s_ptr`` ``[N]`` (``BITS == 8``, ``GROUP``
    the chunk); ``part_ptr`` float32 ``[split_k, M, N]``; ``counter_ptr`` one zeroed int32 per output tile."""
    EPW: tl.constexpr = 32 // BITS  # values per word
    WPG: tl.constexpr = GROUP // EPW  # words per group
    FIELD: tl.constexpr = (1 << BITS) - 1
    # int8 fields are two's complement: flipping bit 7 makes them q + 128, which the offset removes
    MAGIC: tl.constexpr = _MAGIC | (128 if BITS == 8 else 0)
    OFFSET: tl.constexpr = 8388608.0 + (128.0 if BITS == 8 else 0.0)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = rm < M
    kw_start = pid_s * words_per_split
    kw_end = tl.minimum(kw_start + words_per_split, k_words)
    e = tl.arange(0, EPW)
    shifts = e * BITS
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    if USE_DOT:
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # SWAP_AB's accumulator
        kk = tl.arange(0, GROUP)
        wi = tl.arange(0, WPG)
        for kw in range(kw_start, kw_end, WPG):
            words_idx = kw + wi  # [WPG]
            wmask = nmask[:, None]
            xmask = mmask[:, None]
            if not EVEN_K:
                wmask = wmask & (words_idx < kw_end)[None, :]
                xmask = xmask & (kw * EPW + kk < K)[None, :]
            words = tl.load(w_ptr + rn[:, None] * stride_wn + words_idx[None, :], mask=wmask, other=0)  # [BN, WPG]
            xt = tl.load(x_ptr + rm[:, None] * stride_xm + (kw * EPW + kk)[None, :], mask=xmask, other=0.0)
            fields = (words[:, :, None] >> shifts[None, None, :]) & FIELD  # [BN, WPG, EPW]
            if MAGIC16 != 0:
                # 16-bit floats straight from the bits: (field | MAGIC16) is OFFSET16 + q exactly (bf16: 128 + q,
                # fp16: 1024 + q); the zero-point correction below removes OFFSET16
                b = tl.reshape((fields | MAGIC16).to(tl.int16).to(xt.dtype, bitcast=True), [BLOCK_N, GROUP])
                a = xt
            else:
                q = tl.reshape((fields ^ MAGIC).to(tl.float32, bitcast=True) - OFFSET, [BLOCK_N, GROUP])
                if UPCAST or IEEE:
                    a = xt.to(tl.float32)
                    b = q
                else:
                    a = xt
                    b = q.to(xt.dtype)
            if BITS == 4:
                group = kw // WPG
                s = tl.load(s_ptr + group * stride_sg + rn, mask=nmask, other=0.0).to(tl.float32)  # [BN]
                z = tl.load(z_ptr + group * stride_sg + rn, mask=nmask, other=0.0).to(tl.float32)
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
        # One group (int8: chunk) per iteration: a [BLOCK_N, WPG] tile of words, each thread four consecutive
        # words of a row (one 128-bit load) and, at BLOCK_N > 32 * num_warps, several rows (x reused across them).
        # Field p of every word becomes the float OFFSET + q with one shift and one lop3 (_field16), then one FMA
        # with x[k] for that field; OFFSET and the zero point come off once per group through sum(x).
        # what _field16 adds to q; float32 x removes it from every field (exact), for float32's accuracy
        FIELD_OFFSET: tl.constexpr = 0.0 if IEEE else 128.0 if BITS == 4 else 384.0
        wi = tl.arange(0, WPG)
        rows = tl.arange(0, BLOCK_M)
        acc_w = tl.zeros([BLOCK_N, WPG], dtype=tl.float32)  # BLOCK_M == 1: reduced once, at the end
        w_ptrs = w_ptr + rn[:, None] * stride_wn + wi[None, :]  # [BN, WPG]
        wmask = nmask[:, None] & (kw_start + wi < kw_end)[None, :]
        next_words = tl.load(w_ptrs + kw_start, mask=wmask, other=0)
        for kw in range(kw_start, kw_end, WPG):
            words = next_words  # [BN, WPG], loaded one iteration ahead
            wmask = nmask[:, None] & (kw + WPG + wi < kw_end)[None, :]
            next_words = tl.load(w_ptrs + (kw + WPG), mask=wmask, other=0)
            q0 = _field16(words, 0, BITS, USE_ASM, IEEE)
            q1 = _field16(words, 1, BITS, USE_ASM, IEEE)
            q2 = _field16(words, 2, BITS, USE_ASM, IEEE)
            q3 = _field16(words, 3, BITS, USE_ASM, IEEE)
            if EPW == 8:
                q4 = _field16(words, 4, BITS, USE_ASM, IEEE)
                q5 = _field16(words, 5, BITS, USE_ASM, IEEE)
                q6 = _field16(words, 6, BITS, USE_ASM, IEEE)
                q7 = _field16(words, 7, BITS, USE_ASM, IEEE)
            if BITS == 4:
                group = kw // WPG
                s = tl.load(s_ptr + group * stride_sg + rn, mask=nmask, other=0.0).to(tl.float32)  # [BN]
                z = tl.load(z_ptr + group * stride_sg + rn, mask=nmask, other=0.0).to(tl.float32) + FIELD_OFFSET
            kidx = (kw + wi) * EPW  # [WPG] input feature of each word's field 0
            for i in tl.static_range(BLOCK_M):
                row = pid_m * BLOCK_M + i
                xmask = (kw + wi < kw_end) & (row < M)
                if X_PAIRS:  # bf16 x read as int32 pairs: half the loads, and each half is a float32 by a shift
                    xrow = x_ptr.to(tl.pointer_type(tl.int32)) + row * (stride_xm // 2) + kidx // 2
                    x0, x1 = _bf16_pair(tl.load(xrow, mask=xmask, other=0))
                    x2, x3 = _bf16_pair(tl.load(xrow + 1, mask=xmask, other=0))
                else:
                    xrow = x_ptr + row * stride_xm + kidx
                    x0 = tl.load(xrow, mask=xmask, other=0.0).to(tl.float32)  # [WPG]
                    x1 = tl.load(xrow + 1, mask=xmask, other=0.0).to(tl.float32)
                    x2 = tl.load(xrow + 2, mask=xmask, other=0.0).to(tl.float32)
                    x3 = tl.load(xrow + 3, mask=xmask, other=0.0).to(tl.float32)
                prod = q0 * x0[None, :] + q1 * x1[None, :] + q2 * x2[None, :] + q3 * x3[None, :]  # [BN, WPG]
                xs = x0 + x1 + x2 + x3
                if EPW == 8:
                    if X_PAIRS:
                        x4, x5 = _bf16_pair(tl.load(xrow + 2, mask=xmask, other=0))
                        x6, x7 = _bf16_pair(tl.load(xrow + 3, mask=xmask, other=0))
                    else:
                        x4 = tl.load(xrow + 4, mask=xmask, other=0.0).to(tl.float32)
                        x5 = tl.load(xrow + 5, mask=xmask, other=0.0).to(tl.float32)
                        x6 = tl.load(xrow + 6, mask=xmask, other=0.0).to(tl.float32)
                        x7 = tl.load(xrow + 7, mask=xmask, other=0.0).to(tl.float32)
                    prod += q4 * x4[None, :] + q5 * x5[None, :] + q6 * x6[None, :] + q7 * x7[None, :]
                    xs += x4 + x5 + x6 + x7
                if BITS == 4:
                    d = (prod - z[:, None] * xs[None, :]) * s[:, None]
                else:
                    d = prod - FIELD_OFFSET * xs[None, :]
                if BLOCK_M == 1:
                    acc_w += d
                else:
                    acc += tl.where(rows[:, None] == i, tl.sum(d, axis=1)[None, :], 0.0)
        if BLOCK_M == 1:
            acc += tl.sum(acc_w, axis=1)[None, :]

    if BITS == 8:
        s = tl.load(s_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        acc = acc * s[None, :]
    omask = mmask[:, None] & nmask[None, :]
    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    if SPLIT_K:
        part_off = rm[:, None] * N + rn[None, :]  # [BM, BN] inside one split's [M, N]
        tl.store(part_ptr + pid_s * M * N + part_off, acc, mask=omask)
        num_splits = tl.num_programs(1)
        counter = counter_ptr + pid_m * tl.num_programs(0) + pid_n
        tl.debug_barrier()  # every thread's partial stores happen before the (releasing) ticket
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for sp in range(0, num_splits):
                total += tl.load(part_ptr + sp * M * N + part_off, mask=omask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(counter, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _field16(words, pos: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr, EXACT: tl.constexpr):
    """The ``pos``-th ``BITS``-wide field ``q`` of every int32 word as an exact float32 ``offset + q``
    (``int4``: 128 + q, ``q`` in 0..15; ``int8``: 384 + q, ``q`` signed). The field is shifted to bits 16-19
    (``int4``) or 15-22 (``int8``), the mantissa bits of the float 128 (256) whose unit is 1, and the exponent
    ORed in (``int8``: and the sign bit flipped, making ``q + 128``). A small offset keeps ``(offset + q) * x``
    within float32 rounding of ``q * x`` (an offset of 2**23 would not). On a GPU one ``lop3`` does the mask and
    the exponent (``USE_ASM``; ptxas emits two for the same expression); the interpreter runs the expression.
    ``EXACT``: ``q`` itself (one more add), for float32 inputs."""
    if BITS == 4:
        shift: tl.constexpr = 16 - 4 * pos
        mask: tl.constexpr = 0x000F0000
        magic: tl.constexpr = 0x43000000
    else:
        shift: tl.constexpr = 15 - 8 * pos
        mask: tl.constexpr = 0x007F8000
        magic: tl.constexpr = 0x43C00000
    if shift > 0:
        moved = words << shift
    elif shift < 0:
        moved = words >> -shift
    else:
        moved = words
    if USE_ASM:
        if BITS == 4:  # (a & b) | c
            bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, 983040, 1124073472, 234;", "=r,r", [moved],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:  # (a & b) ^ c
            bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, 8355840, 1136656384, 106;", "=r,r", [moved],
                                             dtype=tl.int32, is_pure=True, pack=1)
    elif BITS == 4:
        bits = (moved & mask) | magic
    else:
        bits = (moved & mask) ^ magic
    value = bits.to(tl.float32, bitcast=True)
    if EXACT:
        value -= 128.0 if BITS == 4 else 384.0
    return value


@triton.jit
def _bf16_pair(pair):
    """Two bf16 values packed in an int32 (low half first) as two float32 tensors."""
    return (pair << 16).to(tl.float32, bitcast=True), (pair & -65536).to(tl.float32, bitcast=True)


def _group(method: str, group_size: int) -> int:
    return group_size if method == "int4" else INT8_CHUNK


def plan_quant_matmul(m: int, n: int, k: int, method: str, group_size: int = 128,
                      device: Optional[torch.device] = None, use_dot: Optional[bool] = None) -> QuantMatmulConfig:
    """The tiling :func:`quant_matmul` launches for ``x`` ``[m, k]`` and a weight of ``n`` outputs (not tuned on a
    GPU yet: ``benchmarks/linear.py`` times alternatives). ``device`` sets the SM count the split aims at (``None``
    or a CPU: an H200's 132); ``use_dot`` forces a loop (default: FMA up to :data:`FMA_MAX_M` rows)."""
    group = _group(method, group_size)
    if use_dot is None:
        use_dot = m > FMA_MAX_M
    if use_dot:
        block_m = min(max(16, next_pow2(m)), 64 if m <= 64 else 128)
        block_n = 64 if m <= 64 else 128
        num_warps, num_stages = 4, 3
        if m > 64:
            num_warps = 8
    else:
        block_m = next_pow2(m)
        num_warps, num_stages = 4, 2
        threads_per_row = group * (4 if method == "int4" else 8) // 32 // 4  # four words per thread
        rows_per_thread = 8 if m == 1 else 2 if m == 2 else 1  # more rows share x; more x rows need registers
        block_n = 32 * num_warps // threads_per_row * rows_per_thread
    iters = math.ceil(k / group)
    tiles = math.ceil(n / block_n) * math.ceil(m / block_m)
    split = 1
    if m <= 64:
        split = min(iters, max(1, math.ceil(PROGRAMS_PER_SM * num_sms(device or torch.device("cpu")) / tiles)))
    # swap_ab: the weight tile as the MMA's 64-row A operand and x as a narrow B (wgmma m64nBMk16) while M is small
    return QuantMatmulConfig(block_m, block_n, split, use_dot, num_warps, num_stages,
                             swap_ab=use_dot and block_m <= 64)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, size: int) -> torch.Tensor:
    """The device's zeroed tickets (at least ``size``; every launch leaves them zero)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < size:
        counters = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


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
    step_words = group * bits // 32
    iters = math.ceil(k_words / step_words)
    per_split = math.ceil(iters / cfg.split_k)
    split = math.ceil(iters / per_split)  # no empty split
    words_per_split = per_split * step_words
    even_k = k_words % step_words == 0
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, cfg.block_m))
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = _counters(x.device, grid[0] * grid[2])
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
        x.stride(0), words.stride(0), scales.stride(0) if method == "int4" else 0, out.stride(0),
        BITS=bits, GROUP=group, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT_K=split > 1, USE_DOT=cfg.use_dot,
        UPCAST=upcast, IEEE=x.dtype == torch.float32, EVEN_K=even_k, SWAP_AB=cfg.swap_ab,
        MAGIC16=magic16, OFFSET16=offset16, USE_ASM=not interpreting(),
        X_PAIRS=x.dtype == torch.bfloat16 and x.data_ptr() % 4 == 0 and x.stride(0) % 2 == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
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
