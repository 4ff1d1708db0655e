"""Low-bit key codes (opt-in): encode full pages' keys, and score pages from the codes.

Layout and code definition: :mod:`questkv.ops.reference` (``codes``). The scores rank pages by best logit
(``rerank="max"``: the kernel writes the scores) or by attention mass (``"mass"``: the same kernel writes
each page's log-sum-exp per query head into a scratch, and :func:`questkv.ops.reference.page_mass_from_lse`,
shared with the policy, normalises and combines it). Not wired into the cache or the decode step yet.
Timed on an H200 (``benchmarks/results/kernels-h200.md``, max mode): instruction-bound, 0.43-0.54 TB/s
against the bound estimate's 3.9 TB/s on the same bytes; the mass mode has not run on a GPU yet.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from questkv.ops import reference
from questkv.ops.triton._common import check_last_dim_contiguous, check_shape, interpreting, next_pow2, num_sms
from questkv.ops.triton.estimate import _MODE_Q_HEAD, _store_page_scores, check_page_scores_args
# Launch configuration of the scores kernel (chosen from ptxas -v and SASS instruction counts for sm_90,
# not timed). A block of pages is decoded in registers for one batched dot: at most _BLOCK_P pages, with
# decoded cells + 2 x code bytes (the block's words and the next block's, prefetched) at most
# _BLOCK_BUDGET and products q * w (pages x group x head_dim) at most _BLOCK_QW, both counted 4x for
# float32 dots (an FMA path that holds more); programs loop over up to _BLOCKS_PER_PROGRAM blocks while
# that leaves at least _MIN_PROGRAMS_PER_SM programs per SM. 4 warps; 16-bit dots for groups of up to 8
# at most _MAX_REGISTERS registers, three programs per SM (Llama-3.1-8B shapes, 2-bit codes: 8 pages a
# block, 168 registers, no spills).
_BLOCK_P = 8
_BLOCK_BUDGET = 24576
_BLOCK_QW = 4096
_BLOCKS_PER_PROGRAM = 8
_MIN_PROGRAMS_PER_SM = 4
_NUM_WARPS = 4
_MAX_REGISTERS = 168
_MAGIC = 0x4B000000  # float32 2**23, passed as an argument so that it stays in a register: one LOP3 a cell


@triton.jit
def _encode_page_keys_kernel(
    codes_ptr, k_pages_ptr, kmin_ptr, kmax_ptr, pages_ptr,
    stride_cp, stride_ct, stride_ch,
    stride_kp, stride_kt, stride_kh,
    stride_bp, stride_bh,
    PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr, NBYTES: tl.constexpr,
    BLOCK_B: tl.constexpr, BITS: tl.constexpr,
):
    """One program per (page of ``pages``, KV head): the page's keys ``[page_size, head_dim]`` and
    bounds ``[head_dim]`` are read once, contiguously; each cell index is computed in float32 exactly
    as the reference does (``width`` scaled by the exact power of two ``2**-BITS``, a correctly rounded
    division), so the codes are the reference's bit for bit; channel ``d`` is shifted to bit
    ``(d % (8 // BITS)) * BITS`` and each byte's ``8 // BITS`` channels summed (disjoint bits: an OR)."""
    PER: tl.constexpr = 8 // BITS
    CELLS: tl.constexpr = 1 << BITS
    BLOCK_D: tl.constexpr = BLOCK_B * PER
    page = tl.load(pages_ptr + tl.program_id(0)).to(tl.int64)
    head = tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    lo = tl.load(kmin_ptr + page * stride_bp + head * stride_bh + d, mask=dmask, other=0.0).to(tl.float32)
    hi = tl.load(kmax_ptr + page * stride_bp + head * stride_bh + d, mask=dmask, other=0.0).to(tl.float32)
    width = (hi - lo) * (1.0 / CELLS)
    safe = tl.where(width > 0, width, 1.0)
    tmask = t < PAGE_SIZE
    k = tl.load(k_pages_ptr + page * stride_kp + t[:, None] * stride_kt + head * stride_kh + d[None, :],
                mask=tmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    cell = tl.floor(tl.math.div_rn(k - lo[None, :], safe[None, :]))
    cell = tl.where(cell > 0, cell, 0.0)  # NaN -> 0
    cell = tl.where(cell < CELLS - 1, cell, CELLS - 1.0)
    cell = tl.where(width[None, :] > 0, cell, 0.0)
    shifted = cell.to(tl.int32) << ((d % PER) * BITS)[None, :]
    packed = tl.sum(tl.reshape(shifted, (BLOCK_T, BLOCK_B, PER)), axis=2)  # [BLOCK_T, BLOCK_B]
    j = tl.arange(0, BLOCK_B)
    tl.store(codes_ptr + page * stride_cp + t[:, None] * stride_ct + head * stride_ch + j[None, :],
             packed.to(tl.uint8), mask=tmask[:, None] & (j < NBYTES)[None, :])


def encode_page_keys(
    codes: torch.Tensor,
    k_pages: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    pages: torch.Tensor,
    bits: int,
) -> None:
    """Triton :func:`questkv.ops.reference.encode_page_keys`: one launch, grid (page, KV head).

    Args:
        codes: ``[num_pages, page_size, num_kv_heads, head_dim * bits // 8]`` uint8, written.
        k_pages: ``[num_pages, page_size, num_kv_heads, head_dim]``.
        kmin, kmax: ``[num_pages, num_kv_heads, head_dim]``, dtype of ``k_pages``.
        pages: ``[n]`` int32 (or int64) physical pages, distinct.
        bits: one of :data:`questkv.ops.reference.KEY_CODE_BITS`.
    """
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    reference.check_key_codes(codes, num_kv_heads, head_dim, bits, page_size, num_pages)
    check_shape("kmin", kmin, (num_pages, num_kv_heads, head_dim))
    check_shape("kmax", kmax, kmin.shape)
    if pages.dim() != 1:
        raise ValueError(f"pages must be 1-D, got shape {tuple(pages.shape)}")
    if kmin.stride() != kmax.stride():
        raise ValueError("kmin/kmax must share strides")
    check_last_dim_contiguous(codes=codes, k_pages=k_pages, kmin=kmin)
    if pages.numel() == 0:
        return
    nbytes = reference.key_code_bytes(head_dim, bits)
    _encode_page_keys_kernel[(pages.numel(), num_kv_heads)](
        codes, k_pages, kmin, kmax, pages.contiguous(),
        codes.stride(0), codes.stride(1), codes.stride(2),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        kmin.stride(0), kmin.stride(1),
        PAGE_SIZE=page_size, BLOCK_T=next_pow2(page_size), HEAD_DIM=head_dim, NBYTES=nbytes, BLOCK_B=next_pow2(nbytes),
        BITS=bits, num_warps=1 if page_size * head_dim <= 1024 else 4,
    )


@triton.jit
def _code_cell(words, words_hi, magic, INDEX: tl.constexpr, BITS: tl.constexpr, PLUS_HALF: tl.constexpr):
    """Cell ``INDEX`` of every word, as a float32 ``c`` (``c + 0.5`` with ``PLUS_HALF``), exactly: the
    cell is masked in place (bit offset ``o < 16``, from ``words_hi = words >> 16`` past bit 15), OR-ed
    into the mantissa of ``2**23`` (``2**23 + c * 2**o``) and taken out again with one FMA
    (``x * 2**-o - 2**(23 - o)``, exact powers of two)."""
    OFF: tl.constexpr = INDEX * BITS
    if OFF >= 16:
        src = words_hi
        O: tl.constexpr = OFF - 16
    else:
        src = words
        O: tl.constexpr = OFF
    x = ((src & (((1 << BITS) - 1) << O)) | magic).to(tl.float32, bitcast=True)
    if PLUS_HALF:
        return tl.fma(x, 1.0 / (1 << O), 0.5 - 8388608.0 / (1 << O))
    else:
        return tl.fma(x, 1.0 / (1 << O), -8388608.0 / (1 << O))


@triton.jit
def _code_cells(words, words_hi, magic, FIRST: tl.constexpr, STRIDE: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr,
                PLUS_HALF: tl.constexpr):
    """Cells ``FIRST, FIRST + STRIDE, ..., FIRST + (N - 1) * STRIDE`` of every word, joined into ``N``
    trailing dimensions of 2 (``log2(N)`` of them) that flatten to that order: every cell of a word
    stays in the registers of the thread that holds the word."""
    if N == 1:
        return _code_cell(words, words_hi, magic, FIRST, BITS, PLUS_HALF)
    else:
        return tl.join(_code_cells(words, words_hi, magic, FIRST, 2 * STRIDE, N // 2, BITS, PLUS_HALF),
                       _code_cells(words, words_hi, magic, FIRST + STRIDE, 2 * STRIDE, N // 2, BITS, PLUS_HALF))


@triton.jit
def _page_scores_codes_kernel(
    q_ptr, codes_ptr, kmin_ptr, kmax_ptr, table_ptr, lens_ptr, out_ptr,
    max_pages, magic, sm_scale,
    stride_qb, stride_qh,
    stride_cp, stride_ct, stride_ch,
    stride_bp, stride_bh,
    stride_tb,
    stride_ob, stride_oh,
    PAGE_SIZE: tl.constexpr, PS_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BITS: tl.constexpr, UNIT: tl.constexpr,
    NUM_UNITS: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_P: tl.constexpr, BLOCKS: tl.constexpr,
    MODE: tl.constexpr, DOT_FP32: tl.constexpr, FP16: tl.constexpr, MASS: tl.constexpr,
):
    """One program per (KV head, ``BLOCKS`` consecutive blocks of ``BLOCK_P`` pages, sequence), heads
    fastest (the programs reading one page's codes and bounds run together); a loop over the blocks
    that requests the bounds and codes of block ``i + 1`` and the page numbers of block ``i + 2`` before
    it scores block ``i``.

    A token's logit is the reference's ``q . k``, ``k = kmin + (c + 0.5) * w`` (``w = (kmax - kmin) /
    2**BITS``, ``0`` where not positive, which decodes to ``kmin`` as the reference does), summed as
    ``q . kmin + (c + 0.5) . (q * w)``. Per block: the bounds ``[BLOCK_P, head_dim]`` are read once per
    page and give ``q . kmin`` (one dot) and ``q * w`` (``[BLOCK_P, GROUP, head_dim]``, float32); the
    codes are read as ``UNIT``-byte words, ``[BLOCK_P, page_size, NUM_UNITS]`` (contiguous per token),
    and each word is unpacked in the registers of the thread that loaded it (:func:`_code_cells`: an
    AND-OR, one LOP3 with ``magic`` = ``2**23`` kept in a register, and one FMA per cell, exact); one
    batched ``tl.dot`` (batch = page: ``[page_size, head_dim] x [head_dim, group]``) gives
    ``(c + 0.5) . (q * w)`` for every token and query head of the block. The maximum ``m`` over each
    page's written tokens (the others masked to ``-inf``), plus ``q . kmin``, is stored per query head
    (``MODE`` 0) or as the group's sum (1) / max (2) (``_store_page_scores``). With ``MASS`` (launched
    with ``MODE`` 0 into an lse scratch) the page's ``lse = s (m + q . kmin) + ln sum_t exp(s (l_t - m))``
    over its written tokens' logits ``l_t`` (``s = sm_scale``) is stored instead, the sum in base 2 (one
    ``exp2`` per token, one ``log2`` per page and query head); nothing else changes, and ``sm_scale`` is
    unused without ``MASS``.

    With ``DOT_FP32`` (float32 queries, queries and bounds of different dtypes, or the interpreter)
    the dots take float32 operands (IEEE). Otherwise 16-bit operands on the tensor cores (bfloat16, or
    float16 for float16 queries), float32 accumulation: ``q . kmin`` is exact (16-bit products), the
    cells are exact (``c + 0.5`` has ``BITS + 1`` significant bits; for 8-bit codes and bfloat16 the
    cells are ``c`` and ``0.5 * sum(q * w)`` joins ``q . kmin``), and ``a = q * w`` is split into two
    16-bit terms, ``hi`` (``a`` with the float32 mantissa bits the 16-bit type lacks cleared: exact)
    and ``lo = a - hi`` (rounded), side by side in the dot's ``2 * BLOCK_G`` columns and summed after
    it: about 16 significant bits of ``q * w`` with bfloat16, 22 with float16."""
    head = tl.program_id(0)
    pid_p = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    CELLS: tl.constexpr = 1 << BITS
    PER_WORD: tl.constexpr = UNIT * 8 // BITS
    PLUS_HALF: tl.constexpr = DOT_FP32 or FP16 or BITS < 8
    if FP16:
        OP_DTYPE: tl.constexpr = tl.float16
        HI_MASK: tl.constexpr = -8192  # the float32 bits a float16 keeps (normal range)
    else:
        OP_DTYPE: tl.constexpr = tl.bfloat16
        HI_MASK: tl.constexpr = -65536  # the float32 bits a bfloat16 keeps
    length = tl.load(lens_ptr + seq)
    num_pages = tl.cdiv(length, PAGE_SIZE)

    g = tl.arange(0, BLOCK_G)
    gmask = g < GROUP
    rows = head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + rows[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    q_s = q.to(tl.float32)[None, :, :] * (1.0 / CELLS)  # q / 2**BITS (exact)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_t = tl.trans(q)  # [BLOCK_D, BLOCK_G]
    # the first block's data and the second's page numbers; in the loop, block i + 1's data and block
    # i + 2's page numbers are requested before block i is scored (nothing past the program's blocks)
    first = pid_p * BLOCKS
    physical = _block_pages(table_ptr, seq, stride_tb, first, num_pages, max_pages, BLOCK_P, True)
    lo, hi, words = _block_data(codes_ptr, kmin_ptr, kmax_ptr, physical, head, first, length, num_pages, max_pages,
                                stride_cp, stride_ct, stride_ch, stride_bp, stride_bh, PAGE_SIZE, PS_PAD, HEAD_DIM,
                                BLOCK_D, UNIT, NUM_UNITS, BLOCK_U, BLOCK_P, True)
    physical = _block_pages(table_ptr, seq, stride_tb, first + 1, num_pages, max_pages, BLOCK_P, BLOCKS > 1)
    for i in tl.range(0, BLOCKS, num_stages=1):
        blk = first + i
        cur_lo, cur_hi, cur_words = lo, hi, words
        lo, hi, words = _block_data(codes_ptr, kmin_ptr, kmax_ptr, physical, head, blk + 1, length, num_pages,
                                    max_pages, stride_cp, stride_ct, stride_ch, stride_bp, stride_bh, PAGE_SIZE, PS_PAD,
                                    HEAD_DIM, BLOCK_D, UNIT, NUM_UNITS, BLOCK_U, BLOCK_P, i + 1 < BLOCKS)
        physical = _block_pages(table_ptr, seq, stride_tb, blk + 2, num_pages, max_pages, BLOCK_P, i + 2 < BLOCKS)

        p = blk * BLOCK_P + tl.arange(0, BLOCK_P)
        in_row = p < max_pages
        valid = in_row & (p < num_pages)
        t = tl.arange(0, PS_PAD)
        written = ((t[None, :] < PAGE_SIZE) & valid[:, None]
                   & (p[:, None] * PAGE_SIZE + t[None, :] < length))  # [BLOCK_P, PS_PAD]
        cells = _code_cells(cur_words, cur_words >> 16, magic, 0, 1, PER_WORD, BITS, PLUS_HALF)
        cells = tl.reshape(cells, (BLOCK_P, PS_PAD, BLOCK_D))  # channel word * PER_WORD + cell

        # q * w, w = (kmax - kmin) / 2**BITS as the reference rounds it (0 where not positive or NaN);
        # [BLOCK_P, BLOCK_G, BLOCK_D] so that the elements of a thread share their page's bounds
        lo_f = cur_lo.to(tl.float32)
        hi_f = cur_hi.to(tl.float32)
        width = tl.where(hi_f > lo_f, hi_f - lo_f, 0.0)
        qw = q_s * width[:, None, :]
        if DOT_FP32:
            base = tl.dot(cur_lo.to(tl.float32), q_t, input_precision="ieee")  # [BLOCK_P, BLOCK_G]
            logits = tl.dot(cells, tl.permute(qw, (0, 2, 1)), input_precision="ieee")  # [BLOCK_P, PS_PAD, BLOCK_G]
        else:
            base = tl.dot(cur_lo.to(OP_DTYPE), q_t)
            if not PLUS_HALF:
                base += 0.5 * tl.sum(qw, axis=2)
            qw_hi = (qw.to(tl.int32, bitcast=True) & HI_MASK).to(tl.float32, bitcast=True)  # exact in OP_DTYPE
            pair = tl.join(qw_hi, qw - qw_hi).to(OP_DTYPE)
            pair = tl.reshape(tl.permute(pair, (0, 2, 1, 3)), (BLOCK_P, BLOCK_D, 2 * BLOCK_G))
            both = tl.dot(cells.to(OP_DTYPE), pair)  # [BLOCK_P, PS_PAD, 2 * BLOCK_G]
            logits = tl.sum(tl.reshape(both, (BLOCK_P, PS_PAD, BLOCK_G, 2)), axis=3)
        logits = tl.where(written[:, :, None], logits, float("-inf"))
        best = tl.max(logits, axis=1)  # [BLOCK_P, BLOCK_G]
        if MASS:
            live = best > float("-inf")  # pages past the sequence: lse -inf, no NaN
            qk_scale = sm_scale * 1.4426950408889634  # log2(e)
            total = tl.sum(tl.exp2((logits - tl.where(live, best, 0.0)[:, None, :]) * qk_scale), axis=1)
            lse = (best + base) * sm_scale + tl.log2(tl.where(live, total, 1.0)) * 0.6931471805599453  # ln 2
            per_q = tl.trans(lse)  # [BLOCK_G, BLOCK_P]
        else:
            per_q = tl.trans(best + base)  # [BLOCK_G, BLOCK_P]
        _store_page_scores(out_ptr, seq, head, rows, p, per_q, valid, in_row, gmask, stride_ob, stride_oh, MODE)


@triton.jit
def _block_pages(table_ptr, seq, stride_tb, blk, num_pages, max_pages, BLOCK_P: tl.constexpr, live):
    """Physical pages of block ``blk`` of sequence ``seq`` (0 past its pages, or everywhere unless ``live``)."""
    p = blk * BLOCK_P + tl.arange(0, BLOCK_P)
    valid = (p < max_pages) & (p < num_pages) & live
    return tl.load(table_ptr + seq * stride_tb + p, mask=valid, other=0).to(tl.int64)


@triton.jit
def _block_data(codes_ptr, kmin_ptr, kmax_ptr, physical, head, blk, length, num_pages, max_pages,
                stride_cp, stride_ct, stride_ch, stride_bp, stride_bh, PAGE_SIZE: tl.constexpr, PS_PAD: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UNIT: tl.constexpr, NUM_UNITS: tl.constexpr,
                BLOCK_U: tl.constexpr, BLOCK_P: tl.constexpr, live):
    """Block ``blk``'s bounds ``[BLOCK_P, BLOCK_D]`` and code words ``[BLOCK_P, PS_PAD, BLOCK_U]`` (int32),
    read only for its pages' written tokens (and only if ``live``; zeros elsewhere)."""
    p = blk * BLOCK_P + tl.arange(0, BLOCK_P)
    valid = (p < max_pages) & (p < num_pages) & live
    d = tl.arange(0, BLOCK_D)
    bound = physical[:, None] * stride_bp + head * stride_bh + d[None, :]
    bmask = valid[:, None] & (d < HEAD_DIM)[None, :]
    lo = tl.load(kmin_ptr + bound, mask=bmask, other=0.0)
    hi = tl.load(kmax_ptr + bound, mask=bmask, other=0.0)
    t = tl.arange(0, PS_PAD)
    written = (t[None, :] < PAGE_SIZE) & valid[:, None] & (p[:, None] * PAGE_SIZE + t[None, :] < length)
    rows_ptr = codes_ptr + physical[:, None, None] * stride_cp + t[None, :, None] * stride_ct + head * stride_ch
    if UNIT == 4:
        rows_ptr = rows_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    elif UNIT == 2:
        rows_ptr = rows_ptr.to(tl.pointer_type(tl.uint16), bitcast=True)
    u = tl.arange(0, BLOCK_U)
    words = tl.load(rows_ptr + u[None, None, :], mask=written[:, :, None] & (u < NUM_UNITS)[None, None, :],
                    other=0).to(tl.int32)
    return lo, hi, words


def _code_unit(codes: torch.Tensor, nbytes: int) -> int:
    """Bytes of the words the scores kernel reads the codes in: 4, or 2 / 1 where a key's bytes,
    the strides or the base address are not multiples of 4 (2)."""
    for unit in (4, 2):
        if nbytes % unit == 0 and codes.data_ptr() % unit == 0 and all(s % unit == 0 for s in codes.stride()[:3]):
            return unit
    return 1


def scores_block_pages(page_size: int, head_dim: int, group: int, bits: int, dot_fp32: bool) -> int:
    """Pages per block of the scores kernel: the largest power of two up to :data:`_BLOCK_P` within
    the block budgets (:data:`_BLOCK_BUDGET`, :data:`_BLOCK_QW`) for these shapes."""
    scale = 4 if dot_fp32 else 1
    per_page = next_pow2(page_size) * (next_pow2(head_dim) + 2 * reference.key_code_bytes(head_dim, bits))
    qw = next_pow2(group) * next_pow2(head_dim)
    pages = next_pow2(_BLOCK_P)
    while pages > 1 and (pages * per_page * scale > _BLOCK_BUDGET or pages * qw * scale > _BLOCK_QW):
        pages //= 2
    return pages


def scores_max_registers(group: int, dot_fp32: bool) -> Optional[int]:
    """Register cap (``maxnreg``) of the scores kernel: :data:`_MAX_REGISTERS` for 16-bit dots and
    groups of up to 8, none otherwise."""
    return None if dot_fp32 or next_pow2(group) > 8 else _MAX_REGISTERS


def scores_launch(batch: int, num_kv_heads: int, max_pages: int, block_p: int,
                  device: torch.device) -> tuple[tuple, int]:
    """Grid and blocks per program of the scores kernel, from the shapes alone (CUDA-graph safe): up
    to :data:`_BLOCKS_PER_PROGRAM` blocks of ``block_p`` pages per program, halved while that leaves
    fewer than :data:`_MIN_PROGRAMS_PER_SM` programs per SM."""
    blocks = triton.cdiv(max_pages, block_p)
    per_program = _BLOCKS_PER_PROGRAM
    min_programs = _MIN_PROGRAMS_PER_SM * num_sms(device)
    while per_program > 1 and num_kv_heads * triton.cdiv(blocks, per_program) * batch < min_programs:
        per_program //= 2
    per_program = max(1, min(per_program, blocks))
    return (num_kv_heads, triton.cdiv(blocks, per_program), batch), per_program


def page_scores_codes_into(
    out: torch.Tensor,
    q: torch.Tensor,
    codes: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    bits: int,
    selection: str = "kv_head",
    group_reduction: str = "sum",
    rerank: str = "max",
    sm_scale: Optional[float] = None,
) -> torch.Tensor:
    """:func:`page_scores_codes` into a preallocated ``out`` ``[batch, num_sel_heads, max_pages]``
    float32 (no host synchronisation; the grid depends on the shapes only, so the launch can be
    captured in a CUDA graph). ``"max"``: one launch. ``"mass"``: the kernel writes the lse of every
    (sequence, query head, page) into a scratch ``[batch, num_q_heads, max_pages]`` float32, and
    :func:`questkv.ops.reference.page_mass_from_lse` (a few small torch ops) turns it into ``out``.
    Returns ``out``."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, max_pages = kmin.shape[1], page_table.shape[1]
    mode, group = check_page_scores_args(out, q, kmin, kmax, page_table, seq_lens, selection, group_reduction)
    reference.check_rerank(rerank, sm_scale)
    reference.check_key_codes(codes, num_kv_heads, head_dim, bits, page_size)
    check_last_dim_contiguous(codes=codes)
    nbytes = reference.key_code_bytes(head_dim, bits)
    unit = _code_unit(codes, nbytes)
    num_units = nbytes // unit
    block_u = next_pow2(num_units)
    dot_fp32 = interpreting() or q.dtype == torch.float32 or q.dtype != kmin.dtype
    block_p = scores_block_pages(page_size, head_dim, group, bits, dot_fp32)
    grid, per_program = scores_launch(batch, num_kv_heads, max_pages, block_p, q.device)
    maxnreg = scores_max_registers(group, dot_fp32)
    mass = rerank == "mass"
    scores = torch.empty((batch, num_q_heads, max_pages), dtype=torch.float32, device=q.device) if mass else out
    _page_scores_codes_kernel[grid](
        q, codes, kmin, kmax, page_table, seq_lens, scores,
        max_pages, _MAGIC, head_dim**-0.5 if sm_scale is None else sm_scale,
        q.stride(0), q.stride(1),
        codes.stride(0), codes.stride(1), codes.stride(2),
        kmin.stride(0), kmin.stride(1),
        page_table.stride(0),
        scores.stride(0), scores.stride(1),
        PAGE_SIZE=page_size, PS_PAD=next_pow2(page_size), GROUP=group, BLOCK_G=next_pow2(group),
        HEAD_DIM=head_dim, BLOCK_D=block_u * unit * 8 // bits, BITS=bits, UNIT=unit, NUM_UNITS=num_units,
        BLOCK_U=block_u, BLOCK_P=block_p, BLOCKS=per_program, MODE=_MODE_Q_HEAD if mass else mode,
        DOT_FP32=dot_fp32, FP16=q.dtype == torch.float16, MASS=mass,
        num_warps=_NUM_WARPS, **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
    if mass:
        pages = reference.valid_pages(seq_lens, page_size, max_pages)[:, None, :].expand(out.shape)
        out.copy_(reference.page_mass_from_lse(scores, pages, num_kv_heads, selection, group_reduction))
    return out


def page_scores_codes(
    q: torch.Tensor,
    codes: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    bits: int,
    selection: str = "kv_head",
    group_reduction: str = "sum",
    rerank: str = "max",
    sm_scale: Optional[float] = None,
) -> torch.Tensor:
    """Triton :func:`questkv.ops.reference.page_scores_codes`.

    Args:
        q: ``[batch, num_q_heads, head_dim]``, float32 / float16 / bfloat16.
        codes: ``[num_pages, page_size, num_kv_heads, head_dim * bits // 8]`` uint8.
        kmin, kmax: ``[num_pages, num_kv_heads, head_dim]``.
        page_table: ``[batch, max_pages]`` int32 (entries past a sequence's pages are never read).
        seq_lens: ``[batch]`` int32.
        rerank: ``"max"`` (best logit) or ``"mass"`` (attention mass; see :func:`page_scores_codes_into`).
        sm_scale: the softmax scale of ``"mass"`` (``head_dim**-0.5`` when ``None``).

    Returns:
        ``[batch, num_sel_heads, max_pages]`` float32, ``-inf`` past each sequence's pages. Float32
        queries: float32 (IEEE) products; 16-bit queries: tensor-core dots with float32 accumulation,
        the cells and ``q . kmin`` exact, ``q * w`` as two 16-bit terms (about 16 significant bits with
        bfloat16, 22 with float16); see ``_page_scores_codes_kernel``.
    """
    sel_heads = q.shape[1] if selection == "q_head" else kmin.shape[1]
    out = torch.empty((q.shape[0], sel_heads, page_table.shape[1]), dtype=torch.float32, device=q.device)
    return page_scores_codes_into(out, q, codes, kmin, kmax, page_table, seq_lens, page_size, bits, selection,
                                  group_reduction, rerank, sm_scale)
