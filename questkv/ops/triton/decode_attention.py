"""Split-KV (flash-decoding) paged decode attention over selected pages or over all pages, of each sequence's last
query or of its last few (a lossless verify step: the query group's heads times the positions share each K/V tile)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from questkv.ops.checks import check_row_budgets
from questkv.ops.pages import AttentionBuffers
from questkv.ops.triton._common import (
    block_scores,
    check_e4m3_pairs,
    check_last_dim_contiguous,
    check_shape,
    interpreting,
    last_to_arrive,
    load_e4m3_as_f16,
    next_pow2,
    num_sms,
    online_softmax_step,
    reset_ticket,
    split_query_e4m3,
    use_pdl,
)

_LOG2E = 1.4426950408889634
# Launch configuration per kind of grid (grid_kind; measured on an H200, benchmarks/results/kernel-sweep-h200.md):
# keys per inner iteration (whole pages), programs per SM the split count aims at (rounded down so the grid fits
# one wave), and software-pipelining depth. A dense grid of at most _FEW_PROGRAMS (sequence, KV head) pairs takes
# longer splits: 40.6 against 42.1 µs at B=1/32k and 129.8 against 130.3 at B=1/128k (8 KV heads), where B=8
# (64 pairs) keeps the shorter ones (243.7 against 247.5). A sparse program's K/V tile takes 72 KiB of shared
# memory, so an H200 SM holds 3 of them: aiming at 8 gave MHA's 32 heads at B=1 17 splits of 8 pages (1.37 waves),
# 3 gives 9 splits of 16 in one wave (benchmarks/results/e2e-h200-int4-head-splits3.md against -splits8.md: Quest
# at C = 8 2.94 -> 2.89 ms, B=4/128k 5.84 -> 5.67; no point slower). A dense grid on fp8 pages takes tiles of 128
# keys in 2 stages, 3 programs per SM (its float16 value staging makes a fourth not fit; kernel-sweep-h100-fp8.md:
# 230 -> 209 µs at llama3.1-8b B=8/32k, the best of 48 configurations, and 883 -> 880 at B=32/32k, 2 % off the best).
# A verify step's multi-query grid on model-dtype pages aims at 2 programs per SM in 3 stages, with 128 keys per
# iteration where its tile has at most 32 rows (positions x the query group) and 64 keys at 64 rows
# (benchmarks/verify_attention.py --sweep on an H200 and an H100, verify-attention-h200-tiles.md and -h100-tiles.md:
# faster than the dense grids' entries at 3, 5 and 9 queries of llama3.1-8b at B=16/32k on both GPUs, e.g. 5 queries
# 624 -> 516 µs on the H200, and at B=1/32k, 9 queries 73 -> 54 µs; within 1.3 % of them at B=1 with 5 queries).
_CONFIG = {"dense": (64, 4, 3), "dense-few": (128, 2, 2), "sparse": (128, 3, 2), "dense-fp8": (64, 4, 2),
           "sparse-fp8": (128, 2, 2),
           "verify": (128, 2, 3), "verify-64": (64, 2, 3)}
_FEW_PROGRAMS = 16
_NUM_WARPS = 4
# Splits combined per step of the merge. The wide chunk takes up to 32 splits in one step but costs
# registers (207 against 128 per thread at a group of 4 query heads in an sm_90 compile; a group of 8
# spills), so it serves grids of at most _WIDE_MERGE_PROGRAMS_PER_SM programs per SM, where no more
# would be resident anyway (an H200 at B=1, 32 / 8 heads, 129 selected pages: 9.7 -> 8.3 µs).
_MERGE_CHUNK = 16
_WIDE_MERGE_CHUNK = 32
_WIDE_MERGE_PROGRAMS_PER_SM = 2
_WIDE_MERGE_MAX_GROUP = 4
# Rows of one program's query block with several queries per sequence (positions x the query group): up to this
# many share each K/V tile; more queries take more blocks, each reading the keys again. A tile of 16 rows is the
# smallest tl.dot, so a group of 4 verifies 4 positions in the rows a one-query step pads. Warps per program by the
# tile's padded rows: 4 at every size. Measured on an H200 (benchmarks/results/verify-attention-h200-sweep.md), a
# 64-row tile (9 or 17 queries of a group of 4) runs faster with 4 warps than with 8 at every point, e.g. 9 queries
# at llama3.1-8b B=16/32k in 600 µs against 808.
_MAX_QUERY_ROWS = 64
_WARPS_BY_ROWS = {16: _NUM_WARPS, 32: _NUM_WARPS, 64: _NUM_WARPS}


@triton.jit
def _decode_split_kernel(
    q_ptr, k_pages_ptr, v_pages_ptr, table_ptr, lens_ptr, sel_ptr, budgets_ptr, part_out_ptr, part_lse_ptr,
    counter_ptr, out_ptr,
    qk_scale, num_items, items_per_split, selection_cols, num_q_heads,
    stride_qb, stride_qq, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_tb,
    stride_sb, stride_sh,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oq, stride_oh,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GM: tl.constexpr, SEL_PER_KV: tl.constexpr,
    NUM_QUERIES: tl.constexpr, QUERY_BLOCK: tl.constexpr,
    PAGES_PER_ITER: tl.constexpr, MERGE_CHUNK: tl.constexpr, DENSE: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr, USE_PDL: tl.constexpr, F16_DOT: tl.constexpr = False, ROW_BUDGETS: tl.constexpr = False,
    E4M3_DOT: tl.constexpr = False,
):
    """One program per (split, query block x selection head, sequence) attends a contiguous chunk of the page
    list (the selection row, or every page when ``DENSE``) for the ``GROUP`` query heads that share
    the selection head, at the ``QUERY_BLOCK`` positions of its block (of the sequence's last ``NUM_QUERIES``;
    row ``r`` of the tile is position ``r // GROUP``, head ``r % GROUP``; a position sees keys up to itself);
    each K/V page is loaded once for all of them. It writes the chunk's normalised output per row and base-2
    log-sum-exp (``-inf`` for an empty chunk; partial row ``position * num_q_heads + head``), then takes a
    ticket; the program that takes the last ticket of its (sequence, query block, selection head) merges all
    splits into ``out`` and resets the counter for the next launch (one launch per step, no separate merge kernel).
    With ``ROW_BUDGETS`` a row reads only the first ``budgets[seq] // PAGE_SIZE`` of its first ``selection_cols``
    columns, then the rest, and its splits share what it reads evenly (a plan made for the step's budget would leave
    a smaller one to its first splits). With ``USE_PDL`` it waits for the kernels before it only at its first
    read of what they may write (``DENSE``: after prefetching its first tile into L2), and lets the next
    kernel launch once its split is attended. With ``E4M3_DOT`` (one query, fp8 pages) :func:`_attend_e4m3` attends
    the split instead of the loop below."""
    split = tl.program_id(0)
    NUM_BLOCKS: tl.constexpr = (NUM_QUERIES + QUERY_BLOCK - 1) // QUERY_BLOCK
    num_sel_heads = tl.num_programs(1) // NUM_BLOCKS
    sel_head = tl.program_id(1) % num_sel_heads
    first_query = tl.program_id(1) // num_sel_heads * QUERY_BLOCK
    seq = tl.program_id(2).to(tl.int64)
    kv_head = sel_head // SEL_PER_KV
    if USE_PDL and not DENSE:
        gdc_wait()
    seq_len = tl.load(lens_ptr + seq)
    if DENSE:
        num_items = tl.cdiv(seq_len, PAGE_SIZE)
    lead = selection_cols  # the row's columns before the ones that follow its budget's (all of them without budgets)
    if ROW_BUDGETS:
        lead = tl.minimum(tl.load(budgets_ptr + seq) // PAGE_SIZE, selection_cols)
        num_items = lead + num_items - selection_cols
        items_per_split = tl.cdiv(tl.cdiv(num_items, tl.num_programs(0)), PAGES_PER_ITER) * PAGES_PER_ITER
    start = split * items_per_split
    end = tl.minimum(start + items_per_split, num_items)

    BLOCK_N: tl.constexpr = PAGES_PER_ITER * PAGE_SIZE
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BLOCK_N)
    if DENSE and USE_PDL:
        # While the kernel before it (the step's K/V append, which lets this one launch as it starts) runs, pull
        # the first tile's keys and values into L2: the lengths and page table are the step's inputs, written
        # before that kernel, and a line it writes meanwhile is read later from L2 itself, new.
        _prefetch_tile_l2(k_pages_ptr, v_pages_ptr, table_ptr, seq, start + t // PAGE_SIZE, t % PAGE_SIZE, end,
                          kv_head, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_tb,
                          HEAD_DIM)
        gdc_wait()
    if E4M3_DOT:
        acc, m_i, l_i, query, head, gmask = _attend_e4m3(
            q_ptr, k_pages_ptr, v_pages_ptr, table_ptr, sel_ptr, seq, sel_head, kv_head, seq_len, start, end, lead,
            selection_cols, qk_scale, stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt,
            stride_vh, stride_tb, stride_sb, stride_sh, PAGE_SIZE, HEAD_DIM, BLOCK_D, GROUP, BLOCK_G, PAGES_PER_ITER,
            DENSE, ROW_BUDGETS, UPCAST)
        dmask = d < HEAD_DIM
        q_rows = query * num_q_heads + head
    else:
        query = first_query + g // GROUP  # [BLOCK_G]: a row's position among the last NUM_QUERIES
        head = sel_head * GROUP + g % GROUP
        gmask = (g < QUERY_BLOCK * GROUP) & (query < NUM_QUERIES)
        dmask = d < HEAD_DIM
        q_rows = query * num_q_heads + head  # the row of part_out / part_lse
        q = tl.load(q_ptr + seq * stride_qb + query[:, None] * stride_qq + head[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
        if F16_DOT:  # fp8 pages under a bf16 query: float16 dots (see _f16_dot)
            q = q.to(tl.float16)
        elif UPCAST:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for it in range(start, end, PAGES_PER_ITER):
            offset, position, live, physical = _tile_keys(
                it + t // PAGE_SIZE, t % PAGE_SIZE, end, lead, selection_cols, sel_ptr, table_ptr, seq, sel_head,
                seq_len, stride_sb, stride_sh, stride_tb, PAGE_SIZE, DENSE, ROW_BUDGETS)
            kv_mask = live[:, None] & dmask[None, :]
            k = tl.load(k_pages_ptr + physical[:, None] * stride_kp + offset[:, None] * stride_kt
                        + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
            v_rows = physical[:, None] * stride_vp + offset[:, None] * stride_vt + kv_head * stride_vh
            if v_pages_ptr.dtype.element_ty == tl.float8e4nv and not UPCAST:
                v = load_e4m3_as_f16(v_pages_ptr, v_rows, live, HEAD_DIM, BLOCK_D)
            else:
                v = tl.load(v_pages_ptr + v_rows + d[None, :], mask=kv_mask, other=0.0)
            if UPCAST and not F16_DOT:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            else:  # (fp8 pages: dequantized in registers)
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            s = block_scores(q, k, qk_scale, IEEE)  # [BLOCK_G, BLOCK_N]
            if NUM_QUERIES == 1:
                s = tl.where(live[None, :], s, float("-inf"))
            else:  # row r sees the keys up to its own position, seq_len - NUM_QUERIES + query[r]
                seen = position[None, :] <= (seq_len - NUM_QUERIES + query)[:, None]
                s = tl.where(live[None, :] & seen, s, float("-inf"))
            acc, m_i, l_i = online_softmax_step(s, v, acc, m_i, l_i, IEEE)

    if USE_PDL:
        gdc_launch_dependents()
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(part_out_ptr + seq * stride_pb + q_rows[:, None] * stride_ph + split * stride_ps + d[None, :],
             out, mask=gmask[:, None] & dmask[None, :])
    tl.store(part_lse_ptr + seq * stride_lb + q_rows * stride_lh + split, lse, mask=gmask)

    num_splits = tl.num_programs(0)
    counter = counter_ptr + seq * tl.num_programs(1) + tl.program_id(1)
    if last_to_arrive(counter, num_splits):
        if QUERY_BLOCK == 1:
            _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, seq, first_query, sel_head, num_q_heads, num_splits,
                          stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oq, stride_oh,
                          HEAD_DIM, BLOCK_D, GROUP, BLOCK_GM, MERGE_CHUNK)
        else:
            for j in range(QUERY_BLOCK):
                if first_query + j < NUM_QUERIES:
                    _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, seq, first_query + j, sel_head, num_q_heads,
                                  num_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob,
                                  stride_oq, stride_oh, HEAD_DIM, BLOCK_D, GROUP, BLOCK_GM, MERGE_CHUNK)
        reset_ticket(counter)


@triton.jit
def _tile_keys(item, offset, end, lead, selection_cols, sel_ptr, table_ptr, seq, sel_head, seq_len, stride_sb,
               stride_sh, stride_tb, PAGE_SIZE: tl.constexpr, DENSE: tl.constexpr, ROW_BUDGETS: tl.constexpr):
    """Where the keys of one tile lie: key ``j`` is token ``offset[j]`` of item ``item[j]`` of the split (a page
    index when ``DENSE``, else a column of the selection row, ``lead`` columns of the row's budget first with
    ``ROW_BUDGETS``), items at or past ``end`` not read. Returns ``(offset, position, live, physical)``: the token's
    position in the sequence, whether it holds a key, and its page in the pool (int64, 0 where not live)."""
    in_chunk = item < end
    if DENSE:
        logical = item
    else:
        column = item + tl.where(item >= lead, selection_cols - lead, 0) if ROW_BUDGETS else item
        logical = tl.load(sel_ptr + seq * stride_sb + sel_head * stride_sh + column, mask=in_chunk, other=-1)
    position = logical * PAGE_SIZE + offset
    live = in_chunk & (logical >= 0) & (position < seq_len)
    physical = tl.load(table_ptr + seq * stride_tb + logical, mask=live, other=0).to(tl.int64)
    return offset, position, live, physical


@triton.jit
def _attend_e4m3(q_ptr, k_pages_ptr, v_pages_ptr, table_ptr, sel_ptr, seq, sel_head, kv_head, seq_len, start, end,
                 lead, selection_cols, qk_scale, stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp,
                 stride_vt, stride_vh, stride_tb, stride_sb, stride_sh, PAGE_SIZE: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                 PAGES_PER_ITER: tl.constexpr, DENSE: tl.constexpr, ROW_BUDGETS: tl.constexpr, UPCAST: tl.constexpr):
    """The split's pages of e4m3 keys and values for one query per sequence, its scores in e4m3 tensor-core dots.

    The keys are the dot's first operand, ``[BLOCK_N, HEAD_DIM]`` straight from shared memory (no conversion),
    the query the second: each query head ``h`` of the group as two e4m3 columns (:func:`split_query_e4m3`: column
    ``h`` its high part, column ``BLOCK_G // 2 + h`` its low part), so the transposed scores ``[BLOCK_N, BLOCK_G]``
    hold both parts of a head in one thread's registers; their weighted sum is each head's score, kept in the
    columns ``2h`` and ``2h + 1``. Values are converted to float16 (pairs) for the weighted sum. Returns the
    split's unnormalised output ``[BLOCK_G, BLOCK_D]``, row maximum and row sum ``[BLOCK_G]`` (row ``r``: head
    ``r // 2`` of the group), with each row's position (0), query head and whether it is written (even rows of
    the group's heads)."""
    HALF: tl.constexpr = BLOCK_G // 2
    BLOCK_N: tl.constexpr = PAGES_PER_ITER * PAGE_SIZE
    c = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BLOCK_N)
    dmask = d < HEAD_DIM
    member = c % HALF
    q = tl.load(q_ptr + seq * stride_qb + (sel_head * GROUP + member)[:, None] * stride_qh + d[None, :],
                mask=(member < GROUP)[:, None] & dmask[None, :], other=0.0)
    q8, column_scale = split_query_e4m3(q, c < HALF, not UPCAST)
    column_scale = column_scale * qk_scale
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_D, BLOCK_G], tl.float32)
    for it in range(start, end, PAGES_PER_ITER):
        offset, _, live, physical = _tile_keys(
            it + t // PAGE_SIZE, t % PAGE_SIZE, end, lead, selection_cols, sel_ptr, table_ptr, seq, sel_head, seq_len,
            stride_sb, stride_sh, stride_tb, PAGE_SIZE, DENSE, ROW_BUDGETS)
        k = tl.load(k_pages_ptr + physical[:, None] * stride_kp + offset[:, None] * stride_kt
                    + kv_head * stride_kh + d[None, :], mask=live[:, None] & dmask[None, :], other=0.0)
        v_rows = physical[:, None] * stride_vp + offset[:, None] * stride_vt + kv_head * stride_vh
        if UPCAST:  # (the interpreter: float32 dots)
            v = tl.load(v_pages_ptr + v_rows + d[None, :], mask=live[:, None] & dmask[None, :], other=0.0)
            parts = tl.dot(k.to(tl.float32), tl.trans(q8), input_precision="ieee")
        else:
            v = load_e4m3_as_f16(v_pages_ptr, v_rows, live, HEAD_DIM, BLOCK_D)
            parts = tl.dot(k, tl.trans(q8))
        parts = parts * column_scale[None, :]  # [BLOCK_N, BLOCK_G]
        s = tl.sum(tl.reshape(parts, [BLOCK_N, 2, HALF]), axis=1)  # [BLOCK_N, HALF]: head h's score
        s = tl.reshape(tl.join(s, s), [BLOCK_N, BLOCK_G])  # column c: head c // 2
        s = tl.where(live[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[None, :])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        if UPCAST:
            acc = acc * alpha[None, :] + tl.dot(tl.trans(v.to(tl.float32)), p, input_precision="ieee")
        else:
            acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p.to(tl.float16))
        m_i = m_new
    head = sel_head * GROUP + c // 2
    return tl.trans(acc), m_i, l_i, c * 0, head, (c % 2 == 0) & (c // 2 < GROUP)


@triton.jit
def _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, seq, query, sel_head, num_q_heads, num_splits,
                  stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oq, stride_oh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_GM: tl.constexpr,
                  MERGE_CHUNK: tl.constexpr):
    """Merge the ``num_splits`` partial results of the ``GROUP`` query heads of ``sel_head`` at position ``query``
    (their log-sum-exp weights, ``MERGE_CHUNK`` splits per step) into ``out``."""
    heads = sel_head * GROUP + tl.arange(0, BLOCK_GM)
    rows = query * num_q_heads + heads
    rmask = tl.arange(0, BLOCK_GM) < GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    m_run = tl.full([BLOCK_GM], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_GM], tl.float32)
    o_run = tl.zeros([BLOCK_GM, BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, MERGE_CHUNK):
        sp = s0 + tl.arange(0, MERGE_CHUNK)
        smask = rmask[:, None] & (sp[None, :] < num_splits)
        part_lse = tl.load(part_lse_ptr + seq * stride_lb + rows[:, None] * stride_lh + sp[None, :],
                           mask=smask, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(part_out_ptr + seq * stride_pb + rows[:, None, None] * stride_ph
                       + sp[None, :, None] * stride_ps + d[None, None, :],
                       mask=smask[:, :, None] & dmask[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(part_lse, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(part_lse - m_safe[:, None])
        alpha = tl.exp2(m_run - m_safe)
        l_run = l_run * alpha + tl.sum(w, axis=1)
        o_run = o_run * alpha[:, None] + tl.sum(part * w[:, :, None], axis=1)
        m_run = m_new
    merged = o_run / tl.where(l_run > 0, l_run, 1.0)[:, None]
    tl.store(out_ptr + seq * stride_ob + query * stride_oq + heads[:, None] * stride_oh + d[None, :],
             merged.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _prefetch_tile_l2(k_pages_ptr, v_pages_ptr, table_ptr, seq, item, offset, end, kv_head,
                      stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_tb,
                      HEAD_DIM: tl.constexpr):
    """``prefetch.global.L2`` of the K and V rows (one per token ``item * PAGE_SIZE + offset`` of pages ``item <
    end``, ``HEAD_DIM`` values of ``kv_head``; rows past the end prefetch page 0's, harmlessly): the data lands in
    L2 and nothing in registers."""
    physical = tl.load(table_ptr + seq * stride_tb + item, mask=item < end, other=0).to(tl.int64)
    half = tl.arange(0, 2) * (HEAD_DIM // 2)  # a 256-byte bf16 row is two 128-byte lines
    rows = physical[:, None] * stride_kp + offset[:, None] * stride_kt + kv_head * stride_kh + half[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [k_pages_ptr + rows], dtype=tl.int32,
                              is_pure=False, pack=1)
    rows = physical[:, None] * stride_vp + offset[:, None] * stride_vt + kv_head * stride_vh + half[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [v_pages_ptr + rows], dtype=tl.int32,
                              is_pure=False, pack=1)


def grid_kind(dense: bool, programs: int, fp8: bool = False, verify_rows: Optional[int] = None) -> str:
    """The launch configuration (a key of ``_CONFIG``) of a grid over ``programs`` (sequence, selection head)
    pairs: ``"sparse"`` (``"sparse-fp8"`` on ``fp8`` pages); for a dense grid of several queries per sequence on model-dtype pages (``verify_rows``: its
    tile's padded rows, positions x the query group; ``None`` for one query) ``"verify"`` up to 32 rows, else
    ``"verify-64"``; ``"dense-few"`` for a dense grid of at most ``_FEW_PROGRAMS``, else ``"dense-fp8"`` on ``fp8``
    pages and ``"dense"``."""
    if not dense:
        return "sparse-fp8" if fp8 else "sparse"
    if verify_rows is not None and not fp8:
        return "verify" if verify_rows <= 32 else "verify-64"
    if programs <= _FEW_PROGRAMS:
        return "dense-few"
    return "dense-fp8" if fp8 else "dense"


def pages_per_iter(page_size: int, kind: str) -> int:
    """Whole pages one inner iteration of the split kernel loads (>= 1) in a grid of ``kind``."""
    return max(1, _CONFIG[kind][0] // page_size)


def plan_splits(num_items: int, programs: int, page_size: int, device: torch.device, dense: bool,
                num_splits: Optional[int] = None, fp8: bool = False, verify_rows: Optional[int] = None
                ) -> tuple[int, int]:
    """``(num_splits, items_per_split)`` for ``num_items`` pages per (sequence, selection head).

    ``programs`` is ``batch * num_sel_heads`` (times the query blocks of ``queries`` per sequence). Without an
    explicit ``num_splits`` the grid aims at its kind's programs per SM (``_CONFIG``) times the SMs, rounded down so
    that it runs in one wave; every split holds whole inner iterations. The result depends on shapes only, so a
    CUDA graph captured once stays valid. A grid of another kind may use the plan (a cache's model-dtype layers
    beside its ``fp8`` ones): the kinds' iterations divide each other's.
    """
    kind = grid_kind(dense, programs, fp8, verify_rows)
    step = pages_per_iter(page_size, kind)
    num_items = max(num_items, 1)
    if num_splits is None:
        num_splits = _CONFIG[kind][1] * num_sms(device) // max(programs, 1)
    num_splits = max(1, min(num_splits, triton.cdiv(num_items, step)))
    items_per_split = triton.cdiv(triton.cdiv(num_items, num_splits), step) * step
    return triton.cdiv(num_items, items_per_split), items_per_split


def query_block(num_queries: int, group: int) -> int:
    """Positions one program attends of ``num_queries`` per sequence whose selection heads each serve ``group``
    query heads: all of them when their rows fit ``_MAX_QUERY_ROWS``, else the fewest blocks of equal size that do."""
    most = max(1, _MAX_QUERY_ROWS // group)
    return triton.cdiv(num_queries, triton.cdiv(num_queries, most))


def _tile_rows(block: int, group: int) -> int:
    """The padded rows of a program's query tile: ``block`` positions x ``group`` query heads, at least 16."""
    return max(16, next_pow2(block * group))


def _verify_rows(num_queries: int, block: int, group: int) -> Optional[int]:
    """:func:`grid_kind`'s ``verify_rows``: the tile's rows for several queries per sequence, ``None`` for one."""
    return _tile_rows(block, group) if num_queries > 1 else None


def merge_chunk(programs: int, group: int, device: torch.device) -> int:
    """Splits the merge combines per step for a grid of ``programs`` programs whose selection heads each
    serve ``group`` query heads: the wide chunk for a grid of at most ``_WIDE_MERGE_PROGRAMS_PER_SM`` per SM
    and groups of at most ``_WIDE_MERGE_MAX_GROUP``, else ``_MERGE_CHUNK``."""
    few = programs <= _WIDE_MERGE_PROGRAMS_PER_SM * num_sms(device)
    return _WIDE_MERGE_CHUNK if few and group <= _WIDE_MERGE_MAX_GROUP else _MERGE_CHUNK


def attention_buffers(
    batch: int,
    num_q_heads: int,
    num_sel_heads: int,
    head_dim: int,
    num_items: int,
    page_size: int,
    dense: bool,
    device: torch.device,
    num_splits: Optional[int] = None,
    num_queries: int = 1,
    kv_dtype: Optional[torch.dtype] = None,
) -> AttentionBuffers:
    """Scratch for :func:`paged_decode_attention_into` for ``num_items`` pages per (sequence,
    selection head) and ``num_queries`` queries per sequence, planned for pages of ``kv_dtype`` (``None``: the
    model's dtype): ``part_out`` ``[batch, num_queries * num_q_heads,
    num_splits, head_dim]`` float32, ``part_lse`` ``[batch, num_queries * num_q_heads, num_splits]`` float32,
    ``counters`` ``[batch, query blocks * num_sel_heads]`` int32 (zero; every launch leaves them zero),
    ``items_per_split``."""
    group = num_q_heads // num_sel_heads
    block = query_block(num_queries, group)
    blocks = triton.cdiv(num_queries, block)
    num_splits, items_per_split = plan_splits(num_items, batch * num_sel_heads * blocks, page_size, device, dense,
                                              num_splits, kv_dtype == torch.float8_e4m3fn,
                                              _verify_rows(num_queries, block, group))
    rows = num_queries * num_q_heads
    part_out = torch.empty((batch, rows, num_splits, head_dim), dtype=torch.float32, device=device)
    part_lse = torch.empty((batch, rows, num_splits), dtype=torch.float32, device=device)
    counters = torch.zeros((batch, blocks * num_sel_heads), dtype=torch.int32, device=device)
    return AttentionBuffers(part_out, part_lse, counters, items_per_split)


def paged_decode_attention_into(
    out: torch.Tensor,
    buffers: AttentionBuffers,
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    selected: Optional[torch.Tensor],
    sm_scale: Optional[float] = None,
    budgets: Optional[torch.Tensor] = None,
    selection_cols: Optional[int] = None,
) -> torch.Tensor:
    """Split-KV attention with the merge fused in, into preallocated buffers (one launch, no host
    synchronisation).

    Args:
        out: ``q``'s shape and dtype.
        buffers: from :func:`attention_buffers` with ``dense=selected is None`` and ``q``'s queries per sequence;
            its ``num_splits * items_per_split`` must cover ``selected.shape[-1]`` (or ``max_pages``).
        Other arguments as in :func:`paged_decode_attention`.
    """
    queries = q[:, None] if q.dim() == 3 else q
    batch, num_queries, num_q_heads, head_dim = queries.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    check_shape("v_pages", v_pages, k_pages.shape)
    check_shape("k_pages", k_pages, (k_pages.shape[0], page_size, num_kv_heads, head_dim))
    check_shape("seq_lens", seq_lens, (batch,))
    check_shape("page_table", page_table, (batch, page_table.shape[1]))
    dense = selected is None
    if dense:
        sel_heads, num_items = num_kv_heads, page_table.shape[1]
    else:
        sel_heads, num_items = selected.shape[1], selected.shape[2]
        check_shape("selected", selected, (batch, sel_heads, num_items))
        if sel_heads not in (num_kv_heads, num_q_heads):
            raise ValueError(f"selected has {sel_heads} heads; expected {num_kv_heads} or {num_q_heads}")
        check_last_dim_contiguous(selected=selected)
    selection_cols = check_row_budgets(selected, budgets, selection_cols, batch)
    part_out, part_lse, counters, items_per_split = buffers
    num_splits = part_lse.shape[-1]
    if num_splits * items_per_split < num_items:
        raise ValueError(f"{num_splits} splits of {items_per_split} pages do not cover {num_items} pages")
    group = num_q_heads // sel_heads
    block = query_block(num_queries, group)
    blocks = triton.cdiv(num_queries, block)
    check_shape("out", out, q.shape)
    check_shape("part_out", part_out, (batch, num_queries * num_q_heads, num_splits, head_dim))
    check_shape("part_lse", part_lse, (batch, num_queries * num_q_heads, num_splits))
    check_shape("counters", counters, (batch, blocks * sel_heads))
    if counters.dtype != torch.int32 or not counters.is_contiguous():
        raise ValueError(f"counters must be contiguous int32, got {counters.dtype}")
    check_last_dim_contiguous(q=q, k_pages=k_pages, v_pages=v_pages, page_table=page_table, out=out, part_out=part_out)
    check_e4m3_pairs(v_pages)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    programs = batch * sel_heads * blocks
    kind = grid_kind(dense, programs, k_pages.dtype == torch.float8_e4m3fn, _verify_rows(num_queries, block, group))
    sel = page_table if dense else selected  # not read when dense
    outs = out[:, None] if out.dim() == 3 else out
    e4m3_dot = _e4m3_dot(q, k_pages, num_queries)
    rows = max(16, 2 * next_pow2(group)) if e4m3_dot else _tile_rows(block, group)
    _decode_split_kernel[(num_splits, blocks * sel_heads, batch)](
        q, k_pages, v_pages, page_table, seq_lens, sel, seq_lens if budgets is None else budgets, part_out, part_lse,
        counters, out, sm_scale * _LOG2E, num_items, items_per_split, selection_cols, num_q_heads,
        queries.stride(0), queries.stride(1), queries.stride(2),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        page_table.stride(0),
        sel.stride(0), 0 if dense else sel.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        outs.stride(0), outs.stride(1), outs.stride(2),
        PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
        GROUP=group, BLOCK_G=rows, BLOCK_GM=next_pow2(group), SEL_PER_KV=sel_heads // num_kv_heads,
        NUM_QUERIES=num_queries, QUERY_BLOCK=block,
        PAGES_PER_ITER=pages_per_iter(page_size, kind), MERGE_CHUNK=merge_chunk(num_splits * programs, group, q.device),
        DENSE=dense, UPCAST=interpreting(),
        IEEE=q.dtype == torch.float32, USE_PDL=use_pdl(q.device),
        F16_DOT=_f16_dot(q, k_pages), ROW_BUDGETS=budgets is not None, E4M3_DOT=e4m3_dot,
        num_warps=_WARPS_BY_ROWS.get(rows, 2 * _NUM_WARPS), num_stages=_CONFIG[kind][2],
        launch_pdl=use_pdl(q.device),
    )
    return out


# One query per sequence on fp8 pages under a 16-bit query: scores in e4m3 tensor-core dots (_attend_e4m3), faster
# than float16 dots at every point of benchmarks/results/kernel-sweep-h100-fp8-e4m3.md against -f16.md. Module state
# so that a benchmark can time both (kernel_sweep.py --fp8-scores).
E4M3_DOTS = True


def _e4m3_dot(q: torch.Tensor, k_pages: torch.Tensor, num_queries: int) -> bool:
    """Whether the kernel scores fp8 pages under a 16-bit query in e4m3 tensor-core dots (:func:`_attend_e4m3`):
    one query per sequence, a head_dim of at least 32 (an e4m3 dot's depth)."""
    return (E4M3_DOTS and k_pages.dtype == torch.float8_e4m3fn and q.dtype in (torch.bfloat16, torch.float16)
            and num_queries == 1 and next_pow2(k_pages.shape[-1]) >= 32)


def _f16_dot(q: torch.Tensor, k_pages: torch.Tensor) -> bool:
    """Whether the kernel's loop (several queries per sequence, or one with :data:`E4M3_DOTS` off) takes fp8 pages
    under a bf16 query in float16 dots: e4m3 converts to float16 in one instruction per pair of values (to bf16 in
    three), every e4m3 value is exact in float16 and the softmax weights are finer there than in bf16, and a bf16
    query is exact there from float16's smallest normal (6.1e-5) to its largest value (65504): a query component
    outside that keeps float16's subnormal precision or overflows."""
    return k_pages.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    selected: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
    budgets: Optional[torch.Tensor] = None,
    selection_cols: Optional[int] = None,
) -> torch.Tensor:
    """Triton :func:`questkv.ops.reference.paged_decode_attention` (flash-decoding).

    Args:
        q: ``[batch, num_q_heads, head_dim]``, or ``[batch, num_queries, num_q_heads, head_dim]`` for the last
            ``num_queries`` positions of every sequence (causal among them). k_pages, v_pages: ``[num_pages,
            page_size, num_kv_heads, head_dim]``. page_table: ``[batch, max_pages]`` int32. seq_lens:
            ``[batch]`` int32, each >= 1 (>= ``num_queries``).
        selected: ``[batch, num_kv_heads or num_q_heads, k]`` int32 logical pages (``-1`` = none),
            or ``None`` for every page (dense paged decode, the same kernel).
        sm_scale: default ``1 / sqrt(head_dim)``.
        budgets, selection_cols: as in the reference (a row's budget below the step's: its splits share its pages).

    Returns:
        ``q``'s shape and dtype; softmax and accumulation in float32.
    """
    num_queries = 1 if q.dim() == 3 else q.shape[1]
    batch, num_q_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    dense = selected is None
    sel_heads = k_pages.shape[2] if dense else selected.shape[1]
    num_items = page_table.shape[1] if dense else selected.shape[2]
    buffers = attention_buffers(batch, num_q_heads, sel_heads, head_dim, num_items, k_pages.shape[1], dense, q.device,
                                num_queries=num_queries, kv_dtype=k_pages.dtype)
    return paged_decode_attention_into(torch.empty_like(q), buffers, q, k_pages, v_pages, page_table, seq_lens,
                                       selected, sm_scale, budgets, selection_cols)
