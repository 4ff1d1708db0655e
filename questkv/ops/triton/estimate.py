"""Estimate kernel: Quest page criticality from the query group and the page key bounds."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from questkv.ops import reference
from questkv.ops.reference import SelectBuffers
from questkv.ops.triton import select as _select
from questkv.ops.triton.select import _row_pages, _select_row
from questkv.ops.triton._common import (
    check_last_dim_contiguous,
    check_shape,
    interpreting,
    next_pow2,
    num_sms,
    use_pdl,
)

_MODE_Q_HEAD, _MODE_SUM, _MODE_MAX = 0, 1, 2
# Launch configuration (measured on an H200, docs/gpu-kernels.md): pages per block; blocks per
# program (a pipelined loop) once one block per program gives at least _MIN_PROGRAMS_PER_SM
# programs per SM, else 1; pipelining depth; warps.
_BLOCK_P = 64
_BLOCKS_PER_PROGRAM = 2
_MIN_PROGRAMS_PER_SM = 4
_NUM_STAGES = 2
_NUM_WARPS = 4
# the select constexprs of a launch without the fused select (none of them is read)
_NOT_FUSED = dict(FUSED_SELECT=False, BUDGET=1, SINK=0, RECENT=0, HAS_BUDGETS=False, BLOCK_N=1, BLOCK_K=1)


@triton.jit
def _store_page_scores(out_ptr, seq, head, rows, p, per_q, valid, in_row, gmask, stride_ob, stride_oh,
                       MODE: tl.constexpr):
    """Store one KV head's page scores ``per_q`` ``[BLOCK_G, BLOCK_P]`` (its query group's rows
    ``rows``, pages ``p``) into the score rows of sequence ``seq``: per query head (``MODE`` 0), or
    the group's sum (1) / max (2) in the KV head's row; ``-inf`` at pages past the sequence
    (``~valid``), nothing past the table (``~in_row``) or for padding query rows (``~gmask``).
    Shared by the bound estimate and the key-code estimate (:mod:`questkv.ops.triton.codes`)."""
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
def _page_scores_kernel(
    q_ptr, kmin_ptr, kmax_ptr, table_ptr, lens_ptr, out_ptr,
    budgets_ptr, counter_ptr, sel_ptr,
    max_pages,
    stride_qb, stride_qh,
    stride_bp, stride_bh,
    stride_tb,
    stride_ob, stride_oh,
    stride_sb, stride_sh,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, MODE: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCKS: tl.constexpr, NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr,
    FUSED_SELECT: tl.constexpr, BUDGET: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
    HAS_BUDGETS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program per (KV head, ``BLOCKS`` page blocks, sequence), heads fastest so that the
    programs reading one page's bounds (``num_kv_heads`` adjacent rows) run together; the loop over
    blocks is software-pipelined. The bounds of a block of pages are read
    once for every query head of the KV head's group, and the scores come from two matrix
    products on the tensor cores: ``max(q*lo, q*hi) = max(q, 0)*hi + min(q, 0)*lo`` element-wise,
    so ``score = max(q, 0) @ kmax^T + min(q, 0) @ kmin^T``. Splitting ``q`` by sign is exact in
    any float dtype and products accumulate in float32. With ``USE_PDL`` it waits for the kernels before
    it only at its first read, and lets the next kernel launch once its loop is done.

    With ``FUSED_SELECT`` the selection is fused in (``budgets_ptr``, ``counter_ptr``, ``sel_ptr`` and
    the ``stride_s*`` of the selection are read only then): after storing its scores, each program
    takes a ticket on the counter of its (sequence, KV head); the program that takes the last one
    (``num_programs(1)`` tickets: every page block of that KV head is then stored) reads the scores
    back from L2 and selects the rows of that KV head, exactly as the select kernel does
    (:func:`questkv.ops.triton.select._select_row`): one row in ``kv_head`` mode, the group's
    ``GROUP`` query-head rows one after another in ``q_head`` mode. It then resets the counter, so the
    next launch (a CUDA-graph replay) finds it at zero."""
    head = tl.program_id(0)
    pid_p = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    if USE_PDL:
        gdc_wait()
    num_pages = tl.cdiv(tl.load(lens_ptr + seq), PAGE_SIZE)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    g = tl.arange(0, BLOCK_G)
    gmask = g < GROUP
    rows = head * GROUP + g

    q = tl.load(q_ptr + seq * stride_qb + rows[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    zero = tl.zeros_like(q)
    q_pos = tl.maximum(q, zero).to(q.dtype)  # exact; Triton computes a 16-bit maximum in float32
    q_neg = tl.minimum(q, zero).to(q.dtype)

    for blk in tl.range(0, BLOCKS, num_stages=NUM_STAGES):
        p = (pid_p * BLOCKS + blk) * BLOCK_P + tl.arange(0, BLOCK_P)
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
        score = tl.dot(q_pos, tl.trans(hi), input_precision="ieee")
        score += tl.dot(q_neg, tl.trans(lo), input_precision="ieee")  # [BLOCK_G, BLOCK_P]
        _store_page_scores(out_ptr, seq, head, rows, p, score, valid, in_row, gmask, stride_ob, stride_oh, MODE)
    if USE_PDL:
        gdc_launch_dependents()  # the next kernel's griddepcontrol.wait still waits for the selection

    if FUSED_SELECT:
        counter = counter_ptr + seq * tl.num_programs(0) + head
        tl.debug_barrier()  # every thread's score stores happen before the (releasing) ticket
        if tl.atomic_add(counter, 1, sem="acq_rel") == tl.num_programs(1) - 1:
            _, to_pick = _row_pages(lens_ptr, budgets_ptr, seq, max_pages, PAGE_SIZE, BUDGET, HAS_BUDGETS)
            if MODE == 0:
                for r in range(GROUP):
                    row = head * GROUP + r
                    _select_row(out_ptr + seq * stride_ob + row * stride_oh, sel_ptr + seq * stride_sb + row * stride_sh,
                                num_pages, to_pick, max_pages, BUDGET, SINK, RECENT, BLOCK_N, BLOCK_K, ".cg")
            else:
                _select_row(out_ptr + seq * stride_ob + head * stride_oh, sel_ptr + seq * stride_sb + head * stride_sh,
                            num_pages, to_pick, max_pages, BUDGET, SINK, RECENT, BLOCK_N, BLOCK_K, ".cg")
            tl.atomic_xchg(counter, 0)


def _mode(selection: str, group_reduction: str) -> int:
    reference._check_mode(selection, group_reduction)
    if selection == "q_head":
        return _MODE_Q_HEAD
    return _MODE_SUM if group_reduction == "sum" else _MODE_MAX


def _launch(out, q, kmin, kmax, page_table, seq_lens, page_size, selection, group_reduction, fused=None) -> None:
    """Check the estimate's arguments and launch the kernel; ``fused`` (a dict: ``selected``,
    ``counters``, ``budgets``, ``budget_pages``, ``sink_pages``, ``recent_pages``, already checked)
    fuses the one-program select in."""
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
    group = num_q_heads // num_kv_heads
    blocks = triton.cdiv(max_pages, _BLOCK_P)
    per_program = _BLOCKS_PER_PROGRAM if num_kv_heads * blocks * batch >= _MIN_PROGRAMS_PER_SM * num_sms(q.device) else 1
    grid = (num_kv_heads, triton.cdiv(blocks, per_program), batch)
    num_warps = _NUM_WARPS
    extra = _NOT_FUSED
    selected = counters = budgets = out  # not read unless fused
    if fused is not None:
        selected, counters = fused["selected"], fused["counters"]
        budgets = seq_lens if fused["budgets"] is None else fused["budgets"]
        budget_pages = fused["budget_pages"]
        row = _select.row_launch(max_pages, budget_pages)
        num_warps = max(num_warps, row.pop("num_warps"))  # the select's warps, at least the estimate's
        extra = dict(FUSED_SELECT=True, BUDGET=budget_pages, SINK=fused["sink_pages"], RECENT=fused["recent_pages"],
                     HAS_BUDGETS=fused["budgets"] is not None, **row)
    _page_scores_kernel[grid](
        q, kmin, kmax, page_table, seq_lens, out,
        budgets, counters, selected,
        max_pages,
        q.stride(0), q.stride(1),
        kmin.stride(0), kmin.stride(1),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        selected.stride(0), selected.stride(1),
        PAGE_SIZE=page_size, GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=head_dim,
        BLOCK_P=_BLOCK_P, BLOCK_D=next_pow2(head_dim), MODE=mode,
        # float32 products when 16-bit operands would lose bits (or under the interpreter, whose
        # bf16 dot is wrong); 16-bit operands are exact as they are
        DOT_FP32=interpreting() or q.dtype == torch.float32 or q.dtype != kmin.dtype,
        BLOCKS=per_program, NUM_STAGES=_NUM_STAGES, USE_PDL=use_pdl(q.device),
        num_warps=num_warps, launch_pdl=use_pdl(q.device), **extra,
    )


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
    _launch(out, q, kmin, kmax, page_table, seq_lens, page_size, selection, group_reduction)
    return out


def estimate_select_counters(batch: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """Tickets of the fused estimate + select (:func:`estimate_select_into`): ``[batch, num_kv_heads]``
    int32 zeros, one per (sequence, KV head); every launch leaves them zero."""
    return torch.zeros((batch, num_kv_heads), dtype=torch.int32, device=device)


def fuses_select(batch: int, num_sel_heads: int, max_pages: int, split: Optional[bool] = None) -> bool:
    """Whether :func:`estimate_select_into` runs one fused launch for these shapes: exactly when the
    select would run its one-program-per-row kernel (:func:`questkv.ops.triton.select.takes_split_path`
    is false)."""
    return not _select.takes_split_path(batch, num_sel_heads, max_pages, split)


def estimate_select_into(
    scores: torch.Tensor,
    selected: torch.Tensor,
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    budget_pages: int,
    sink_pages: int = 0,
    recent_pages: int = 0,
    selection: str = "kv_head",
    group_reduction: str = "sum",
    budgets: Optional[torch.Tensor] = None,
    counters: Optional[torch.Tensor] = None,
    buffers: Optional[SelectBuffers] = None,
    split: Optional[bool] = None,
) -> torch.Tensor:
    """:func:`page_scores_into` then :func:`questkv.ops.triton.select_pages_into`, with the select
    fused into the estimate kernel where the one-program select applies (opt-in, unmeasured on a GPU).

    One launch when :func:`fuses_select` (``max_pages < _SPLIT_MIN_PAGES``, or more than
    ``_SPLIT_MAX_ROWS`` rows, or ``split=False``): the last estimate program of each (sequence, KV
    head) selects that KV head's rows. Otherwise the separate launches (estimate, then the split
    select). Same results as the separate ops, bit for bit. No host synchronisation. Returns ``selected``.

    Args:
        scores: ``[batch, num_sel_heads, max_pages]`` float32, written (as :func:`page_scores_into`).
        selected: ``[batch, num_sel_heads, budget_pages]`` int32, written (as ``select_pages_into``).
        q, kmin, kmax, page_table, seq_lens, page_size, selection, group_reduction: as :func:`page_scores`.
        budget_pages, sink_pages, recent_pages, budgets: as ``select_pages_into`` (``budgets``
            ``[batch]`` int32 token budgets or ``None``).
        counters: :func:`estimate_select_counters` ``[batch, num_kv_heads]`` int32, zero (every launch
            leaves them zero); allocated here when ``None`` (pass them for a CUDA graph).
        buffers, split: the split select's scratch and path choice, as ``select_pages_into``.
    """
    if scores.dim() != 3:
        raise ValueError(f"scores must be [batch, num_sel_heads, max_pages], got shape {tuple(scores.shape)}")
    batch, sel_heads, max_pages = scores.shape
    _select.check_select_args(selected, batch, sel_heads, seq_lens, budget_pages, sink_pages, recent_pages, budgets,
                              "selected")
    if not fuses_select(batch, sel_heads, max_pages, split):
        page_scores_into(scores, q, kmin, kmax, page_table, seq_lens, page_size, selection, group_reduction)
        return _select.select_pages_into(selected, scores, seq_lens, page_size, budget_pages, sink_pages,
                                         recent_pages, budgets, buffers, True)
    num_kv_heads = kmin.shape[1]
    if counters is None:
        counters = estimate_select_counters(batch, num_kv_heads, q.device)
    check_shape("counters", counters, (batch, num_kv_heads))
    if counters.dtype != torch.int32 or not counters.is_contiguous():
        raise ValueError(f"counters must be contiguous int32, got {counters.dtype}")
    fused = dict(selected=selected, counters=counters, budgets=budgets, budget_pages=budget_pages,
                 sink_pages=sink_pages, recent_pages=recent_pages)
    _launch(scores, q, kmin, kmax, page_table, seq_lens, page_size, selection, group_reduction, fused)
    return selected


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
