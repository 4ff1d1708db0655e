"""The decoder layer's elementwise ops on CUDA: RMSNorm (with the residual add folded in) and SiLU-and-multiply.

Same signatures and rounding as :func:`questkv.ops.reference.rms_norm` and
:func:`questkv.ops.reference.silu_and_mul`: every step that eager torch rounds to the input dtype is rounded here
too (``enable_fp_fusion=False`` keeps float32 products and sums from contracting), so the kernels give eager
torch's numbers up to the order of the mean's float32 sum.

Under programmatic dependent launch (sm_90+) each kernel waits for the kernel before it and then at once lets the
next one launch: the GEMV after a norm (questkv's one-row float GEMV, the int4 GEMV) streams its first weight tile
while the norm runs.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from questkv.ops.triton._common import check_last_dim_contiguous, next_pow2, use_pdl

__all__ = ["rms_norm", "silu_and_mul"]

_SILU_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, H, eps, stride_x, stride_r, stride_o,
                     stride_s, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr):
    """One program per row of ``H`` values: ``h = x + residual`` (rounded to ``x``'s dtype, stored to ``sum_ptr``),
    then ``weight * (h * rsqrt(mean(h^2) + eps))`` with the normalised row rounded to ``x``'s dtype before the
    weight and the product rounded to ``out``'s. The weight, never written on the device, is loaded before the
    wait for the kernels before it."""
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv = 1.0 / tl.sqrt_rn(tl.sum(h * h, axis=0) / H + eps)
    normed = (h * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, stride_x, stride_o, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid ``(rows, cdiv(I, BLOCK))``: ``silu(gate)`` rounded to the dtype, times ``up``, rounded again."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(dtype), mask=mask)


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` as ``[rows, width]`` with a contiguous last dimension (a view where the strides allow)."""
    rows = x.reshape(-1, width)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Triton :func:`questkv.ops.reference.rms_norm`: one launch, the residual add folded in.

    Args:
        x: ``[..., H]`` float. weight: ``[H]``. eps: added to the mean square.
        residual: ``None`` or ``x``'s shape and dtype.

    Returns:
        ``normed`` (``x``'s shape; the dtype of ``weight * x``), and with ``residual`` also ``x + residual``.
    """
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"rms_norm: weight must have shape ({hidden},), got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual must match x ({tuple(x.shape)}, {x.dtype}), got "
                         f"{tuple(residual.shape)}, {residual.dtype}")
    check_last_dim_contiguous(weight=weight)
    rows = _rows(x, hidden)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    total = torch.empty_like(rows) if residual is not None else rows
    res = _rows(residual, hidden) if residual is not None else rows
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res, weight, out, total, hidden, float(eps), rows.stride(0), res.stride(0), out.stride(0),
            total.stride(0), BLOCK=next_pow2(hidden), HAS_RESIDUAL=residual is not None, USE_PDL=use_pdl(x.device),
            num_warps=4 if hidden <= 4096 else 8, enable_fp_fusion=False, launch_pdl=use_pdl(x.device),
        )
    normed = out.view(x.shape)
    return normed if residual is None else (normed, total.view(x.shape))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton :func:`questkv.ops.reference.silu_and_mul`: ``x`` ``[..., 2 * I]`` → ``[..., I]``, one launch."""
    width = x.shape[-1]
    if width % 2:
        raise ValueError(f"silu_and_mul: the last dimension holds gate and up side by side, so it must be even; "
                         f"got {width}")
    size = width // 2
    rows = _rows(x, width)
    out = torch.empty((rows.shape[0], size), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(size, _SILU_BLOCK))](
            rows, out, size, rows.stride(0), out.stride(0), BLOCK=_SILU_BLOCK, USE_PDL=use_pdl(x.device),
            num_warps=4, enable_fp_fusion=False, launch_pdl=use_pdl(x.device),
        )
    return out.view(*x.shape[:-1], size)
