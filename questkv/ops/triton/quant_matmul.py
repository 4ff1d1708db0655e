"""Weight-only ``int8`` and ``int8_grouped`` matmul on CUDA: one Triton kernel with two inner loops, and the float
weight written in one launch for prefill.

Formats: :mod:`questkv.ops.quant_reference` (:func:`quant_matmul` has its ``quant_matmul``'s signature). ``int4``
is not read here: a layer holds its codes as K-major words, multiplied by :mod:`questkv.ops.triton.int4_gemv`
and :mod:`questkv.ops.triton.int4_words` (this kernel's ``int4`` loops over the checkpoint layout were removed:
they were the fastest at no row count, ``benchmarks/results/linear-h200-words-final.md``). Which of these a
layer takes for how many rows: :mod:`questkv.ops.triton.quant_ops`.

The kernel reads the packed weight as int32 words (4 int8 values each) and never writes a dequantized weight.
``int8`` has one scale per row, applied once at the end, and is reduced in chunks of :data:`INT8_CHUNK` as if they
were groups; ``int8_grouped`` applies a scale per group:

* ``use_dot=False`` (small ``M``, a GEMV): each program loads a ``[BLOCK_N, groups_per_iter, words per group]``
  tile of words (128-bit loads along ``K``), turns every 8-bit field into a float with a shift, one ``lop3`` and
  one add (``(field ^ 0x4B000080)`` is the float ``2**23 + 128 + q``, exact), multiplies by ``x`` in float32 and
  reduces each group; a group's scale applies once per group (``int8_grouped``: ``s * sum(q * x)``).
* ``use_dot=True`` (more rows): the integers ``q`` (exact in bf16 / fp16) go through ``tl.dot`` with the ``x``
  tile (fp32 accumulation). ``int8_grouped``'s groups (16 or 32) are too short for one dot each: the codes of
  :data:`DOT_CHUNK` input features are multiplied by their groups' scales in float32, rounded once to ``x``'s dtype
  (as :func:`dequantize` rounds) and go through one dot.

Both split the reduction over ``K`` across ``split_k`` programs per output tile (many programs for a GEMV on
132 SMs): each writes a float32 partial, and the last one to arrive (an ``acq_rel`` ticket per tile) sums the
partials in split order (deterministic), adds the bias, writes the output in ``x``'s dtype and resets its
ticket, so one launch does everything and graphs need no memset. The tickets live in one int32 buffer per
device shared by every launch: launches must not run concurrently on two streams.

Prefill multiplies by the float weight: :func:`dequantize` writes it in one launch (the reference's values, float32
math and one rounding) for one GEMM, whose cost the prompt's rows share.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from questkv.ops.quant_reference import check_quant_args
from questkv.ops.triton._common import interpreting, next_pow2, num_sms, split_reduction
from questkv.ops.triton.quant_tiles import PROGRAMS_PER_SM, program_tile, store_tile
from questkv.validation import check_choice

__all__ = [
    "DEQUANT_BLOCK",
    "FMA_MAX_M",
    "METHODS",
    "QuantMatmulConfig",
    "dequantize",
    "plan_quant_matmul",
    "quant_matmul",
]

METHODS: tuple[str, ...] = ("int8", "int8_grouped")
"""The formats this module reads (``int4``: :mod:`questkv.ops.triton.int4_words`)."""

FMA_MAX_M = {"int8": 1, "int8_grouped": 1}
"""Per format, the rows of ``x`` up to which :func:`plan_quant_matmul` picks the FMA loop (above: the ``tl.dot``
loop): one row for both. ``int8_grouped``: its groups of 16 or 32 make the FMA loop reduce and scale every group
per row, 11.3 ms over the 8B's linears at 4 rows on an H200 against 5.9 ms for the dot loop at 16 rows
(``benchmarks/results/linear-int8g-h200.md``). ``int8``: at 2 / 3 / 4 rows the FMA loop took 4.50 / 7.86 / 8.19 ms
over the 8B's linears (LM head int8) on an H100 (``linear-h100-int8-small-sweep.md``), the dot loop 4.09 / 4.07 /
4.04 (``linear-h100-int8-dot.md``; bf16: 5.40)."""

INT8_CHUNK = 128
"""``int8`` (one scale per row) is reduced in chunks of this many input features, as ``int8_grouped`` in its
groups."""

DOT_CHUNK = 64
"""Input features per ``tl.dot`` of the ``int8_grouped`` loop (its groups of 16 or 32 are scaled into the weight
tile first)."""

_MAGIC = tl.constexpr(0x4B000080)  # float32 2**23 + 128: an int8 field with bit 7 flipped is q + 128 in its low bits
_OFFSET = tl.constexpr(8388608.0 + 128.0)


@dataclasses.dataclass(frozen=True)
class QuantMatmulConfig:
    """One launch's tiling. ``block_m`` rows of ``x`` and ``block_n`` outputs per program; ``groups_per_iter``
    groups (``int8``: chunks of :data:`INT8_CHUNK`) per loop iteration (with ``use_dot``: 1 for ``int8``, whose
    dot takes one chunk); ``split_k`` programs share one output tile's reduction."""

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
    x_ptr, w_ptr, s_ptr, bias_ptr, part_ptr, counter_ptr, out_ptr,
    M, N, K, k_words, words_per_split,
    stride_xm, stride_wn, stride_sg, stride_om,
    GROUP: tl.constexpr, GROUP_SCALES: tl.constexpr, GROUPS_PER_ITER: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), split_k, cdiv(M, BLOCK_M))``; ``w_ptr`` int32 words ``[N, k_words]`` (4 int8
    codes each); ``s_ptr`` ``[K // GROUP, N]`` with ``GROUP_SCALES`` (``int8_grouped``), else ``[N]`` (``int8``,
    ``GROUP`` the chunk); ``part_ptr`` float32 ``[split_k, M, N]``; ``counter_ptr`` one zeroed int32 per output
    tile."""
    WPG: tl.constexpr = GROUP // 4  # words per group
    pid_n, pid_s, pid_m, rn, nmask, rm, mmask = program_tile(M, N, BLOCK_M, BLOCK_N)
    kw_start = pid_s * words_per_split
    kw_end = tl.minimum(kw_start + words_per_split, k_words)
    shifts = tl.arange(0, 4) * 8
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    if USE_DOT:
        # int8: one chunk per iteration; int8_grouped: GROUPS_PER_ITER small groups, each scaled into the weight
        # tile before one wider tl.dot
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
                xmask = xmask & (kw * 4 + kk < K)[None, :]
            words = tl.load(w_ptr + rn[:, None] * stride_wn + words_idx[None, :], mask=wmask, other=0)  # [BN, CW]
            xt = tl.load(x_ptr + rm[:, None] * stride_xm + (kw * 4 + kk)[None, :], mask=xmask, other=0.0)
            fields = (words[:, :, None] >> shifts[None, None, :]) & 255  # [BN, CW, 4]
            q = tl.reshape((fields ^ _MAGIC).to(tl.float32, bitcast=True) - _OFFSET, [BLOCK_N, CHUNK])
            if GROUP_SCALES:  # w = q * s, rounded once to x's dtype (as dequantize)
                group = kw // WPG + tl.arange(0, GROUPS_PER_ITER)  # [G]
                smask = nmask[:, None]
                if not EVEN_K:
                    smask = smask & (group * WPG < kw_end)[None, :]
                s = tl.load(s_ptr + group[None, :] * stride_sg + rn[:, None], mask=smask, other=0.0).to(tl.float32)
                q = tl.reshape(tl.reshape(q, [BLOCK_N, GROUPS_PER_ITER, GROUP]) * s[:, :, None], [BLOCK_N, CHUNK])
            if UPCAST or IEEE:
                a = xt.to(tl.float32)
                b = q
            else:
                a = xt
                b = q.to(xt.dtype)
            if SWAP_AB:  # the weight tile is the MMA's A operand (rows = outputs), x the narrow B
                if UPCAST or IEEE:
                    acc_t += tl.dot(b, tl.trans(a), input_precision="ieee")  # [BN, BM]
                else:
                    acc_t += tl.dot(b, tl.trans(a))
            else:
                if UPCAST or IEEE:
                    acc += tl.dot(a, tl.trans(b), input_precision="ieee")  # [BM, BN]
                else:
                    acc += tl.dot(a, tl.trans(b))
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
        e = tl.arange(0, 4)
        for kw in range(kw_start, kw_end, STEP):
            words = next_words  # [BN, G, WPG], loaded one iteration ahead
            wmask = nmask[:, None, None] & (kw + STEP + word_off < kw_end)[None, :, :]
            next_words = tl.load(w_ptrs + (kw + STEP), mask=wmask, other=0)
            words_idx = kw + word_off  # [G, WPG]
            kidx = words_idx[:, :, None] * 4 + e[None, None, :]  # [G, WPG, 4] input feature of each value
            # one float tensor per field position, each in the words' own layout (no [.., 4] axis to reduce)
            q0 = _field(words, 0)
            q1 = _field(words, 1)
            q2 = _field(words, 2)
            q3 = _field(words, 3)
            if GROUP_SCALES:
                group = kw // WPG + g  # [G]
                smask = nmask[:, None]
                if not EVEN_K:
                    smask = smask & (group * WPG < kw_end)[None, :]
                s = tl.load(s_ptr + group[None, :] * stride_sg + rn[:, None], mask=smask, other=0.0).to(tl.float32)
            for i in tl.static_range(BLOCK_M):
                row = pid_m * BLOCK_M + i
                xmask = (kidx < K) & (row < M)
                xv = tl.load(x_ptr + row * stride_xm + kidx, mask=xmask, other=0.0).to(tl.float32)  # [G, WPG, 4]
                # x of field position p: split the 4-axis by its bits (p = 2b + c)
                xb0, xb1 = tl.split(tl.reshape(xv, [GROUPS_PER_ITER, WPG, 2, 2]))  # b = 0 / 1
                x0, x2 = tl.split(xb0)
                x1, x3 = tl.split(xb1)
                d = tl.sum(q0 * x0[None] + q1 * x1[None] + q2 * x2[None] + q3 * x3[None], axis=2)  # [BN, G]
                if GROUP_SCALES:
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
    store_tile(acc, rm, rn, mmask, nmask, M, N, stride_om, part_ptr, counter_ptr, bias_ptr, out_ptr, pid_s, pid_m,
               pid_n, SPLIT_K, HAS_BIAS)


@triton.jit
def _field(words, pos: tl.constexpr):
    """The ``pos``-th signed 8-bit field of every int32 word, as an exact float32."""
    return (((words >> (pos * 8)) & 255) ^ _MAGIC).to(tl.float32, bitcast=True) - _OFFSET


def _group(method: str, group_size: int) -> int:
    """The ``K`` the kernel reduces before a scale applies: ``method``'s group (``int8``: :data:`INT8_CHUNK`)."""
    return INT8_CHUNK if method == "int8" else group_size


def plan_quant_matmul(m: int, n: int, k: int, method: str, group_size: int = 128,
                      device: Optional[torch.device] = None, use_dot: Optional[bool] = None) -> QuantMatmulConfig:
    """The tiling :func:`quant_matmul` launches for ``x`` ``[m, k]`` and a weight of ``n`` outputs in ``method``
    (one of :data:`METHODS`; not tuned on a GPU yet: ``benchmarks/linear_bench.py`` times alternatives). ``device``
    sets the SM count the split aims at (``None`` or a CPU: an H200's 132); ``use_dot`` forces a loop (default: FMA
    up to :data:`FMA_MAX_M` rows)."""
    check_choice("plan_quant_matmul method", method, METHODS)
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
    signature; ``method`` one of :data:`METHODS`), in one launch; ``config`` overrides :func:`plan_quant_matmul`.

    Args:
        x: ``[M, K]`` bf16 / fp16 / fp32, last dimension contiguous.
        qweight, scales, zeros, method, group_size: the weight (contiguous; ``zeros`` ``None``).
        bias: ``[N]`` or ``None``.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    check_choice("quant_matmul (triton) quantization", method, METHODS)
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
    group = _group(method, group_size)
    words = qweight.view(torch.int32)  # [N, K // 4] little-endian words
    k_words = k // 4
    step_words = cfg.groups_per_iter * group // 4
    iters = math.ceil(k_words / step_words)
    tiles_n, tiles_m = triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m)
    per_split, split, part, counters = split_reduction(iters, cfg.split_k, out, tiles_n * tiles_m, placeholder=out)
    words_per_split = per_split * step_words
    grid = (tiles_n, split, tiles_m)
    _quant_matmul_kernel[grid](
        x, words, scales, bias if bias is not None else scales, part, counters, out,
        m, n, k, k_words, words_per_split,
        x.stride(0), words.stride(0), scales.stride(0) if method != "int8" else 0, out.stride(0),
        GROUP=group, GROUP_SCALES=method != "int8", GROUPS_PER_ITER=cfg.groups_per_iter, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT_K=split > 1, USE_DOT=cfg.use_dot,
        # the interpreter's bf16 dot is wrong (fp16's is right): float32 operands there
        UPCAST=interpreting() and x.dtype == torch.bfloat16, IEEE=x.dtype == torch.float32,
        EVEN_K=k_words % step_words == 0, SWAP_AB=cfg.swap_ab,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# prefill: the float weight, written once per call for one GEMM

DEQUANT_BLOCK = (64, 256)
""":func:`dequantize`'s tile: output rows x input features per program."""


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, out_ptr, N, K, stride_qn, stride_sg, stride_on,
                       GROUP: tl.constexpr, GROUP_SCALES: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK_N), cdiv(K, BLOCK_K))``: ``out[n, k] = q * s`` (``int8``: ``s[n]``; ``int8_grouped``:
    ``s[k // GROUP, n]``) in float32, rounded once to ``out``'s dtype. ``q_ptr``: int8 ``[N, K]``; ``s_ptr``:
    ``[K // GROUP, N]`` (``int8``: ``[N]``)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    q = tl.load(q_ptr + rn[:, None] * stride_qn + rk[None, :], mask=mask, other=0).to(tl.float32)
    if GROUP_SCALES:
        sg = (rk // GROUP)[None, :] * stride_sg + rn[:, None]  # [BN, BK]: every feature's group
        w = q * tl.load(s_ptr + sg, mask=mask, other=0.0).to(tl.float32)
    else:
        w = q * tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rn[:, None] * stride_on + rk[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], method: str,
               group_size: int = 128, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton :func:`questkv.ops.quant_reference.dequantize` for ``method`` in :data:`METHODS` (``zeros``
    ``None``): the float weight ``[N, K]`` in ``dtype`` (float32 math, one rounding: the reference's values), in
    one launch that reads the packed weight once and writes the float one once."""
    check_choice("dequantize (triton) quantization", method, METHODS)
    if zeros is not None:
        raise ValueError(f"dequantize (triton): zeros must be None for {method} (symmetric)")
    qweight, scales = qweight.contiguous(), scales.contiguous()  # no-ops for a layer's buffers
    n, k = qweight.shape
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    if n == 0 or k == 0:
        return out
    block_n, block_k = DEQUANT_BLOCK
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight, scales, out, n, k, qweight.stride(0), scales.stride(0) if method != "int8" else 0, out.stride(0),
        GROUP=group_size, GROUP_SCALES=method != "int8", BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        enable_fp_fusion=False,
    )
    return out
