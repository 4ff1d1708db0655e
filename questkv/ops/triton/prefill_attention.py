"""Paged prefill attention: a flash-attention forward of a flat batch of new tokens over their sequences' pages.

The new tokens' K/V are in the pool already (``append_kv`` runs first), so the cached prefix and the new tokens are
read alike, through the page table, with no gather and no copy. One program takes a tile of ``TILE_TOKENS`` query
tokens of one sequence times the ``GROUP`` query heads of one KV head, flattened into the rows of one ``tl.dot``
(each K/V block is loaded once for the whole group), and runs the online softmax over the keys up to the causal
limit of its last token: blocks wholly below its first token unmasked, the rest masked per row. When the tiles
are too few to fill the GPU (a few sequences with few new tokens after a long prefix), the keys are also split
over programs and the partial results merged (flash-decoding). The reference, with the layout and the causal rule,
is :func:`questkv.ops.reference.paged_prefill_attention`; the decode step's kernel is
:mod:`questkv.ops.triton.decode_attention`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from questkv.ops.checks import check_prefill_attention
from questkv.ops.triton._common import (
    block_scores,
    check_e4m3_pairs,
    check_last_dim_contiguous,
    interpreting,
    load_e4m3_as_f16,
    next_pow2,
    num_sms,
    online_softmax_step,
)

_LOG2E = 1.4426950408889634
# Launch configuration (first guesses for sm_90, to sweep on the H200): rows of one program (query tokens x the
# padded query group), keys per inner iteration (a power of two: whole pages or part of one), warps per row count,
# software-pipelining depth.
_BLOCK_M = 128
_BLOCK_N = 64
_NUM_WARPS = {16: 4, 32: 4, 64: 4, 128: 8}
_NUM_STAGES = 3
# Split keys when the tiles leave SMs idle: programs per SM to aim at, fewest keys in one range.
_SPLIT_PROGRAMS_PER_SM = 2
_MIN_SPLIT_KEYS = 1024


@triton.jit
def _attend_block(
    q, acc, m_i, l_i, start, seq, kv_end, kv_head, position, k_pages_ptr, v_pages_ptr, table_ptr,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_tb, qk_scale,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """One online-softmax step of a program's rows over keys ``[start, start + BLOCK_N)``; ``MASKED``: keys at
    or past ``kv_end`` are not loaded and row ``r`` sees keys ``<= position[r]`` only (else every key is seen)."""
    key = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    table = table_ptr + seq * stride_tb + key // PAGE_SIZE
    if MASKED:
        live = key < kv_end
        physical = tl.load(table, mask=live, other=0).to(tl.int64)
        kv_mask = live[:, None] & (d < HEAD_DIM)[None, :]
    else:  # a block below the tile's first token: every key is written and seen
        physical = tl.load(table).to(tl.int64)
        kv_mask = (d < HEAD_DIM)[None, :]
    offset = key % PAGE_SIZE
    k_ptrs = (k_pages_ptr + physical[:, None] * stride_kp + offset[:, None] * stride_kt + kv_head * stride_kh
              + d[None, :])
    v_rows = physical[:, None] * stride_vp + offset[:, None] * stride_vt + kv_head * stride_vh
    if MASKED or HEAD_DIM != BLOCK_D:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)
    if v_pages_ptr.dtype.element_ty == tl.float8e4nv and not UPCAST:
        v = load_e4m3_as_f16(v_pages_ptr, v_rows, (key < kv_end) if MASKED else key >= 0, HEAD_DIM, BLOCK_D)
    elif MASKED or HEAD_DIM != BLOCK_D:
        v = tl.load(v_pages_ptr + v_rows + d[None, :], mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_pages_ptr + v_rows + d[None, :])
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:  # (fp8 values stay in float16 unless the query is float32, and the softmax weights follow them)
        k = k.to(q.dtype)
        v = v.to(tl.float16 if v.dtype == tl.float16 and not IEEE else q.dtype)
    s = block_scores(q, k, qk_scale, IEEE)  # [BLOCK_M, BLOCK_N]
    if MASKED:
        s = tl.where(live[None, :] & (key[None, :] <= position[:, None]), s, float("-inf"))
    return online_softmax_step(s, v, acc, m_i, l_i, IEEE)


# The tile count, the page table's row stride and the split log-sum-exps' token stride (num_tokens * num_q_heads)
# change from step to step (query lengths, the batch's longest table row, its new tokens): specialising on them
# (== 1, divisible by 16) would compile a new variant when they change, mid-serving.
@triton.jit(do_not_specialize=["num_tiles", "stride_tb", "stride_ls"])
def _prefill_kernel(
    q_ptr, k_pages_ptr, v_pages_ptr, table_ptr, starts_ptr, lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, num_tiles,
    stride_qt, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_tb,
    stride_ot, stride_oh,
    stride_ps, stride_pt, stride_ph,
    stride_ls, stride_lt,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, TILE_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Program ``(seq * num_tiles + j, kv_head, split)`` attends query tile ``num_tiles - 1 - j`` (the longest
    first) of sequence ``seq`` for the query heads of ``kv_head``: rows ``r = token * BLOCK_G + g`` of one
    ``[BLOCK_M, BLOCK_D]`` query block. Tiles past the sequence's new tokens return at once. With ``SPLIT`` the
    tile's keys are cut into ``num_programs(2)`` ranges of whole blocks; each program writes its range's
    normalised output and base-2 log-sum-exp (``-inf``: no key) into ``part_out`` / ``part_lse`` for
    :func:`_merge_splits`; else it writes ``out``."""
    BLOCK_M: tl.constexpr = TILE_TOKENS * BLOCK_G
    seq = tl.program_id(0) // num_tiles
    tile = num_tiles - 1 - tl.program_id(0) % num_tiles
    kv_head = tl.program_id(1)
    q_start = tl.load(starts_ptr + seq)
    num_new = tl.load(starts_ptr + seq + 1) - q_start
    first = tile * TILE_TOKENS
    if first >= num_new:
        return
    seq_len = tl.load(lens_ptr + seq)
    cached = seq_len - num_new
    last = tl.minimum(first + TILE_TOKENS, num_new) - 1

    r = tl.arange(0, BLOCK_M)
    token = first + r // BLOCK_G
    g = r % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    row_mask = (token < num_new) & (g < GROUP)
    io_mask = row_mask[:, None] & (d < HEAD_DIM)[None, :]
    q_row = (q_start + token).to(tl.int64)
    head = kv_head * GROUP + g
    q = tl.load(q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    position = cached + token  # [BLOCK_M]: row r sees keys 0 .. position[r]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full_end = (cached + first + 1) // BLOCK_N * BLOCK_N  # every row sees every key below
    kv_end = cached + last + 1  # the last row's limit
    lo = 0
    hi = kv_end
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(kv_end, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        lo = tl.program_id(2) * per_split
        hi = tl.minimum(lo + per_split, kv_end)
    seq = seq.to(tl.int64)
    for start in range(lo, tl.minimum(full_end, hi), BLOCK_N):
        acc, m_i, l_i = _attend_block(
            q, acc, m_i, l_i, start, seq, kv_end, kv_head, position, k_pages_ptr, v_pages_ptr, table_ptr,
            stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_tb, qk_scale,
            PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, False, UPCAST, IEEE)
    for start in range(tl.maximum(full_end, lo), hi, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            q, acc, m_i, l_i, start, seq, kv_end, kv_head, position, k_pages_ptr, v_pages_ptr, table_ptr,
            stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_tb, qk_scale,
            PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, True, UPCAST, IEEE)

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLIT:
        split = tl.program_id(2)
        tl.store(part_out_ptr + split * stride_ps + q_row[:, None] * stride_pt + head[:, None] * stride_ph
                 + d[None, :], out, mask=io_mask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + split * stride_ls + q_row * stride_lt + head, lse, mask=row_mask)
    else:
        tl.store(out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)


def tile_tokens(max_query_len: int, block_g: int) -> int:
    """Query tokens of one program: ``_BLOCK_M // block_g`` rows' worth, fewer when every sequence brings fewer
    (at least 16 rows, the smallest ``tl.dot``)."""
    rows = min(max(_BLOCK_M, block_g), max(16, next_pow2(max_query_len * block_g)))
    return max(1, rows // block_g)


def plan_splits(programs: int, max_keys: int, device: torch.device) -> int:
    """Key ranges each query tile is cut into: 1 when the ``programs`` (tiles x KV heads) fill the SMs; else about
    ``_SPLIT_PROGRAMS_PER_SM`` programs per SM, each range at least ``_MIN_SPLIT_KEYS`` of the ``max_keys`` keys
    the longest sequence may hold (page-table width x page size: shapes only, no synchronisation)."""
    sms = num_sms(device)
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(_SPLIT_PROGRAMS_PER_SM * sms, programs), max_keys // _MIN_SPLIT_KEYS))


def paged_prefill_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    query_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: Optional[int] = None,
    sm_scale: Optional[float] = None,
) -> torch.Tensor:
    """Triton :func:`questkv.ops.reference.paged_prefill_attention`: one launch, grid ``(batch * tiles,
    num_kv_heads, splits)``; when the tiles alone leave SMs idle (few sequences, few new tokens, a long cache) the
    keys are split (:func:`plan_splits`) and the partial results merged in float32.

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]``. k_pages, v_pages: ``[num_pages, page_size, num_kv_heads,
            head_dim]``, one float dtype (cast to ``q``'s in the kernel). page_table: ``[batch, max_pages]`` int32.
        query_starts: ``[batch + 1]`` int32 on ``q``'s device. seq_lens: ``[batch]`` int32, ``>= n_i``.
        max_query_len: an upper bound of the new tokens of every sequence (host int; a smaller one leaves rows
            unwritten), or ``None``: read from ``query_starts`` (a host synchronisation).
        sm_scale: default ``1 / sqrt(head_dim)``.

    Returns:
        ``[num_tokens, num_q_heads, head_dim]`` in ``q``'s dtype; softmax and accumulation in float32.
    """
    check_prefill_attention(q, k_pages, v_pages, page_table, query_starts, seq_lens)
    check_last_dim_contiguous(q=q, k_pages=k_pages, v_pages=v_pages, page_table=page_table)
    check_e4m3_pairs(v_pages)
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    batch = seq_lens.shape[0]
    out = torch.empty_like(q)
    if max_query_len is None:
        max_query_len = int((query_starts[1:] - query_starts[:-1]).max().item()) if batch else 0
    if num_tokens == 0 or max_query_len < 1:
        return out
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    group = num_q_heads // num_kv_heads
    block_g = next_pow2(group)
    tokens = tile_tokens(max_query_len, block_g)
    num_tiles = triton.cdiv(max_query_len, tokens)
    num_splits = plan_splits(batch * num_tiles * num_kv_heads, page_table.shape[1] * page_size, q.device)
    split = num_splits > 1
    if split:
        part_out = torch.empty((num_splits, num_tokens, num_q_heads, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_splits, num_tokens, num_q_heads), dtype=torch.float32, device=q.device)
    else:  # not written
        part_out, part_lse = out, out[..., 0]
    _prefill_kernel[(batch * num_tiles, num_kv_heads, num_splits)](
        q, k_pages, v_pages, page_table, query_starts, seq_lens, out, part_out, part_lse,
        sm_scale * _LOG2E, num_tiles,
        q.stride(0), q.stride(1),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),
        GROUP=group, BLOCK_G=block_g, TILE_TOKENS=tokens, BLOCK_N=max(16, _BLOCK_N),
        SPLIT=split, UPCAST=interpreting(), IEEE=q.dtype == torch.float32,
        num_warps=_NUM_WARPS.get(tokens * block_g, 8), num_stages=_NUM_STAGES,
    )
    if split:
        _merge_splits(out, part_out, part_lse)
    return out


def launch_shapes(group: int, num_kv_heads: int, max_keys: int, device: torch.device) -> list[tuple[int, int]]:
    """``(max_query_len, batch)`` of one prefill per launch configuration a prefill of a model with ``group`` query
    heads per KV head can take over a page table of ``max_keys`` keys: each query tile size of :func:`tile_tokens`,
    unsplit (batch enough to fill the SMs) and, where :func:`plan_splits` splits one sequence's tile, split."""
    block_g = next_pow2(group)
    first_length = {}  # tile tokens -> the shortest max_query_len that takes them
    length = 1
    while True:
        first_length.setdefault(tile_tokens(length, block_g), length)
        if length * block_g >= max(_BLOCK_M, block_g):
            break
        length *= 2
    split = plan_splits(num_kv_heads, max_keys, device) > 1
    fill = triton.cdiv(num_sms(device), num_kv_heads)
    return [(length, batch) for length in first_length.values() for batch in ((fill, 1) if split else (fill,))]


def compile_prefill_launches(q_dtype: torch.dtype, num_q_heads: int, k_pages: torch.Tensor, v_pages: torch.Tensor,
                             table_width: int) -> int:
    """Run :func:`paged_prefill_attention` once per launch configuration (:func:`launch_shapes`) over these pools
    and a page table ``table_width`` pages wide, every row on page 0 (only read), so that Triton compiles them
    now: a configuration first met while serving compiles inside that step, a stall of a second or more for every
    running request. Returns the launches."""
    num_kv_heads, head_dim = k_pages.shape[2], k_pages.shape[3]
    shapes = launch_shapes(num_q_heads // num_kv_heads, num_kv_heads, table_width * k_pages.shape[1], k_pages.device)
    for length, batch in shapes:
        q = torch.randn(batch * length, num_q_heads, head_dim, device=k_pages.device).to(q_dtype)
        starts = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device=q.device)
        lens = torch.full((batch,), length, dtype=torch.int32, device=q.device)
        table = torch.zeros((batch, table_width), dtype=torch.int32, device=q.device)
        paged_prefill_attention(q, k_pages, v_pages, table, starts, lens, length)
    return len(shapes)


def _merge_splits(out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """``out`` ``[num_tokens, num_q_heads, head_dim]`` from the splits' normalised outputs ``part_out`` ``[splits,
    num_tokens, num_q_heads, head_dim]`` float32 and base-2 log-sum-exps ``part_lse`` ``[splits, num_tokens,
    num_q_heads]`` (every row has a finite one: split 0 holds key 0, which every token sees)."""
    weight = torch.exp2(part_lse - part_lse.amax(0))  # [S, T, Hq]
    merged = (part_out * weight[..., None]).sum(0) / weight.sum(0)[..., None]  # [T, Hq, D]
    out.copy_(merged)
