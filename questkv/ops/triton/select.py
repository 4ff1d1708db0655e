"""Select kernels: top-K pages per (sequence, head) with forced sink / recent / current pages.

Two paths with the same result: one program per (sequence, head) row, which loops over chunks of
the row as many as the row's own pages fill (its cost follows each row's length, not the
page-table width), and for long rows a split radix select over chunks of the row (several
launches, global histograms). With ``active`` flags (one per sequence) every program of an inactive
sequence's rows, in every launch, returns after reading its flag (the one-program kernel reads its row's
length and budget beside it) and before reading a score: its output rows and their scratch are left
as they are (the scratch of a row is its own, so nothing it skips is shared with another row).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from questkv.ops.checks import check_active, check_select_out
from questkv.ops.pages import SelectBuffers
from questkv.ops.triton._common import (
    check_last_dim_contiguous,
    check_shape,
    last_to_arrive,
    next_pow2,
    reset_ticket,
)

# Keys each thread holds, and the warp range: fewer warps make the block-wide reductions cheaper,
# more keys per thread cost registers (measured on an H200, docs/kernels.md).
_KEYS_PER_THREAD = 8
_MIN_WARPS, _MAX_WARPS = 4, 16
# One-program path: a table of at most _ROW_SINGLE_PAGES columns is one chunk of next_pow2(columns)
# pages, read once, no chunk loop, in at most _SINGLE_MAX_WARPS warps (more keys per thread beyond: the
# four passes' block-wide steps cost more with more warps; on an H200, 8 rows of 2048 pages took
# 10.2 µs in 8 warps, 11.7 in 16, 12.7 in 4, and 13.1 as two chunks of 1024). Wider tables loop over
# chunks of _ROW_BLOCK pages (a power of two), so that a row of n pages costs ceil(n / _ROW_BLOCK)
# chunks, with _ROW_KEYS_PER_THREAD keys per thread (the first chunk stays in registers beside the one
# being read: 8 keys per thread spilled at 1024 pages in an sm_90 compile, 4 do not).
_ROW_SINGLE_PAGES = 2048
_SINGLE_MAX_WARPS = 8
_ROW_BLOCK = 1024
_ROW_KEYS_PER_THREAD = 4
# Split path: taken (unless forced) from this many page-table columns on (raised from 4096 when the
# one-program path's cost began to follow the real pages: the engine's widths are powers of two, so a
# 4096-column table holds rows of 2049-4096 pages, where the split path measured about as slow as the
# old 4096-page block, docs/kernels.md; not yet re-timed, see benchmarks/select_cliff.py), for at most
# _SPLIT_MAX_ROWS (sequence, head) rows (more rows already fill the GPU with one program each),
# over chunks of _SPLIT_CHUNK_PAGES pages (a power of two), with digits of _DIGIT_BITS bits:
# ceil(32 / bits) histogram passes, the last over the low bits left (8 -> 4 x 8, 11 -> 11/11/10).
_SPLIT_MIN_PAGES = 4096
_SPLIT_MAX_ROWS = 32
_SPLIT_CHUNK_PAGES = 512
_DIGIT_BITS = 8


@triton.jit
def _row_pages(lens_ptr, budgets_ptr, seq, max_pages,
               PAGE_SIZE: tl.constexpr, BUDGET: tl.constexpr, HAS_BUDGETS: tl.constexpr):
    """Pages of sequence ``seq`` and how many of them its row keeps."""
    num_pages = tl.cdiv(tl.load(lens_ptr + seq), PAGE_SIZE)
    row_budget = BUDGET
    if HAS_BUDGETS:
        row_budget = tl.minimum(tl.load(budgets_ptr + seq) // PAGE_SIZE, BUDGET)
    return num_pages, tl.minimum(tl.minimum(num_pages, max_pages), row_budget)


@triton.jit
def _page_keys(row_ptr, i, num_pages, max_pages, SINK: tl.constexpr, RECENT: tl.constexpr):
    """Validity and 32-bit order-preserving key (uint32) of pages ``i`` of the score row at ``row_ptr``."""
    valid = (i < max_pages) & (i < num_pages)
    score = tl.load(row_ptr + i, mask=valid, other=0.0)
    forced = valid & ((i < SINK) | (i >= num_pages - 1 - RECENT))
    score = tl.where(forced, float("inf"), tl.where(score == 0.0, 0.0, score))  # -0.0 ties +0.0
    bits = score.to(tl.int32, bitcast=True)
    key = (tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) ^ -2147483648).to(tl.uint32, bitcast=True)  # monotone
    return valid, key


@triton.jit
def _pick(hist, bins, remaining):
    """The digit holding the ``remaining``-th largest key of a histogram, and how many keys have a
    larger digit (``-1`` and ``0`` when ``remaining`` is 0)."""
    above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)
    pick = tl.max(tl.where((above < remaining) & (above + hist >= remaining), bins, -1), axis=0)
    return pick, tl.sum(tl.where(bins == pick, above, 0), axis=0)


@triton.jit
def _digit_histogram(key, match, threshold, P: tl.constexpr):
    """Histogram ``[256]`` int32 of digit ``P`` (bits ``31 - 8P`` to ``24 - 8P``) of the keys in ``match``
    that share the threshold's top ``P`` digits."""
    if P > 0:
        match = match & ((key >> (32 - 8 * P)) == (threshold >> (32 - 8 * P)))
    return tl.histogram(((key >> (24 - 8 * P)) & 255).to(tl.int32), 256, mask=match)


@triton.jit
def _compact_chunk(out_row_ptr, i, valid, key, threshold, ties, offset):
    """Write the kept pages ``i`` of one chunk (keys above ``threshold``, then the first ``ties`` keys
    equal to it) in ascending order from column ``offset``; returns ``(ties, offset)`` for the next chunk."""
    tie = (valid & (key == threshold)).to(tl.int32)
    chosen = valid & ((key > threshold) | ((tie == 1) & (tl.cumsum(tie, axis=0) - tie < ties)))
    flag = chosen.to(tl.int32)
    tl.store(out_row_ptr + offset + tl.cumsum(flag, axis=0) - flag, i, mask=chosen)
    return ties - tl.sum(tie, axis=0), offset + tl.sum(flag, axis=0)


@triton.jit
def _select_row(scores_row_ptr, out_row_ptr, num_pages, remaining, max_pages,
                BUDGET: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr, BLOCK: tl.constexpr,
                SINGLE: tl.constexpr):
    """Select one row in one program: the ``remaining`` (``<= BUDGET``) top pages of the float32 score
    row at ``scores_row_ptr`` (``max_pages`` columns, ``num_pages`` of them valid), forced pages first,
    written to the int32 row at ``out_row_ptr`` as ascending logical pages with ``-1`` padding up to
    ``BUDGET``.

    Radix select of the threshold key, then an order-preserving compaction (no sort). Each valid page
    gets a 32-bit key that orders like its score (forced pages score ``+inf``). Four 8-bit histogram
    passes find the threshold key ``T`` and how many pages equal to ``T`` still fit; pages above ``T``
    and the first such ties (lowest index first) are kept, and an exclusive prefix sum writes their
    indices in ascending order: the reference's choice exactly. The body of :func:`_select_pages_kernel`.

    The row is read in chunks of ``BLOCK`` pages, as many as the row's pages fill
    (``ceil(min(num_pages, max_pages) / BLOCK)``, none when it picks nothing), so the work follows the
    row's length, not ``max_pages``. The first chunk stays in registers; every pass reloads the others
    (from cache) and adds their histograms (not when the row keeps all its pages); the compaction
    carries the output offset and the ties still to keep from chunk to chunk. The padding covers only
    the columns past the kept pages. ``SINGLE`` (``min(num_pages, max_pages) <= BLOCK``) compiles the chunk
    loops out.
    """
    row_pages = tl.minimum(num_pages, max_pages)
    num_chunks = tl.where(remaining > 0, tl.cdiv(row_pages, BLOCK), 0)
    keep_all = remaining >= row_pages  # the row keeps every valid page: its other chunks skip the passes
    i0 = tl.arange(0, BLOCK)
    valid0, key0 = _page_keys(scores_row_ptr, i0, num_pages, max_pages, SINK, RECENT)
    valid0 = valid0 & (remaining > 0)

    threshold = tl.zeros([], tl.uint32)
    bins = tl.arange(0, 256)
    for p in tl.static_range(4):
        hist = _digit_histogram(key0, valid0, threshold, p)
        if not SINGLE:
            for c in tl.range(1, tl.where(keep_all, 0, num_chunks)):
                valid, key = _page_keys(scores_row_ptr, c * BLOCK + i0, num_pages, max_pages, SINK, RECENT)
                hist += _digit_histogram(key, valid, threshold, p)
        pick, above = _pick(hist, bins, remaining)
        remaining -= above
        threshold = threshold | (pick.to(tl.uint32) << (24 - 8 * p))
    # keeping every valid page: every key is above 0 or a tie at 0 within the quota
    threshold = tl.where(keep_all, tl.zeros([], tl.uint32), threshold)
    remaining = tl.where(keep_all, row_pages, remaining)

    ties, offset = _compact_chunk(out_row_ptr, i0, valid0, key0, threshold, remaining, tl.zeros([], tl.int32))
    if not SINGLE:
        for c in tl.range(1, num_chunks):
            i = c * BLOCK + i0
            valid, key = _page_keys(scores_row_ptr, i, num_pages, max_pages, SINK, RECENT)
            ties, offset = _compact_chunk(out_row_ptr, i, valid, key, threshold, ties, offset)
    for c in tl.range(offset // BLOCK, (BUDGET + BLOCK - 1) // BLOCK):
        j = c * BLOCK + i0
        tl.store(out_row_ptr + j, tl.full([BLOCK], -1, tl.int32), mask=(j >= offset) & (j < BUDGET))


@triton.jit
def _select_pages_kernel(
    scores_ptr, lens_ptr, budgets_ptr, active_ptr, out_ptr,
    max_pages,
    stride_sb, stride_sh,
    stride_ob, stride_oh,
    PAGE_SIZE: tl.constexpr, BUDGET: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
    BLOCK: tl.constexpr, SINGLE: tl.constexpr, HAS_BUDGETS: tl.constexpr, HAS_ACTIVE: tl.constexpr,
):
    """One program per (head, sequence) selects its row (:func:`_select_row`) in chunks of ``BLOCK``
    pages; with ``SINGLE`` in one chunk of ``BLOCK`` pages, or of ``BLOCK // 2`` for a row that fits in it
    (the cost of a row in a narrow table still follows its pages, in two steps). With ``HAS_BUDGETS`` the row picks ``budgets[seq] // PAGE_SIZE`` pages (at most ``BUDGET``).
    With ``HAS_ACTIVE`` the program of a row whose sequence's flag (``active[seq]``) is 0
    reads no score and writes nothing: it loads its flag beside its length and budget (independent loads, one
    round trip) and returns. (The flag tested before those two loads made ptxas cap the kernel at 64 registers
    and spill at the default chunk in an sm_90 compile, tests/ops/test_triton_compile.py; this order keeps 78
    and no spill.)"""
    head = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    active = 1
    if HAS_ACTIVE:
        active = tl.load(active_ptr + seq)
    num_pages, to_pick = _row_pages(lens_ptr, budgets_ptr, seq, max_pages, PAGE_SIZE, BUDGET, HAS_BUDGETS)
    if active == 0:  # the sequence keeps its last selection
        return
    scores_row = scores_ptr + seq * stride_sb + head * stride_sh
    out_row = out_ptr + seq * stride_ob + head * stride_oh
    if SINGLE and BLOCK >= 2:
        if tl.minimum(num_pages, max_pages) <= BLOCK // 2:
            _select_row(scores_row, out_row, num_pages, to_pick, max_pages, BUDGET, SINK, RECENT, BLOCK // 2, True)
        else:
            _select_row(scores_row, out_row, num_pages, to_pick, max_pages, BUDGET, SINK, RECENT, BLOCK, True)
    else:
        _select_row(scores_row, out_row, num_pages, to_pick, max_pages, BUDGET, SINK, RECENT, BLOCK, SINGLE)


@triton.jit
def _merged_prefix(hist_ptr, key, match, remaining,
                   PASSES: tl.constexpr, DIGIT_BITS: tl.constexpr, BINS: tl.constexpr):
    """The threshold's top ``PASSES`` digits from a row's merged histograms ``hist_ptr``
    ``[>= PASSES, BINS]``: ``(prefix, match & key has that prefix, keys still to pick below it)``."""
    bins = tl.arange(0, BINS)
    prefix = tl.zeros([], tl.uint32)
    for p in tl.static_range(PASSES):
        pick, above = _pick(tl.load(hist_ptr + p * BINS + bins), bins, remaining)
        remaining -= above
        prefix = prefix | (pick.to(tl.uint32) << (32 - (p + 1) * DIGIT_BITS))
        match = match & (((key >> (32 - (p + 1) * DIGIT_BITS)) & (BINS - 1)).to(tl.int32) == pick)
    return prefix, match, remaining


@triton.jit
def _chunk_keys(scores_ptr, lens_ptr, budgets_ptr, max_pages, stride_sb, stride_sh,
                PAGE_SIZE: tl.constexpr, BUDGET: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
                HAS_BUDGETS: tl.constexpr, CHUNK: tl.constexpr):
    """What every split-select program of grid (chunk, head, sequence) starts from: ``(chunk, seq, head,
    row, page indices of the chunk, valid, keys, pages the row picks)``; a row that picks none has no
    valid page."""
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    row = seq * tl.num_programs(1) + head
    num_pages, to_pick = _row_pages(lens_ptr, budgets_ptr, seq, max_pages, PAGE_SIZE, BUDGET, HAS_BUDGETS)
    i = chunk * CHUNK + tl.arange(0, CHUNK)
    valid, key = _page_keys(scores_ptr + seq * stride_sb + head * stride_sh, i, num_pages, max_pages, SINK, RECENT)
    return chunk, seq, head, row, i, valid & (to_pick > 0), key, to_pick


@triton.jit
def _split_histogram_kernel(
    scores_ptr, lens_ptr, budgets_ptr, active_ptr, hist_ptr, chunk_hist_ptr, chunk_above_ptr,
    max_pages,
    stride_sb, stride_sh,
    PAGE_SIZE: tl.constexpr, BUDGET: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
    HAS_BUDGETS: tl.constexpr, CHUNK: tl.constexpr, DIGIT_BITS: tl.constexpr, BINS: tl.constexpr,
    LAST_BINS: tl.constexpr, NUM_PASSES: tl.constexpr, HAS_ACTIVE: tl.constexpr, PASS: tl.constexpr,
):
    """Histogram pass ``PASS`` of the split select, one program per (chunk, head, sequence).

    The program recomputes its chunk's keys and, from the row's merged histograms of the earlier
    passes, the threshold's top ``PASS`` digits; it histograms digit ``PASS`` of the chunk's keys
    that share them. Every pass but the last adds the histogram into the row's merged one (global
    atomics); the last pass (the low bits) stores it per chunk with the count of the chunk's keys
    whose prefix is larger, which is what the compaction needs to place every chunk. A program of a
    row of an inactive sequence (``HAS_ACTIVE``, ``active[seq]`` 0) returns at once: its row's histograms
    stay as they are.
    """
    if HAS_ACTIVE:
        if tl.load(active_ptr + tl.program_id(2)) == 0:
            return
    chunk, seq, head, row, i, valid, key, to_pick = _chunk_keys(
        scores_ptr, lens_ptr, budgets_ptr, max_pages, stride_sb, stride_sh,
        PAGE_SIZE, BUDGET, SINK, RECENT, HAS_BUDGETS, CHUNK)
    num_chunks = tl.num_programs(0)
    row_hist = hist_ptr + row * (NUM_PASSES - 1) * BINS
    prefix, match, _ = _merged_prefix(row_hist, key, valid, to_pick, PASS, DIGIT_BITS, BINS)
    if PASS == NUM_PASSES - 1:
        LAST_BITS: tl.constexpr = 32 - PASS * DIGIT_BITS
        hist = tl.histogram((key & (LAST_BINS - 1)).to(tl.int32), LAST_BINS, mask=match)
        tl.store(chunk_hist_ptr + (row * num_chunks + chunk) * LAST_BINS + tl.arange(0, LAST_BINS), hist)
        above = tl.sum((valid & ((key >> LAST_BITS) > (prefix >> LAST_BITS))).to(tl.int32), axis=0)
        tl.store(chunk_above_ptr + row * num_chunks + chunk, above)
    else:
        SHIFT: tl.constexpr = 32 - (PASS + 1) * DIGIT_BITS
        hist = tl.histogram(((key >> SHIFT) & (BINS - 1)).to(tl.int32), BINS, mask=match)
        tl.atomic_add(row_hist + PASS * BINS + tl.arange(0, BINS), hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _split_compact_kernel(
    scores_ptr, lens_ptr, budgets_ptr, active_ptr, hist_ptr, chunk_hist_ptr, chunk_above_ptr, counter_ptr, out_ptr,
    max_pages,
    stride_sb, stride_sh,
    stride_ob, stride_oh,
    PAGE_SIZE: tl.constexpr, BUDGET: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
    HAS_BUDGETS: tl.constexpr, CHUNK: tl.constexpr, DIGIT_BITS: tl.constexpr, BINS: tl.constexpr,
    LAST_BINS: tl.constexpr, NUM_PASSES: tl.constexpr, HAS_ACTIVE: tl.constexpr, BLOCK_C: tl.constexpr,
    PAD_BLOCK: tl.constexpr,
):
    """Last launch of the split select, one program per (chunk, head, sequence).

    From the merged histograms and every chunk's last-pass histogram the program gets the
    threshold key ``T``, the ties at ``T`` the row keeps, and per chunk the keys above ``T`` and
    at ``T``; ties go to the lowest chunks first, so the chunk's output offset is the sum of the
    earlier chunks' kept pages and its own tie quota follows. It writes its kept pages in ascending
    order and its share of the ``-1`` padding, then takes a ticket: the row's last program zeroes
    the merged histograms and the counter for the next launch. A program of a row of an
    inactive sequence (``HAS_ACTIVE``, ``active[seq]`` 0) returns at once: no output, no ticket (its row's
    scratch was never touched).
    """
    if HAS_ACTIVE:
        if tl.load(active_ptr + tl.program_id(2)) == 0:
            return
    chunk, seq, head, row, i, valid, key, to_pick = _chunk_keys(
        scores_ptr, lens_ptr, budgets_ptr, max_pages, stride_sb, stride_sh,
        PAGE_SIZE, BUDGET, SINK, RECENT, HAS_BUDGETS, CHUNK)
    num_chunks = tl.num_programs(0)
    row_hist = hist_ptr + row * (NUM_PASSES - 1) * BINS
    prefix, _, remaining = _merged_prefix(row_hist, key, valid, to_pick, NUM_PASSES - 1, DIGIT_BITS, BINS)

    c = tl.arange(0, BLOCK_C)
    lbins = tl.arange(0, LAST_BINS)
    in_row = c < num_chunks
    hists = tl.load(chunk_hist_ptr + (row * num_chunks + c[:, None]) * LAST_BINS + lbins[None, :],
                    mask=in_row[:, None], other=0)  # [BLOCK_C, LAST_BINS]
    last, above_last = _pick(tl.sum(hists, axis=0), lbins, remaining)
    ties = remaining - above_last  # keys equal to the threshold the row keeps
    threshold = prefix | last.to(tl.uint32)
    above = tl.load(chunk_above_ptr + row * num_chunks + c, mask=in_row, other=0)
    above += tl.sum(tl.where(lbins[None, :] > last, hists, 0), axis=1)
    equal = tl.sum(tl.where(lbins[None, :] == last, hists, 0), axis=1)
    equal_before = tl.cumsum(equal, axis=0) - equal
    kept = above + tl.minimum(tl.maximum(ties - equal_before, 0), equal)
    kept_before = tl.cumsum(kept, axis=0) - kept
    mine = c == chunk
    offset = tl.sum(tl.where(mine, kept_before, 0), axis=0)
    ties -= tl.sum(tl.where(mine, equal_before, 0), axis=0)

    tie = (valid & (key == threshold)).to(tl.int32)
    chosen = valid & ((key > threshold) | ((tie == 1) & (tl.cumsum(tie, axis=0) - tie < ties)))
    flag = chosen.to(tl.int32)
    out_row = out_ptr + seq * stride_ob + head * stride_oh
    tl.store(out_row + offset + tl.cumsum(flag, axis=0) - flag, i, mask=chosen)
    j = chunk * PAD_BLOCK + tl.arange(0, PAD_BLOCK)
    tl.store(out_row + j, tl.full([PAD_BLOCK], -1, tl.int32), mask=(j >= tl.sum(kept, axis=0)) & (j < BUDGET))

    counter = counter_ptr + row
    if last_to_arrive(counter, num_chunks):  # every program's histogram loads happen before the reset
        zeros = tl.zeros([BINS], tl.int32)
        for p in tl.static_range(NUM_PASSES - 1):
            tl.store(row_hist + p * BINS + tl.arange(0, BINS), zeros)
        reset_ticket(counter)


def _num_passes(digit_bits: int) -> int:
    if not 1 <= digit_bits <= 16:
        raise ValueError(f"digit_bits must be in [1, 16], got {digit_bits}")
    return triton.cdiv(32, digit_bits)


def select_buffers(
    batch: int,
    num_sel_heads: int,
    max_pages: int,
    device: torch.device,
    chunk_pages: Optional[int] = None,
    digit_bits: Optional[int] = None,
) -> SelectBuffers:
    """Scratch of the split select for ``scores`` ``[batch, num_sel_heads, max_pages]``.

    ``chunk_pages`` (a power of two, default ``_SPLIT_CHUNK_PAGES``) pages per program and
    ``digit_bits`` (default ``_DIGIT_BITS``) bits per radix digit give ``num_chunks =
    ceil(max_pages / chunk_pages)`` and ``P = ceil(32 / digit_bits)`` passes. Fields (int32,
    contiguous): ``hist`` ``[batch, num_sel_heads, P - 1, 2**digit_bits]`` merged histograms and
    ``counters`` ``[batch, num_sel_heads]`` (zero; every launch leaves them zero), ``chunk_hist``
    ``[batch, num_sel_heads, num_chunks, 2**(32 - (P - 1) * digit_bits)]`` and ``chunk_above``
    ``[batch, num_sel_heads, num_chunks]`` (overwritten by every launch), and ``chunk_pages``.
    """
    chunk_pages = _SPLIT_CHUNK_PAGES if chunk_pages is None else int(chunk_pages)
    digit_bits = _DIGIT_BITS if digit_bits is None else int(digit_bits)
    if chunk_pages < 1 or chunk_pages & (chunk_pages - 1):
        raise ValueError(f"chunk_pages must be a power of two, got {chunk_pages}")
    passes = _num_passes(digit_bits)
    num_chunks = max(1, triton.cdiv(max_pages, chunk_pages))
    rows = (batch, num_sel_heads)
    return SelectBuffers(
        hist=torch.zeros(rows + (passes - 1, 1 << digit_bits), dtype=torch.int32, device=device),
        chunk_hist=torch.empty(rows + (num_chunks, 1 << (32 - (passes - 1) * digit_bits)), dtype=torch.int32, device=device),
        chunk_above=torch.empty(rows + (num_chunks,), dtype=torch.int32, device=device),
        counters=torch.zeros(rows, dtype=torch.int32, device=device),
        chunk_pages=chunk_pages,
    )


def _select_split(out, buffers, scores, seq_lens, budgets, page_size, budget_pages, sink_pages, recent_pages,
                  active=None):
    """The split path's ``P`` histogram launches and its compaction, after checking ``buffers``."""
    batch, heads, max_pages = scores.shape
    hist, chunk_hist, chunk_above, counters, chunk_pages = buffers
    bins = hist.shape[-1]
    digit_bits = bins.bit_length() - 1
    passes = _num_passes(digit_bits)
    num_chunks = max(1, triton.cdiv(max_pages, chunk_pages))
    last_bins = 1 << (32 - (passes - 1) * digit_bits)
    check_shape("hist", hist, (batch, heads, passes - 1, bins))
    check_shape("chunk_hist", chunk_hist, (batch, heads, num_chunks, last_bins))
    check_shape("chunk_above", chunk_above, (batch, heads, num_chunks))
    check_shape("counters", counters, (batch, heads))
    for name, tensor in (("hist", hist), ("chunk_hist", chunk_hist), ("chunk_above", chunk_above), ("counters", counters)):
        if tensor.dtype != torch.int32 or not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous int32, got {tensor.dtype}")
    grid = (num_chunks, heads, batch)
    common = dict(
        PAGE_SIZE=page_size, BUDGET=budget_pages, SINK=sink_pages, RECENT=recent_pages,
        HAS_BUDGETS=budgets is not None, CHUNK=chunk_pages, DIGIT_BITS=digit_bits, BINS=bins,
        LAST_BINS=last_bins, NUM_PASSES=passes, HAS_ACTIVE=active is not None,
        num_warps=min(_MAX_WARPS, max(_MIN_WARPS, chunk_pages // (32 * _KEYS_PER_THREAD))),
    )
    budgets = seq_lens if budgets is None else budgets
    active = seq_lens if active is None else active  # not read without HAS_ACTIVE
    for p in range(passes):
        _split_histogram_kernel[grid](
            scores, seq_lens, budgets, active, hist, chunk_hist, chunk_above,
            max_pages, scores.stride(0), scores.stride(1),
            PASS=p, **common,
        )
    _split_compact_kernel[grid](
        scores, seq_lens, budgets, active, hist, chunk_hist, chunk_above, counters, out,
        max_pages, scores.stride(0), scores.stride(1), out.stride(0), out.stride(1),
        BLOCK_C=next_pow2(num_chunks), PAD_BLOCK=next_pow2(triton.cdiv(budget_pages, num_chunks)), **common,
    )


def takes_split_path(batch: int, num_sel_heads: int, max_pages: int, split: Optional[bool] = None) -> bool:
    """Whether a select of ``[batch, num_sel_heads, max_pages]`` scores runs the split path: ``split``
    when given, else ``max_pages >= _SPLIT_MIN_PAGES`` and ``batch * num_sel_heads <= _SPLIT_MAX_ROWS``."""
    if split is not None:
        return bool(split)
    return max_pages >= _SPLIT_MIN_PAGES and batch * num_sel_heads <= _SPLIT_MAX_ROWS


def check_select_args(out, batch, heads, seq_lens, budget_pages, sink_pages, recent_pages, budgets,
                      active=None) -> None:
    """The checks of a select's arguments other than the scores (``ValueError`` on the first failure):
    ``out`` ``[batch, heads, >= budget_pages]`` int32, contiguous in its last dimension (any row strides)."""
    check_shape("seq_lens", seq_lens, (batch,))
    check_select_out(out, batch, heads, budget_pages)
    if out.dtype != torch.int32:
        raise ValueError(f"out must be int32, got {out.dtype}")
    if budget_pages < 1 or sink_pages < 0 or recent_pages < 0:
        raise ValueError(f"need budget_pages >= 1 and sink/recent >= 0, got {budget_pages}/{sink_pages}/{recent_pages}")
    check_last_dim_contiguous(out=out)
    if budgets is not None:
        check_shape("budgets", budgets, (batch,))
        if budgets.dtype != torch.int32:
            raise ValueError(f"budgets must be int32, got {budgets.dtype}")
    if active is not None:
        check_active(active, batch, out.device)


def row_launch(max_pages: int) -> dict:
    """Chunk size, ``SINGLE`` and warps of the one-program select of rows of ``max_pages`` columns: one
    chunk of ``next_pow2(max_pages)`` pages up to ``_ROW_SINGLE_PAGES`` columns, chunks of ``_ROW_BLOCK``
    pages above."""
    width = next_pow2(max_pages)
    single = width <= _ROW_SINGLE_PAGES
    block = width if single else _ROW_BLOCK
    warps = min(_SINGLE_MAX_WARPS if single else _MAX_WARPS, max(_MIN_WARPS, block // (32 * _ROW_KEYS_PER_THREAD)))
    return dict(BLOCK=block, SINGLE=single, num_warps=warps)


def select_pages_into(
    out: torch.Tensor,
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    budget_pages: int,
    sink_pages: int = 0,
    recent_pages: int = 0,
    budgets: Optional[torch.Tensor] = None,
    buffers: Optional[SelectBuffers] = None,
    split: Optional[bool] = None,
    active: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`select_pages` into columns ``[0, budget_pages)`` of a preallocated ``out`` ``[batch,
    num_sel_heads, width]`` int32 (``width >= budget_pages``, contiguous in its last dimension, any row
    strides; columns past ``budget_pages`` are never touched), with no host synchronisation. Returns ``out``.

    Args:
        budgets: ``[batch]`` int32 token budgets or ``None`` (see :mod:`questkv.ops.reference`).
        buffers: :func:`select_buffers` for ``scores``' shape, used by the split path (allocated
            here when ``None``, zero-filled: pass them for a CUDA graph).
        split: ``None`` takes the split path (``P + 1`` launches) when ``max_pages >=
            _SPLIT_MIN_PAGES`` and ``batch * num_sel_heads <= _SPLIT_MAX_ROWS``, the
            one-program-per-row kernel (one launch) otherwise; ``True`` / ``False`` force one.
            Both give the same result.
        active: ``None`` (every sequence) or contiguous ``[batch]`` int32 on ``out``'s device: a sequence
            whose flag is 0 leaves its rows of ``out`` and of ``buffers`` untouched (on either path every
            program of theirs returns after reading the flag, before reading a score).
    """
    batch, heads, max_pages = scores.shape
    check_select_args(out, batch, heads, seq_lens, budget_pages, sink_pages, recent_pages, budgets, active)
    if scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32, got {scores.dtype}")
    check_last_dim_contiguous(scores=scores)
    if takes_split_path(batch, heads, max_pages, split):
        if buffers is None:
            buffers = select_buffers(batch, heads, max_pages, scores.device)
        _select_split(out, buffers, scores, seq_lens, budgets, page_size, budget_pages, sink_pages, recent_pages,
                      active)
        return out
    _select_pages_kernel[(heads, batch)](
        scores, seq_lens, seq_lens if budgets is None else budgets, seq_lens if active is None else active, out,
        max_pages,
        scores.stride(0), scores.stride(1),
        out.stride(0), out.stride(1),
        PAGE_SIZE=page_size, BUDGET=budget_pages, SINK=sink_pages, RECENT=recent_pages,
        HAS_BUDGETS=budgets is not None, HAS_ACTIVE=active is not None, **row_launch(max_pages),
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
