"""Append kernel: write K/V tokens into the page pool and update the touched pages' key bounds, optionally
rotating the step's queries and keys by their positions first (RoPE folded into the append: one launch per
layer where a decode step took three)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from questkv.ops.triton._common import (
    check_last_dim_contiguous, check_shape, interpreting, next_pow2, round_e4m3, use_pdl,
)


@triton.jit
def _rotate_pair(x1, x2, cos, sin):
    """``(x1 cos - x2 sin, x2 cos + x1 sin)`` in ``x1``'s dtype, every product and sum rounded to it as eager
    torch rounds (:func:`questkv.ops.reference.rotate`)."""
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    cos, sin = cos.to(tl.float32), sin.to(tl.float32)
    first = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    second = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    return first.to(dtype), second.to(dtype)


@triton.jit
def _e4m3_byte(x):
    """The float8 e4m3fn byte (int32, 0..255) of ``x`` rounded to nearest even, saturating at ±448 as torch's cast
    does (:func:`round_e4m3`'s arithmetic), so the interpreter and the GPU agree with torch bit for bit."""
    r = tl.abs(round_e4m3(x))
    bits = r.to(tl.int32, bitcast=True)
    normal = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)
    code = tl.where(r >= 0.015625, normal, (r * 512.0).to(tl.int32))  # below 2 ** -6: subnormal, m * 2 ** -9
    return code | tl.where(x.to(tl.float32).to(tl.int32, bitcast=True) < 0, 0x80, 0)


@triton.jit
def _e4m3_byte_cvt(x):
    """:func:`_e4m3_byte` by the hardware's conversion (``cvt.rn.satfinite``: nearest even, saturating; compiled
    kernels only), its byte in the low eight bits of an int32."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 pair; cvt.rn.satfinite.e4m3x2.f32 pair, 0f00000000, $1; cvt.u32.u16 $0, pair; }", "=r,r",
        [x.to(tl.float32)], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _fp8_order(byte):
    """:func:`questkv.ops.fp8_codes.fp8_order` of e4m3 bytes (int32): codes in the values' order."""
    return tl.where(byte >= 128, 255 - byte, 128 + byte)


@triton.jit
def _fp8_from_order(code):
    """:func:`questkv.ops.fp8_codes.fp8_from_order`: the e4m3 byte (int32) of an order code."""
    return tl.where(code >= 128, code - 128, 255 - code)


@triton.jit
def _stored(x, pages_ptr, FP8: tl.constexpr, CAST_FP8: tl.constexpr):
    """``x`` as the pool stores it (the pool's dtype, or with ``FP8``, the pool viewed as bytes, e4m3 bytes: with
    ``CAST_FP8`` (compiled, not interpreted) from the hardware's conversion, two instructions where
    :func:`_e4m3_byte` takes about twenty)."""
    if FP8:
        return (_e4m3_byte_cvt(x) if CAST_FP8 else _e4m3_byte(x)).to(tl.uint8)
    return x.to(pages_ptr.dtype.element_ty)


@triton.jit
def _bound_order(stored, FP8: tl.constexpr):
    """Stored keys or bounds (:func:`_stored`'s) in an order that min and max reduce: fp8 bytes' order codes
    (int32; -0 below +0, as the reference orders them), else float32."""
    return _fp8_order(stored.to(tl.int32)) if FP8 else stored.to(tl.float32)


@triton.jit
def _bound_value(order, ptr, FP8: tl.constexpr):
    """A bound in ``ptr``'s dtype from :func:`_bound_order`'s order."""
    return _fp8_from_order(order).to(tl.uint8) if FP8 else order.to(ptr.dtype.element_ty)


@triton.jit(do_not_specialize=["num_tokens"])  # every step's token count: one compiled variant for all
def _append_kv_kernel(
    k_pages_ptr, v_pages_ptr, kmin_ptr, kmax_ptr, slots_ptr, keys_ptr, values_ptr, q_ptr, cos_ptr, sin_ptr,
    num_tokens,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_bp, stride_bh,
    stride_xt, stride_xh,
    stride_yt, stride_yh,
    stride_qt, stride_qh,
    stride_ct, stride_st,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, FIRST: tl.constexpr,
    BLOCK_H: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, ROTATE: tl.constexpr,
    FP8: tl.constexpr, CAST_FP8: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per (token, KV head). Channels go in two parts, ``[0, FIRST)`` and ``[FIRST, HEAD_DIM)``
    (the halves that RoPE pairs; without ``ROTATE``, ``FIRST == HEAD_DIM`` and the second part is empty).

    With ``ROTATE`` the program rotates its token's ``GROUP`` query heads of its KV head in place. The first
    token of each run of same-page tokens (the run's *leader*) handles the whole run: it rotates the run's
    keys in place (no other program touches them), stores them and the values in the pool, and folds them
    into the page bounds.

    With ``USE_PDL`` it first loads what the kernel before it never writes (the step's slots and rotary tables,
    which are written before the kernels that produce q, keys and values), then waits for the kernels before it and
    at once lets the next kernel launch: the decode attention after it loads every page but a sequence's last (the
    one a decode step writes) before its own wait, so the two overlap."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    h = tl.arange(0, BLOCK_H)
    first_mask = h < FIRST
    second_mask = h < HEAD_DIM - FIRST
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    page = slot // PAGE_SIZE
    prev_slot = tl.load(slots_ptr + tok - 1, mask=tok > 0, other=0).to(tl.int64)
    leader = (tok == 0) | (prev_slot // PAGE_SIZE != page)
    # A page's tokens of one call are consecutive, so a leader's run lies in the next PAGE_SIZE rows; the other
    # programs' masks are all off.
    rows = tok + tl.arange(0, PAGE_SIZE)
    in_run = (rows < num_tokens) & leader
    row_slots = tl.load(slots_ptr + rows, mask=in_run, other=0).to(tl.int64)
    same = in_run & (row_slots // PAGE_SIZE == page)
    offsets = row_slots % PAGE_SIZE
    mask1 = same[:, None] & first_mask[None, :]
    mask2 = same[:, None] & second_mask[None, :]
    if ROTATE:
        cos = tl.load(cos_ptr + tok * stride_ct + h, mask=first_mask)[None, :]
        sin = tl.load(sin_ptr + tok * stride_st + h, mask=first_mask)[None, :]
        cos_rows = tl.load(cos_ptr + rows[:, None] * stride_ct + h[None, :], mask=mask1)
        sin_rows = tl.load(sin_ptr + rows[:, None] * stride_st + h[None, :], mask=mask1)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    if ROTATE:
        g = tl.arange(0, BLOCK_G)
        q_mask = (g < GROUP)[:, None] & first_mask[None, :]
        q_row = q_ptr + tok * stride_qt + (head * GROUP + g)[:, None] * stride_qh + h[None, :]
        q1, q2 = _rotate_pair(tl.load(q_row, mask=q_mask), tl.load(q_row + FIRST, mask=q_mask), cos, sin)
        tl.store(q_row, q1, mask=q_mask)
        tl.store(q_row + FIRST, q2, mask=q_mask)

    key_rows = keys_ptr + rows[:, None].to(tl.int64) * stride_xt + head * stride_xh + h[None, :]
    k1 = tl.load(key_rows, mask=mask1)
    k2 = tl.load(key_rows + FIRST, mask=mask2)
    if ROTATE:
        k1, k2 = _rotate_pair(k1, k2, cos_rows, sin_rows)
        tl.store(key_rows, k1, mask=mask1)
        tl.store(key_rows + FIRST, k2, mask=mask2)
    k1 = _stored(k1, k_pages_ptr, FP8, CAST_FP8)
    k2 = _stored(k2, k_pages_ptr, FP8, CAST_FP8)
    dest = k_pages_ptr + page * stride_kp + offsets[:, None] * stride_kt + head * stride_kh + h[None, :]
    tl.store(dest, k1, mask=mask1)
    tl.store(dest + FIRST, k2, mask=mask2)
    d = tl.arange(0, BLOCK_D)
    v_mask = same[:, None] & (d < HEAD_DIM)[None, :]
    value = tl.load(values_ptr + rows[:, None].to(tl.int64) * stride_yt + head * stride_yh + d[None, :], mask=v_mask)
    tl.store(v_pages_ptr + page * stride_vp + offsets[:, None] * stride_vt + head * stride_vh + d[None, :],
             _stored(value, v_pages_ptr, FP8, CAST_FP8), mask=v_mask)

    # exact: min / max of the stored keys
    key1, key2 = _bound_order(k1, FP8), _bound_order(k2, FP8)
    lo1 = tl.min(tl.where(mask1, key1, 255 if FP8 else float("inf")), axis=0)
    hi1 = tl.max(tl.where(mask1, key1, 0 if FP8 else float("-inf")), axis=0)
    lo2 = tl.min(tl.where(mask2, key2, 255 if FP8 else float("inf")), axis=0)
    hi2 = tl.max(tl.where(mask2, key2, 0 if FP8 else float("-inf")), axis=0)
    bound = page * stride_bp + head * stride_bh + h
    if leader & (slot % PAGE_SIZE != 0):  # the page already holds tokens: widen its bounds
        lo1 = tl.minimum(lo1, _bound_order(tl.load(kmin_ptr + bound, mask=first_mask), FP8))
        hi1 = tl.maximum(hi1, _bound_order(tl.load(kmax_ptr + bound, mask=first_mask), FP8))
        lo2 = tl.minimum(lo2, _bound_order(tl.load(kmin_ptr + bound + FIRST, mask=second_mask), FP8))
        hi2 = tl.maximum(hi2, _bound_order(tl.load(kmax_ptr + bound + FIRST, mask=second_mask), FP8))
    lead1 = first_mask & leader
    lead2 = second_mask & leader
    tl.store(kmin_ptr + bound, _bound_value(lo1, kmin_ptr, FP8), mask=lead1)
    tl.store(kmax_ptr + bound, _bound_value(hi1, kmax_ptr, FP8), mask=lead1)
    tl.store(kmin_ptr + bound + FIRST, _bound_value(lo2, kmin_ptr, FP8), mask=lead2)
    tl.store(kmax_ptr + bound + FIRST, _bound_value(hi2, kmax_ptr, FP8), mask=lead2)


def _check_pool(k_pages, v_pages, kmin, kmax, slots, keys, values) -> None:
    num_pages, _, num_kv_heads, head_dim = k_pages.shape
    num_tokens = slots.shape[0]
    check_shape("v_pages", v_pages, k_pages.shape)
    check_shape("kmin", kmin, (num_pages, num_kv_heads, head_dim))
    check_shape("kmax", kmax, (num_pages, num_kv_heads, head_dim))
    check_shape("keys", keys, (num_tokens, num_kv_heads, head_dim))
    check_shape("values", values, (num_tokens, num_kv_heads, head_dim))
    if kmin.dtype != k_pages.dtype or kmax.dtype != k_pages.dtype:
        raise ValueError(f"kmin/kmax must have k_pages' dtype {k_pages.dtype}, got {kmin.dtype}/{kmax.dtype}")
    check_last_dim_contiguous(k_pages=k_pages, v_pages=v_pages, kmin=kmin, kmax=kmax, keys=keys, values=values)


def _launch(k_pages, v_pages, kmin, kmax, slots, keys, values, q, cos, sin) -> None:
    """One launch over ``(num_tokens, num_kv_heads)``; ``q is None``: no rotation (``cos``/``sin`` unused)."""
    _, page_size, num_kv_heads, head_dim = k_pages.shape
    num_tokens = slots.shape[0]
    if num_tokens == 0:
        return
    rotate = q is not None
    first = head_dim // 2 if rotate else head_dim
    group = q.shape[1] // num_kv_heads if rotate else 1
    q, cos, sin = (q, cos, sin) if rotate else (keys, keys, keys)  # not read without ROTATE
    fp8 = k_pages.dtype == torch.float8_e4m3fn
    if fp8:  # the kernel writes e4m3 bytes (see _stored)
        k_pages, v_pages, kmin, kmax = (t.view(torch.uint8) for t in (k_pages, v_pages, kmin, kmax))
    _append_kv_kernel[(num_tokens, num_kv_heads)](
        k_pages, v_pages, kmin, kmax, slots.contiguous(), keys, values, q, cos, sin,
        num_tokens,
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        kmin.stride(0), kmin.stride(1),
        keys.stride(0), keys.stride(1),
        values.stride(0), values.stride(1),
        q.stride(0), q.stride(1),
        cos.stride(0), sin.stride(0),
        PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), FIRST=first,
        BLOCK_H=next_pow2(first), GROUP=group, BLOCK_G=next_pow2(group), ROTATE=rotate, FP8=fp8,
        CAST_FP8=not interpreting(),
        USE_PDL=use_pdl(k_pages.device),
        num_warps=1, enable_fp_fusion=False,  # the rotation's products and sums rounded as eager torch does
        launch_pdl=use_pdl(k_pages.device),
    )


def append_kv(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    slots: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Triton :func:`questkv.ops.reference.append_kv`: one launch writes K, V and the bounds.

    Args:
        k_pages, v_pages: ``[num_pages, page_size, num_kv_heads, head_dim]``.
        kmin, kmax: ``[num_pages, num_kv_heads, head_dim]``, dtype of ``k_pages``.
        slots: ``[num_tokens]`` int32/int64 ``page * page_size + offset``. Beyond the reference's
            contract, the tokens of one page must be consecutive in ``slots`` (as
            :meth:`PagedKVCache.reserve` returns them): the first of each run writes the run.
        keys, values: ``[num_tokens, num_kv_heads, head_dim]``, any float dtype (cast to the pool's).
    """
    _check_pool(k_pages, v_pages, kmin, kmax, slots, keys, values)
    _launch(k_pages, v_pages, kmin, kmax, slots, keys, values, None, None, None)


def rope_append_kv(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    slots: torch.Tensor,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Triton :func:`questkv.ops.reference.rope_append_kv`: one launch rotates ``q`` and ``keys`` in place and
    writes the rotated keys, the values and the bounds (arguments as there and in :func:`append_kv`; ``q``,
    ``keys``, ``cos`` and ``sin`` share a dtype, ``head_dim`` is even, ``cos``/``sin`` contiguous in their last
    dimension)."""
    _check_pool(k_pages, v_pages, kmin, kmax, slots, keys, values)
    num_tokens, num_kv_heads, head_dim = keys.shape
    if q.dim() != 3 or q.shape[0] != num_tokens or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q must be [{num_tokens}, a multiple of {num_kv_heads}, {head_dim}], got {tuple(q.shape)}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates pairs of halves), got {head_dim}")
    check_shape("cos", cos, (num_tokens, head_dim // 2))
    check_shape("sin", sin, (num_tokens, head_dim // 2))
    if not q.dtype == keys.dtype == cos.dtype == sin.dtype:
        raise ValueError(f"q, keys, cos and sin must share a dtype, got {q.dtype}, {keys.dtype}, {cos.dtype}, {sin.dtype}")
    check_last_dim_contiguous(q=q, cos=cos, sin=sin)
    _launch(k_pages, v_pages, kmin, kmax, slots, keys, values, q, cos, sin)
