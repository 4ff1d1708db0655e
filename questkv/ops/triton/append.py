"""Append kernel: write K/V tokens into the page pool and update the touched pages' key bounds."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from questkv.ops.triton._common import check_last_dim_contiguous, check_shape, next_pow2


@triton.jit(do_not_specialize=["num_tokens"])  # every step's token count: one compiled variant for all
def _append_kv_kernel(
    k_pages_ptr, v_pages_ptr, kmin_ptr, kmax_ptr, slots_ptr, keys_ptr, values_ptr,
    num_tokens,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_bp, stride_bh,
    stride_xt, stride_xh,
    stride_yt, stride_yh,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (token, KV head): store the token's K and V row; the first token of each
    run of same-page tokens (the run's *leader*) also folds the whole run into the page bounds."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM

    slot = tl.load(slots_ptr + tok).to(tl.int64)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    key = tl.load(keys_ptr + tok * stride_xt + head * stride_xh + d, mask=dmask)
    value = tl.load(values_ptr + tok * stride_yt + head * stride_yh + d, mask=dmask)
    key = key.to(k_pages_ptr.dtype.element_ty)
    tl.store(k_pages_ptr + page * stride_kp + offset * stride_kt + head * stride_kh + d, key, mask=dmask)
    tl.store(
        v_pages_ptr + page * stride_vp + offset * stride_vt + head * stride_vh + d,
        value.to(v_pages_ptr.dtype.element_ty),
        mask=dmask,
    )

    prev_slot = tl.load(slots_ptr + tok - 1, mask=tok > 0, other=0).to(tl.int64)
    if (tok == 0) | (prev_slot // PAGE_SIZE != page):
        # A page's tokens of one call are consecutive, so they lie in the next PAGE_SIZE rows.
        rows = tok + tl.arange(0, PAGE_SIZE)
        row_slots = tl.load(slots_ptr + rows, mask=rows < num_tokens, other=0).to(tl.int64)
        same = (rows < num_tokens) & (row_slots // PAGE_SIZE == page)
        run = tl.load(
            keys_ptr + rows[:, None].to(tl.int64) * stride_xt + head * stride_xh + d[None, :],
            mask=same[:, None] & dmask[None, :],
        )
        run = run.to(k_pages_ptr.dtype.element_ty).to(tl.float32)  # exact: min/max of stored keys
        lo = tl.min(tl.where(same[:, None], run, float("inf")), axis=0)
        hi = tl.max(tl.where(same[:, None], run, float("-inf")), axis=0)
        bound = page * stride_bp + head * stride_bh + d
        if offset != 0:  # the page already holds tokens: widen its bounds
            lo = tl.minimum(lo, tl.load(kmin_ptr + bound, mask=dmask).to(tl.float32))
            hi = tl.maximum(hi, tl.load(kmax_ptr + bound, mask=dmask).to(tl.float32))
        tl.store(kmin_ptr + bound, lo.to(kmin_ptr.dtype.element_ty), mask=dmask)
        tl.store(kmax_ptr + bound, hi.to(kmax_ptr.dtype.element_ty), mask=dmask)


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
            :meth:`PagedKVCache.reserve` returns them): the first of each run updates the bounds.
        keys, values: ``[num_tokens, num_kv_heads, head_dim]``, any float dtype (cast to the pool's).
    """
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    num_tokens = slots.shape[0]
    check_shape("v_pages", v_pages, k_pages.shape)
    check_shape("kmin", kmin, (num_pages, num_kv_heads, head_dim))
    check_shape("kmax", kmax, (num_pages, num_kv_heads, head_dim))
    check_shape("keys", keys, (num_tokens, num_kv_heads, head_dim))
    check_shape("values", values, (num_tokens, num_kv_heads, head_dim))
    if kmin.dtype != k_pages.dtype or kmax.dtype != k_pages.dtype:
        raise ValueError(f"kmin/kmax must have k_pages' dtype {k_pages.dtype}, got {kmin.dtype}/{kmax.dtype}")
    check_last_dim_contiguous(k_pages=k_pages, v_pages=v_pages, kmin=kmin, kmax=kmax, keys=keys, values=values)
    if num_tokens == 0:
        return
    _append_kv_kernel[(num_tokens, num_kv_heads)](
        k_pages, v_pages, kmin, kmax, slots.contiguous(), keys, values,
        num_tokens,
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        kmin.stride(0), kmin.stride(1),
        keys.stride(0), keys.stride(1),
        values.stride(0), values.stride(1),
        PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
        num_warps=1,
    )
