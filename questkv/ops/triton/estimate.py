"""Estimate kernel: Quest page criticality from the query group and the page key bounds."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from questkv.config import GROUP_REDUCTIONS, SELECTIONS
from questkv.ops.triton._common import check_last_dim_contiguous, check_shape, next_pow2

_MODE_Q_HEAD, _MODE_SUM, _MODE_MAX = 0, 1, 2
_BLOCK_P = 32  # pages per program: 2 x 32 x 128 bound elements in flight per program
_NUM_WARPS = 4


@triton.jit
def _page_scores_kernel(
    q_ptr, kmin_ptr, kmax_ptr, table_ptr, lens_ptr, out_ptr,
    max_pages,
    stride_qb, stride_qh,
    stride_bp, stride_bh,
    stride_tb,
    stride_ob, stride_oh,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, MODE: tl.constexpr,
):
    """One program per (page block, KV head, sequence). The bounds of a block of pages are read
    once and scored against every query head of the KV head's group."""
    pid_p = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    num_pages = tl.cdiv(tl.load(lens_ptr + seq), PAGE_SIZE)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    in_row = p < max_pages
    valid = in_row & (p < num_pages)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM

    physical = tl.load(table_ptr + seq * stride_tb + p, mask=valid, other=0).to(tl.int64)
    bound = physical[:, None] * stride_bp + head * stride_bh + d[None, :]
    bmask = valid[:, None] & dmask[None, :]
    lo = tl.load(kmin_ptr + bound, mask=bmask, other=0.0).to(tl.float32)
    hi = tl.load(kmax_ptr + bound, mask=bmask, other=0.0).to(tl.float32)

    combined = tl.zeros([BLOCK_P], tl.float32) if MODE == 1 else tl.full([BLOCK_P], float("-inf"), tl.float32)
    for g in tl.static_range(GROUP):
        qh = head * GROUP + g
        qv = tl.load(q_ptr + seq * stride_qb + qh * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
        score = tl.sum(tl.maximum(qv[None, :] * lo, qv[None, :] * hi), axis=1)
        if MODE == 0:
            tl.store(out_ptr + seq * stride_ob + qh * stride_oh + p, tl.where(valid, score, float("-inf")), mask=in_row)
        elif MODE == 1:
            combined += score
        else:
            combined = tl.maximum(combined, score)
    if MODE != 0:
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + p, tl.where(valid, combined, float("-inf")), mask=in_row)


def _mode(selection: str, group_reduction: str) -> int:
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
    if group_reduction not in GROUP_REDUCTIONS:
        raise ValueError(f"group_reduction must be one of {GROUP_REDUCTIONS}, got {group_reduction!r}")
    if selection == "q_head":
        return _MODE_Q_HEAD
    return _MODE_SUM if group_reduction == "sum" else _MODE_MAX


def page_scores_into(
    out: torch.Tensor,
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    selection: str = "kv_head",
    group_reduction: str = "sum",
) -> torch.Tensor:
    """:func:`page_scores` into a preallocated ``out`` ``[batch, num_sel_heads, max_pages]`` float32
    (one launch, no host synchronisation). Returns ``out``."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = kmin.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    mode = _mode(selection, group_reduction)
    max_pages = page_table.shape[1]
    sel_heads = num_q_heads if mode == _MODE_Q_HEAD else num_kv_heads
    check_shape("kmin", kmin, (kmin.shape[0], num_kv_heads, head_dim))
    check_shape("kmax", kmax, kmin.shape)
    check_shape("page_table", page_table, (batch, max_pages))
    check_shape("seq_lens", seq_lens, (batch,))
    check_shape("out", out, (batch, sel_heads, max_pages))
    if out.dtype != torch.float32 or kmin.stride() != kmax.stride():
        raise ValueError("out must be float32 and kmin/kmax must share strides")
    check_last_dim_contiguous(q=q, kmin=kmin, page_table=page_table, out=out)
    grid = (triton.cdiv(max_pages, _BLOCK_P), num_kv_heads, batch)
    _page_scores_kernel[grid](
        q, kmin, kmax, page_table, seq_lens, out,
        max_pages,
        q.stride(0), q.stride(1),
        kmin.stride(0), kmin.stride(1),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        PAGE_SIZE=page_size, GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_P=_BLOCK_P, BLOCK_D=next_pow2(head_dim), MODE=mode,
        num_warps=_NUM_WARPS,
    )
    return out


def page_scores(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    selection: str = "kv_head",
    group_reduction: str = "sum",
) -> torch.Tensor:
    """Triton :func:`questkv.ops.reference.page_scores`.

    Args:
        q: ``[batch, num_q_heads, head_dim]``. kmin, kmax: ``[num_pages, num_kv_heads, head_dim]``.
        page_table: ``[batch, max_pages]`` int32. seq_lens: ``[batch]`` int32.

    Returns:
        ``[batch, num_sel_heads, max_pages]`` float32, ``-inf`` past each sequence's pages.
    """
    sel_heads = q.shape[1] if selection == "q_head" else kmin.shape[1]
    out = torch.empty((q.shape[0], sel_heads, page_table.shape[1]), dtype=torch.float32, device=q.device)
    return page_scores_into(out, q, kmin, kmax, page_table, seq_lens, page_size, selection, group_reduction)
