"""A dense linear layer for one row (a decode step at batch 1) on CUDA: a split-K GEMV over ``nn.Linear``'s
row-major weight.

Same signature as :func:`questkv.ops.reference.linear`. One row of ``x`` and a weight of at most
:data:`GEMV_MAX_WEIGHT_BYTES` go through :func:`gemv`; anything else through the reference (cuBLAS).

:func:`gemv`: a program owns ``block_n`` outputs and a range of ``K``; per iteration it loads a ``[block_n,
block_k]`` weight tile (128-bit loads along ``K``), multiplies it by the matching ``x`` values in float32 and
accumulates element-wise, reducing over ``K`` once at the end. Each tile is loaded one iteration ahead, the first
before the programmatic-launch wait: the weight is never written on the device, so its stream starts while the
kernel before it finishes (only ``x`` is that kernel's). ``split`` programs share an output block's ``K`` when the
output blocks alone do not fill the GPU; each writes a float32 partial and the last to arrive sums them in split
order (deterministic), adds the bias, stores the row in ``x``'s dtype and resets its ticket, so one launch does
everything and a CUDA graph needs no memset.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from questkv.ops import reference
from questkv.ops.triton._common import (
    last_to_arrive,
    next_pow2,
    num_sms,
    reset_ticket,
    sum_split_partials,
    ticket_counters,
    use_pdl,
)

__all__ = ["GEMV_MAX_WEIGHT_BYTES", "GemvConfig", "gemv", "linear", "plan_gemv"]

GEMV_MAX_WEIGHT_BYTES = 64 * 2**20
"""Weights above this size stay with cuBLAS at one row. Llama-3.1-8B on an H200
(``benchmarks/results/linear-h200-bf16-gemv.md``): the GEMV beat cuBLAS on qkv (48 MiB: 14.5 against 15.8 µs) and o
(32 MiB: 11.2 against 13.3 with cuBLAS's split-K reduction kernel) but not on down (112 MiB: 30.3 against 30.5 at
its best tiling, 35.0 as planned then) or gate/up (224 MiB, where cuBLAS is at its bytes floor)."""

PROGRAMS_PER_SM = 1
"""A weight whose output blocks give fewer programs than this many per SM has its ``K`` split to reach it (qkv and
o above have 384 and 256 blocks on 132 SMs: no split, their fastest tiling in the run above)."""

_BLOCK_N = 16
_BLOCK_K = 512
_NUM_WARPS = 4
_REDUCE_CHUNK = 16


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, part_ptr, counter_ptr, out_ptr,
    N, K, stride_wn, k_per_split,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, REDUCE_CHUNK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), split)``: ``x_ptr`` one contiguous row ``[K]``,
    ``w_ptr`` ``[N, K]`` with row stride ``stride_wn``, ``part_ptr`` float32 ``[split, N]``, ``counter_ptr`` one
    zeroed int32 per output block, ``out_ptr`` ``[N]``. Split ``s`` reduces ``K`` columns ``[s * k_per_split, (s +
    1) * k_per_split)``; ``k_per_split`` is a multiple of ``BLOCK_K``. ``EVEN``: ``N`` and ``K`` are multiples of
    the blocks (no masks)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k_start + rk)[None, :]
    if EVEN:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=nmask[:, None] & (k_start + rk < k_end)[None, :], other=0.0)
    if USE_PDL:
        gdc_wait()
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        w_ptrs += BLOCK_K
        if EVEN:
            next_w = tl.load(w_ptrs, mask=k + BLOCK_K < k_end, other=0.0)
        else:
            next_w = tl.load(w_ptrs, mask=nmask[:, None] & (k + BLOCK_K + rk < k_end)[None, :], other=0.0)
        cols = k + rk
        if EVEN:
            x = tl.load(x_ptr + cols).to(tl.float32)
        else:
            x = tl.load(x_ptr + cols, mask=cols < k_end, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        w = next_w
    y = tl.sum(acc, axis=1)
    if SPLIT_K:
        tl.store(part_ptr + pid_s * N + rn, y, mask=nmask)
        counter = counter_ptr + pid_n
        splits = tl.num_programs(1)
        if last_to_arrive(counter, splits):
            y = sum_split_partials(part_ptr, N, rn, nmask, splits, REDUCE_CHUNK)
            if HAS_BIAS:
                y += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
            tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=nmask)
            reset_ticket(counter)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=nmask)
    if USE_PDL:
        gdc_launch_dependents()


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """One :func:`gemv` launch: ``block_n`` outputs and ``block_k`` input features per tile, ``split`` programs
    per output block (each a range of whole tiles)."""

    block_n: int
    block_k: int
    num_warps: int
    split: int


def plan_gemv(n: int, k: int, device: Optional[torch.device] = None) -> GemvConfig:
    """The launch :func:`gemv` uses for a weight ``[n, k]``: tiles of 16 outputs x 512 inputs (fewer for a
    narrower ``k``), 4 warps; ``K`` split only where the output blocks give fewer than :data:`PROGRAMS_PER_SM`
    programs per SM, then into as many ranges as reach it (at least one tile each)."""
    block_k = min(_BLOCK_K, max(16, next_pow2(k)))
    tiles = math.ceil(n / _BLOCK_N)
    sms = num_sms(device or torch.device("cpu"))
    split = min(math.ceil(k / block_k), max(1, math.ceil(PROGRAMS_PER_SM * sms / tiles)))
    return GemvConfig(_BLOCK_N, block_k, _NUM_WARPS, split)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
         config: Optional[GemvConfig] = None) -> torch.Tensor:
    """:func:`questkv.ops.reference.linear` for one row of ``x``, in one launch; ``config`` overrides
    :func:`plan_gemv`.

    Args:
        x: ``[1, K]``, last dimension contiguous.
        weight: ``[N, K]``, ``x``'s dtype, last dimension contiguous. bias: ``[N]`` or ``None``.

    Returns:
        ``[1, N]`` in ``x``'s dtype.
    """
    if weight.dim() != 2:
        raise ValueError(f"gemv: weight must be [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.dim() != 2 or tuple(x.shape) != (1, k):
        raise ValueError(f"gemv: x must be [1, {k}] for a weight of shape {(n, k)}, got shape {tuple(x.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"gemv: weight and bias must have x's dtype {x.dtype}, got {weight.dtype}"
                         f"{'' if bias is None else f' and {bias.dtype}'}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"gemv: bias must have shape ({n},), got {tuple(bias.shape)}")
    if weight.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError(f"gemv: x and weight must be contiguous in their last dimension, got strides "
                         f"{x.stride()} and {weight.stride()}")
    cfg = config or plan_gemv(n, k, x.device)
    tiles_k = math.ceil(k / cfg.block_k)
    per_split = math.ceil(tiles_k / cfg.split)
    split = math.ceil(tiles_k / per_split)  # no empty split
    grid = (triton.cdiv(n, cfg.block_n), split)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if split > 1:
        part = torch.empty((split, n), dtype=torch.float32, device=x.device)
        counters = ticket_counters(x.device, grid[0])
    else:
        part = counters = out  # never read
    _gemv_kernel[grid](
        x, weight, bias if bias is not None else weight, part, counters, out,
        n, k, weight.stride(0), per_split * cfg.block_k,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split > 1, HAS_BIAS=bias is not None,
        EVEN=n % cfg.block_n == 0 and k % cfg.block_k == 0, REDUCE_CHUNK=_REDUCE_CHUNK, USE_PDL=use_pdl(x.device),
        num_warps=cfg.num_warps, launch_pdl=use_pdl(x.device),
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`questkv.ops.reference.linear` on CUDA: one row and a weight of at most
    :data:`GEMV_MAX_WEIGHT_BYTES` through :func:`gemv`, the rest through the reference (cuBLAS)."""
    if x.dim() == 2 and x.shape[0] == 1 and weight.numel() * weight.element_size() <= GEMV_MAX_WEIGHT_BYTES:
        return gemv(x if x.stride(-1) == 1 else x.contiguous(), weight, bias)
    return reference.linear(x, weight, bias)
