"""Low-bit key codes (opt-in): encode full pages' keys, and score pages from the codes.

Layout and code definition: :mod:`questkv.ops.reference` (``codes``). Not wired into the cache or the
decode step yet, and unmeasured on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from questkv.ops import reference
from questkv.ops.triton._common import check_last_dim_contiguous, check_shape, interpreting, next_pow2
from questkv.ops.triton.estimate import _MODE_Q_HEAD, _mode, _store_page_scores
# Launch configuration of the scores kernel (untimed): pages per program and warps. A program decodes
# BLOCK_P * page_size keys of head_dim channels in registers (32 x 128 at page 16). Chosen from ptxas -v
# for sm_90 at head_dim 128, GQA 4: 147 registers and no spills with 4 warps for 16-bit queries (4 pages
# and 4 warps spilled at 255 registers); float32 queries (IEEE dots) need 8 warps not to spill.
_BLOCK_P = 2
_NUM_WARPS = 4
_NUM_WARPS_FP32 = 8


def scores_num_warps(dot_fp32: bool) -> int:
    """Warps of the scores kernel: :data:`_NUM_WARPS`, or :data:`_NUM_WARPS_FP32` for float32 dot operands."""
    return _NUM_WARPS_FP32 if dot_fp32 else _NUM_WARPS


@triton.jit
def _encode_page_keys_kernel(
    codes_ptr, k_pages_ptr, kmin_ptr, kmax_ptr, pages_ptr,
    stride_cp, stride_ct, stride_ch,
    stride_kp, stride_kt, stride_kh,
    stride_bp, stride_bh,
    PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, NBYTES: tl.constexpr, BLOCK_B: tl.constexpr,
    BITS: tl.constexpr,
):
    """One program per (page of ``pages``, KV head): every byte ``j`` of a key's codes gathers its
    ``8 // BITS`` channels ``j * (8 // BITS) + i`` at bit offsets ``i * BITS`` (little-end first).
    Cell indices are computed in float32 exactly as the reference does (``width`` scaled by the exact
    power of two ``2**-BITS``, a correctly rounded division), so the codes are the reference's bit
    for bit."""
    PER: tl.constexpr = 8 // BITS
    CELLS: tl.constexpr = 1 << BITS
    page = tl.load(pages_ptr + tl.program_id(0)).to(tl.int64)
    head = tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_B)
    mask = (t[:, None] < PAGE_SIZE) & (j[None, :] < NBYTES)
    packed = tl.zeros((BLOCK_T, BLOCK_B), dtype=tl.int32)
    for i in tl.static_range(PER):
        d = j * PER + i
        lo = tl.load(kmin_ptr + page * stride_bp + head * stride_bh + d, mask=j < NBYTES, other=0.0).to(tl.float32)
        hi = tl.load(kmax_ptr + page * stride_bp + head * stride_bh + d, mask=j < NBYTES, other=0.0).to(tl.float32)
        width = (hi - lo) * (1.0 / CELLS)
        safe = tl.where(width > 0, width, 1.0)
        k = tl.load(k_pages_ptr + page * stride_kp + t[:, None] * stride_kt + head * stride_kh + d[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        cell = tl.floor(tl.math.div_rn(k - lo[None, :], safe[None, :]))
        cell = tl.where(cell > 0, cell, 0.0)  # NaN -> 0
        cell = tl.where(cell < CELLS - 1, cell, CELLS - 1.0)
        cell = tl.where(width[None, :] > 0, cell, 0.0)
        packed |= cell.to(tl.int32) << (i * BITS)
    tl.store(codes_ptr + page * stride_cp + t[:, None] * stride_ct + head * stride_ch + j[None, :],
             packed.to(tl.uint8), mask=mask)


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
        PAGE_SIZE=page_size, BLOCK_T=next_pow2(page_size), NBYTES=nbytes, BLOCK_B=next_pow2(nbytes), BITS=bits,
        num_warps=1 if page_size * nbytes <= 1024 else 4,
    )


@triton.jit
def _page_scores_codes_kernel(
    q_ptr, codes_ptr, kmin_ptr, kmax_ptr, table_ptr, lens_ptr, out_ptr,
    max_pages,
    stride_qb, stride_qh,
    stride_cp, stride_ct, stride_ch,
    stride_bp, stride_bh,
    stride_tb,
    stride_ob, stride_oh,
    PAGE_SIZE: tl.constexpr, PS_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, BITS: tl.constexpr,
    MODE: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """One program per (KV head, block of ``BLOCK_P`` pages, sequence), heads fastest. The program
    decodes the block's ``BLOCK_P * PS_PAD`` keys in registers (channel ``d`` from byte
    ``d * BITS // 8`` at bit ``(d * BITS) % 8``; ``kmin + (c + 0.5) * w``, ``kmin`` where ``w = 0``),
    multiplies them with the KV head's query group in one ``tl.dot`` (float32 accumulation), masks
    the unwritten tokens to ``-inf`` and takes each page's maximum, then stores per query head
    (``MODE`` 0) or the group's sum (1) / max (2). With ``DOT_FP32`` (float32 queries, or the
    interpreter) the operands are float32 (IEEE); otherwise the decoded keys are split into two
    terms of the query's dtype, ``hi = k.to(dtype)`` and ``lo = (k - hi).to(dtype)``, and two dots
    run on the tensor cores: about 16 bits of each decoded key kept."""
    head = tl.program_id(0)
    pid_p = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    BLOCK_T: tl.constexpr = BLOCK_P * PS_PAD
    length = tl.load(lens_ptr + seq)
    num_pages = tl.cdiv(length, PAGE_SIZE)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    g = tl.arange(0, BLOCK_G)
    gmask = g < GROUP
    rows = head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qb + rows[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # token t of the block: page t // PS_PAD of the block, offset t % PS_PAD
    t = tl.arange(0, BLOCK_T)
    p_tok = pid_p * BLOCK_P + t // PS_PAD
    offset = t % PS_PAD
    written = (offset < PAGE_SIZE) & (p_tok < num_pages) & (p_tok * PAGE_SIZE + offset < length)
    physical = tl.load(table_ptr + seq * stride_tb + p_tok, mask=written, other=0).to(tl.int64)
    tmask = written[:, None] & dmask[None, :]
    bound = physical[:, None] * stride_bp + head * stride_bh + d[None, :]
    lo = tl.load(kmin_ptr + bound, mask=tmask, other=0.0).to(tl.float32)
    hi = tl.load(kmax_ptr + bound, mask=tmask, other=0.0).to(tl.float32)
    byte = tl.load(codes_ptr + physical[:, None] * stride_cp + offset[:, None] * stride_ct + head * stride_ch
                   + (d[None, :] * BITS) // 8, mask=tmask, other=0)
    cell = (byte.to(tl.int32) >> ((d[None, :] * BITS) % 8)) & ((1 << BITS) - 1)
    width = (hi - lo) * (1.0 / (1 << BITS))
    keys = tl.where(width > 0, lo + (cell.to(tl.float32) + 0.5) * width, lo)  # [BLOCK_T, BLOCK_D]
    if DOT_FP32:
        logits = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [BLOCK_G, BLOCK_T]
    else:
        k_hi = keys.to(q.dtype)
        k_lo = (keys - k_hi.to(tl.float32)).to(q.dtype)
        logits = tl.dot(q, tl.trans(k_hi))
        logits += tl.dot(q, tl.trans(k_lo))
    logits = tl.where(written[None, :], logits, float("-inf"))
    per_q = tl.max(tl.reshape(logits, (BLOCK_G, BLOCK_P, PS_PAD)), axis=2)  # [BLOCK_G, BLOCK_P]

    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    in_row = p < max_pages
    valid = in_row & (p < num_pages)
    _store_page_scores(out_ptr, seq, head, rows, p, per_q, valid, in_row, gmask, stride_ob, stride_oh, MODE)


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
) -> torch.Tensor:
    """:func:`page_scores_codes` into a preallocated ``out`` ``[batch, num_sel_heads, max_pages]``
    float32 (one launch, no host synchronisation). Returns ``out``."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = kmin.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    mode = _mode(selection, group_reduction)
    reference.check_key_codes(codes, num_kv_heads, head_dim, bits, page_size)
    max_pages = page_table.shape[1]
    sel_heads = num_q_heads if mode == _MODE_Q_HEAD else num_kv_heads
    check_shape("kmin", kmin, (kmin.shape[0], num_kv_heads, head_dim))
    check_shape("kmax", kmax, kmin.shape)
    check_shape("page_table", page_table, (batch, max_pages))
    check_shape("seq_lens", seq_lens, (batch,))
    check_shape("out", out, (batch, sel_heads, max_pages))
    if out.dtype != torch.float32 or kmin.stride() != kmax.stride():
        raise ValueError("out must be float32 and kmin/kmax must share strides")
    check_last_dim_contiguous(q=q, codes=codes, kmin=kmin, page_table=page_table, out=out)
    group = num_q_heads // num_kv_heads
    ps_pad = next_pow2(page_size)
    block_p = max(_BLOCK_P, 16 // ps_pad)  # tl.dot needs at least 16 tokens
    grid = (num_kv_heads, triton.cdiv(max_pages, block_p), batch)
    dot_fp32 = interpreting() or q.dtype == torch.float32
    _page_scores_codes_kernel[grid](
        q, codes, kmin, kmax, page_table, seq_lens, out,
        max_pages,
        q.stride(0), q.stride(1),
        codes.stride(0), codes.stride(1), codes.stride(2),
        kmin.stride(0), kmin.stride(1),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        PAGE_SIZE=page_size, PS_PAD=ps_pad, GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)), BLOCK_P=block_p, BITS=bits, MODE=mode,
        DOT_FP32=dot_fp32,
        num_warps=scores_num_warps(dot_fp32),
    )
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
) -> torch.Tensor:
    """Triton :func:`questkv.ops.reference.page_scores_codes`.

    Args:
        q: ``[batch, num_q_heads, head_dim]``, float32 / float16 / bfloat16.
        codes: ``[num_pages, page_size, num_kv_heads, head_dim * bits // 8]`` uint8.
        kmin, kmax: ``[num_pages, num_kv_heads, head_dim]``.
        page_table: ``[batch, max_pages]`` int32 (entries past a sequence's pages are never read).
        seq_lens: ``[batch]`` int32.

    Returns:
        ``[batch, num_sel_heads, max_pages]`` float32, ``-inf`` past each sequence's pages. Float32
        queries: float32 (IEEE) products; 16-bit queries: each decoded key as two 16-bit terms (about
        16 significant bits), float32 accumulation.
    """
    sel_heads = q.shape[1] if selection == "q_head" else kmin.shape[1]
    out = torch.empty((q.shape[0], sel_heads, page_table.shape[1]), dtype=torch.float32, device=q.device)
    return page_scores_codes_into(out, q, codes, kmin, kmax, page_table, seq_lens, page_size, bits, selection,
                                  group_reduction)
