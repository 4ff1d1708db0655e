"""Select kernel: top-K pages per (sequence, head) with forced sink / recent / current pages."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from questkv.ops.triton._common import check_last_dim_contiguous, check_shape, next_pow2

# Keys each thread holds, and the warp range: fewer warps make the block-wide reductions cheaper,
# more keys per thread cost registers (measured on an H200, docs/gpu-kernels.md).
_KEYS_PER_THREAD = 8
_MIN_WARPS, _MAX_WARPS = 4, 16


@triton.jit
def _select_pages_kernel(
    scores_ptr, lens_ptr, budgets_ptr, out_ptr,
    max_pages,
    stride_sb, stride_sh,
    stride_ob, stride_oh,
    PAGE_SIZE: tl.constexpr, BUDGET: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BUDGETS: tl.constexpr,
):
    """One program per (head, sequence): radix select of the ``BUDGET``-th largest key, then an
    order-preserving compaction (no sort).

    Each valid page gets a 32-bit key that orders like its score (forced pages score ``+inf``).
    Four 8-bit histogram passes find the threshold key ``T`` and how many pages equal to ``T`` still
    fit; pages above ``T`` and the first such ties (lowest index first) are kept, and an exclusive
    prefix sum writes their indices in ascending order: the reference's choice exactly. With
    ``HAS_BUDGETS`` the row picks ``budgets[seq] // PAGE_SIZE`` pages (at most ``BUDGET``).
    """
    head = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    num_pages = tl.cdiv(tl.load(lens_ptr + seq), PAGE_SIZE)
    i = tl.arange(0, BLOCK_N)
    valid = (i < max_pages) & (i < num_pages)
    score = tl.load(scores_ptr + seq * stride_sb + head * stride_sh + i, mask=valid, other=0.0)
    forced = valid & ((i < SINK) | (i >= num_pages - 1 - RECENT))
    score = tl.where(forced, float("inf"), tl.where(score == 0.0, 0.0, score))  # -0.0 ties +0.0
    bits = score.to(tl.int32, bitcast=True)
    key = (tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) ^ -2147483648).to(tl.uint32, bitcast=True)  # monotone

    row_budget = BUDGET
    if HAS_BUDGETS:
        row_budget = tl.minimum(tl.load(budgets_ptr + seq) // PAGE_SIZE, BUDGET)
    remaining = tl.minimum(tl.sum(valid.to(tl.int32), axis=0), row_budget)  # pages still to pick
    threshold = tl.zeros([], tl.uint32)
    match = valid
    bins = tl.arange(0, 256)
    for p in tl.static_range(4):
        digit = ((key >> (24 - 8 * p)) & 255).to(tl.int32)
        hist = tl.histogram(digit, 256, mask=match)
        above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)  # matching keys with a larger digit
        pick = tl.max(tl.where((above < remaining) & (above + hist >= remaining), bins, -1), axis=0)
        remaining -= tl.sum(tl.where(bins == pick, above, 0), axis=0)
        threshold = threshold | (pick.to(tl.uint32) << (24 - 8 * p))
        match = match & (digit == pick)

    tie = (valid & (key == threshold)).to(tl.int32)
    chosen = valid & ((key > threshold) | ((tie == 1) & (tl.cumsum(tie, axis=0) - tie < remaining)))
    flag = chosen.to(tl.int32)
    position = tl.cumsum(flag, axis=0) - flag
    row = out_ptr + seq * stride_ob + head * stride_oh
    tl.store(row + position, i, mask=chosen)
    j = tl.arange(0, BLOCK_K)
    tl.store(row + j, tl.full([BLOCK_K], -1, tl.int32), mask=(j >= tl.sum(flag, axis=0)) & (j < BUDGET))


def select_pages_into(
    out: torch.Tensor,
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    budget_pages: int,
    sink_pages: int = 0,
    recent_pages: int = 0,
    budgets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`select_pages` into a preallocated ``out`` ``[batch, num_sel_heads, budget_pages]``
    int32 (one launch, no host synchronisation). ``budgets``: ``[batch]`` int32 token budgets or
    ``None`` (see :mod:`questkv.ops.reference`). Returns ``out``."""
    batch, heads, max_pages = scores.shape
    check_shape("seq_lens", seq_lens, (batch,))
    check_shape("out", out, (batch, heads, budget_pages))
    if scores.dtype != torch.float32 or out.dtype != torch.int32:
        raise ValueError(f"scores must be float32 and out int32, got {scores.dtype} and {out.dtype}")
    if budget_pages < 1 or sink_pages < 0 or recent_pages < 0:
        raise ValueError(f"need budget_pages >= 1 and sink/recent >= 0, got {budget_pages}/{sink_pages}/{recent_pages}")
    check_last_dim_contiguous(scores=scores, out=out)
    if budgets is not None:
        check_shape("budgets", budgets, (batch,))
        if budgets.dtype != torch.int32:
            raise ValueError(f"budgets must be int32, got {budgets.dtype}")
    block_n = next_pow2(max_pages)
    num_warps = min(_MAX_WARPS, max(_MIN_WARPS, block_n // (32 * _KEYS_PER_THREAD)))
    _select_pages_kernel[(heads, batch)](
        scores, seq_lens, seq_lens if budgets is None else budgets, out,
        max_pages,
        scores.stride(0), scores.stride(1),
        out.stride(0), out.stride(1),
        PAGE_SIZE=page_size, BUDGET=budget_pages, SINK=sink_pages, RECENT=recent_pages,
        BLOCK_N=block_n, BLOCK_K=next_pow2(budget_pages), HAS_BUDGETS=budgets is not None,
        num_warps=num_warps,
    )
    return out


def select_pages(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    budget_pages: int,
    sink_pages: int = 0,
    recent_pages: int = 0,
    budgets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Triton :func:`questkv.ops.reference.select_pages`.

    Args:
        scores: ``[batch, num_sel_heads, max_pages]`` float32. seq_lens: ``[batch]`` int32.
        budgets: ``[batch]`` int32 token budgets, or ``None``.

    Returns:
        ``[batch, num_sel_heads, budget_pages]`` int32 logical pages, ascending, ``-1``-padded.
    """
    batch, heads, _ = scores.shape
    out = torch.empty((batch, heads, budget_pages), dtype=torch.int32, device=scores.device)
    return select_pages_into(out, scores, seq_lens, page_size, budget_pages, sink_pages, recent_pages, budgets)
