"""Select kernel: top-K pages per (sequence, head) with forced sink / recent / current pages."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from questkv.ops.triton._common import check_last_dim_contiguous, check_shape, next_pow2


@triton.jit
def _select_pages_kernel(
    scores_ptr, lens_ptr, out_ptr,
    max_pages,
    stride_sb, stride_sh,
    stride_ob, stride_oh,
    PAGE_SIZE: tl.constexpr, BUDGET: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program per (head, sequence): a bitonic top-``BLOCK_K`` over packed 64-bit keys, then a
    bitonic sort of the chosen page indices.

    Key of page ``i``: ``order(score) << 31 | (2**31 - 1 - i)``, where ``order`` maps float32 to a
    monotone non-negative integer; forced pages score ``+inf``; pages past the sequence get key
    ``-1``. One integer comparison then ranks valid before invalid, by score, ties to the lower
    index: the reference's order exactly.
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
    order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 2147483648  # in [0, 2**32)
    key = tl.where(valid, (order << 31) | (2147483647 - i).to(tl.int64), -1)
    top = tl.topk(key, BLOCK_K)  # descending
    j = tl.arange(0, BLOCK_K)
    chosen = tl.where((j < BUDGET) & (top >= 0), 2147483647 - (top & 2147483647), 2147483647)
    chosen = tl.sort(chosen)
    chosen = tl.where(chosen == 2147483647, -1, chosen)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + j, chosen.to(tl.int32), mask=j < BUDGET)


def select_pages_into(
    out: torch.Tensor,
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    budget_pages: int,
    sink_pages: int = 0,
    recent_pages: int = 0,
) -> torch.Tensor:
    """:func:`select_pages` into a preallocated ``out`` ``[batch, num_sel_heads, budget_pages]``
    int32 (one launch, no host synchronisation). Returns ``out``."""
    batch, heads, max_pages = scores.shape
    check_shape("seq_lens", seq_lens, (batch,))
    check_shape("out", out, (batch, heads, budget_pages))
    if scores.dtype != torch.float32 or out.dtype != torch.int32:
        raise ValueError(f"scores must be float32 and out int32, got {scores.dtype} and {out.dtype}")
    if budget_pages < 1 or sink_pages < 0 or recent_pages < 0:
        raise ValueError(f"need budget_pages >= 1 and sink/recent >= 0, got {budget_pages}/{sink_pages}/{recent_pages}")
    check_last_dim_contiguous(scores=scores, out=out)
    block_k = next_pow2(budget_pages)
    block_n = max(next_pow2(max_pages), block_k)
    _select_pages_kernel[(heads, batch)](
        scores, seq_lens, out,
        max_pages,
        scores.stride(0), scores.stride(1),
        out.stride(0), out.stride(1),
        PAGE_SIZE=page_size, BUDGET=budget_pages, SINK=sink_pages, RECENT=recent_pages,
        BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=min(16, max(4, block_n // 512)),
    )
    return out


def select_pages(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    budget_pages: int,
    sink_pages: int = 0,
    recent_pages: int = 0,
) -> torch.Tensor:
    """Triton :func:`questkv.ops.reference.select_pages`.

    Args:
        scores: ``[batch, num_sel_heads, max_pages]`` float32. seq_lens: ``[batch]`` int32.

    Returns:
        ``[batch, num_sel_heads, budget_pages]`` int32 logical pages, ascending, ``-1``-padded.
    """
    batch, heads, _ = scores.shape
    out = torch.empty((batch, heads, budget_pages), dtype=torch.int32, device=scores.device)
    return select_pages_into(out, scores, seq_lens, page_size, budget_pages, sink_pages, recent_pages)
