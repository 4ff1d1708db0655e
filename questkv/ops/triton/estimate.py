"""Estimate kernel: Quest page criticality from the query group and the page key bounds."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from questkv.ops.checks import check_active, check_mode
from questkv.ops.triton._common import (
    check_last_dim_contiguous,
    check_shape,
    interpreting,
    next_pow2,
    num_sms,
    use_pdl,
)

_MODE_Q_HEAD, _MODE_SUM, _MODE_MAX = 0, 1, 2
# Launch configuration (measured on an H200, docs/kernels.md): pages per block; blocks per
# program (a pipelined loop) once one block per program gives at least _MIN_PROGRAMS_PER_SM
# programs per SM, else 1; pipelining depth; warps. 32 pages per block is the fastest of the sweep at every point
# of llama3.1-8b (1.01-1.05x over 64) and of llama2-7b's 32 KV heads (11.5 against 12.9 µs at B=1/32k;
# benchmarks/results/kernel-sweep-h200*.md).
_BLOCK_P = 32
_BLOCKS_PER_PROGRAM = 2
_MIN_PROGRAMS_PER_SM = 4
_NUM_STAGES = 2
_NUM_WARPS = 4


@triton.jit
def _store_page_scores(out_ptr, seq, head, rows, p, per_q, valid, in_row, gmask, stride_ob, stride_oh,
                       MODE: tl.constexpr):
    """Store one KV head's page scores ``per_q`` ``[BLOCK_G, BLOCK_P]`` (its query group's rows
    ``rows``, pages ``p``) into the score rows of sequence ``seq``: per query head (``MODE`` 0), or
    the group's sum (1) / max (2) in the KV head's row; ``-inf`` at pages past the sequence
    (``~valid``), nothing past the table (``~in_row``) or for padding query rows (``~gmask``)."""
    if MODE == 0:
        tl.store(out_ptr + seq * stride_ob + rows[:, None] * stride_oh + p[None, :],
                 tl.where(valid[None, :], per_q, float("-inf")), mask=gmask[:, None] & in_row[None, :])
    else:
        if MODE == 1:
            combined = tl.sum(tl.where(gmask[:, None], per_q, 0.0), axis=0)
        else:
            combined = tl.max(tl.where(gmask[:, None], per_q, float("-inf")), axis=0)
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + p, tl.where(valid, combined, float("-inf")),
                 mask=in_row)


@triton.jit
def _score_block(q_pos, q_neg, kmin_ptr, kmax_ptr, table_ptr, out_ptr, seq, head, rows, p, d, dmask, gmask,
                 num_pages, max_pages, stride_bp, stride_bh, stride_tb, stride_ob, stride_oh,
                 MODE: tl.constexpr, DOT_FP32: tl.constexpr):
    """Score pages ``p`` (one block) of sequence ``seq`` for one KV head's query group (``q`` split by
    sign into ``q_pos`` and ``q_neg``) and store them (:func:`_store_page_scores`)."""
    in_row = p < max_pages
    valid = in_row & (p < num_pages)
    physical = tl.load(table_ptr + seq * stride_tb + p, mask=valid, other=0).to(tl.int64)
    bound = physical[:, None] * stride_bp + head * stride_bh + d[None, :]
    bmask = valid[:, None] & dmask[None, :]
    lo = tl.load(kmin_ptr + bound, mask=bmask, other=0.0)
    hi = tl.load(kmax_ptr + bound, mask=bmask, other=0.0)
    if DOT_FP32:
        lo = lo.to(tl.float32)
        hi = hi.to(tl.float32)
    else:  # (fp8 bounds under 16-bit queries: exact in the queries' dtype)
        lo = lo.to(q_pos.dtype)
        hi = hi.to(q_pos.dtype)
    score = tl.dot(q_pos, tl.trans(hi), input_precision="ieee")
    score += tl.dot(q_neg, tl.trans(lo), input_precision="ieee")  # [BLOCK_G, BLOCK_P]
    _store_page_scores(out_ptr, seq, head, rows, p, score, valid, in_row, gmask, stride_ob, stride_oh, MODE)


@triton.jit
def _store_past_pages(out_ptr, seq, head, rows, p, in_row, gmask, stride_ob, stride_oh, MODE: tl.constexpr):
    """Store ``-inf`` at pages ``p`` (all past the sequence) of the score rows :func:`_store_page_scores`
    would write."""
    if MODE == 0:
        tl.store(out_ptr + seq * stride_ob + rows[:, None] * stride_oh + p[None, :],
                 tl.full([rows.shape[0], p.shape[0]], float("-inf"), tl.float32), mask=gmask[:, None] & in_row[None, :])
    else:
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + p, tl.full([p.shape[0]], float("-inf"), tl.float32),
                 mask=in_row)


@triton.jit
def _page_scores_kernel(
    q_ptr, kmin_ptr, kmax_ptr, table_ptr, lens_ptr, active_ptr, out_ptr,
    max_pages,
    stride_qb, stride_qh,
    stride_bp, stride_bh,
    stride_tb,
    stride_ob, stride_oh,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, MODE: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCKS: tl.constexpr, NUM_STAGES: tl.constexpr, HAS_ACTIVE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per (KV head, ``BLOCKS`` page blocks, sequence), heads fastest so that the
    programs reading one page's bounds (``num_kv_heads`` adjacent rows) run together; the loop over
    blocks is software-pipelined. The bounds of a block of pages are read
    once for every query head of the KV head's group, and the scores come from two matrix
    products on the tensor cores: ``max(q*lo, q*hi) = max(q, 0)*hi + min(q, 0)*lo`` element-wise,
    so ``score = max(q, 0) @ kmax^T + min(q, 0) @ kmin^T``. Splitting ``q`` by sign is exact in
    any float dtype and products accumulate in float32. A program whose pages all lie past the
    sequence (up to ``max_pages``, the table width) only stores ``-inf``: no reads, no products, so
    the work follows each sequence's pages. With ``HAS_ACTIVE`` the program first reads its sequence's
    flag (``active[seq]``): when it is 0 the program returns before any other read or write. With ``USE_PDL``
    it waits for the kernels before it only at its first read (the flag's, or the length's), and lets
    the next kernel launch once its loop is done."""
    head = tl.program_id(0)
    pid_p = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    if USE_PDL:
        gdc_wait()
    if HAS_ACTIVE:
        if tl.load(active_ptr + seq) == 0:  # the sequence reuses its last selection: out[seq] stays as it is
            return
    g = tl.arange(0, BLOCK_G)
    gmask = g < GROUP
    rows = head * GROUP + g
    num_pages = tl.cdiv(tl.load(lens_ptr + seq), PAGE_SIZE)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    first = pid_p * BLOCKS * BLOCK_P  # the program's first page
    if first >= num_pages:  # every page of the program is past the sequence: -inf, no reads, no products
        for blk in tl.static_range(BLOCKS):
            p = first + blk * BLOCK_P + tl.arange(0, BLOCK_P)
            _store_past_pages(out_ptr, seq, head, rows, p, p < max_pages, gmask, stride_ob, stride_oh, MODE)
    else:
        q = tl.load(q_ptr + seq * stride_qb + rows[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        zero = tl.zeros_like(q)
        q_pos = tl.maximum(q, zero).to(q.dtype)  # exact; Triton computes a 16-bit maximum in float32
        q_neg = tl.minimum(q, zero).to(q.dtype)
        for blk in tl.range(0, BLOCKS, num_stages=NUM_STAGES):
            p = first + blk * BLOCK_P + tl.arange(0, BLOCK_P)
            _score_block(q_pos, q_neg, kmin_ptr, kmax_ptr, table_ptr, out_ptr, seq, head, rows, p, d, dmask, gmask,
                         num_pages, max_pages, stride_bp, stride_bh, stride_tb, stride_ob, stride_oh, MODE, DOT_FP32)
    if USE_PDL:
        gdc_launch_dependents()


def _mode(selection: str, group_reduction: str) -> int:
    check_mode(selection, group_reduction)
    if selection == "q_head":
        return _MODE_Q_HEAD
    return _MODE_SUM if group_reduction == "sum" else _MODE_MAX


def check_page_scores_args(
    out: torch.Tensor,
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    selection: str,
    group_reduction: str,
) -> tuple[int, int]:
    """The checks :func:`page_scores_into` makes on its arguments but ``active``;
    returns ``(mode, group)``: the kernel's ``MODE`` and the query heads per KV head."""
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
    return mode, num_q_heads // num_kv_heads


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
    active: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`page_scores` into a preallocated ``out`` ``[batch, num_sel_heads, max_pages]`` float32
    (one launch, no host synchronisation). Returns ``out``.

    Args:
        active: ``None`` (every sequence) or contiguous ``[batch]`` int32 on ``out``'s device: a sequence
            whose flag is 0 leaves its rows of ``out`` untouched (its programs exit after reading the flag).
    """
    batch, _, head_dim = q.shape
    num_kv_heads, max_pages = kmin.shape[1], page_table.shape[1]
    mode, group = check_page_scores_args(out, q, kmin, kmax, page_table, seq_lens, selection, group_reduction)
    if active is not None:
        check_active(active, batch, out.device)
    blocks = triton.cdiv(max_pages, _BLOCK_P)
    per_program = _BLOCKS_PER_PROGRAM if num_kv_heads * blocks * batch >= _MIN_PROGRAMS_PER_SM * num_sms(q.device) else 1
    grid = (num_kv_heads, triton.cdiv(blocks, per_program), batch)
    _page_scores_kernel[grid](
        q, kmin, kmax, page_table, seq_lens, seq_lens if active is None else active, out,
        max_pages,
        q.stride(0), q.stride(1),
        kmin.stride(0), kmin.stride(1),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        PAGE_SIZE=page_size, GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=head_dim,
        BLOCK_P=_BLOCK_P, BLOCK_D=next_pow2(head_dim), MODE=mode,
        # float32 products when 16-bit operands would lose bits (or under the interpreter, whose
        # bf16 dot is wrong); 16-bit operands are exact as they are
        DOT_FP32=(interpreting() or q.dtype == torch.float32
                  or q.dtype != kmin.dtype and kmin.dtype != torch.float8_e4m3fn),
        BLOCKS=per_program, NUM_STAGES=_NUM_STAGES, HAS_ACTIVE=active is not None, USE_PDL=use_pdl(q.device),
        num_warps=_NUM_WARPS, launch_pdl=use_pdl(q.device),
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
