"""e4m3 values as order-preserving byte codes: how the torch append keeps fp8 page bounds (torch has no float8
min / max reduction, so it reduces the codes and writes the winners back as e4m3)."""

from __future__ import annotations

import torch

__all__ = ["fp8_from_order", "fp8_order", "widen_fp8_bounds"]

FP8 = torch.float8_e4m3fn


def fp8_order(x: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor's bytes as uint8 codes in the values' order (``-448`` 1, ``-0`` 127, ``+0`` 128, ``448`` 254;
    NaN is never stored: the cast saturates)."""
    bits = x.view(torch.uint8).to(torch.int16)
    return torch.where(bits >= 128, 255 - bits, 128 + bits).to(torch.uint8)


def fp8_from_order(code: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`fp8_order`."""
    code = code.to(torch.int16)
    return torch.where(code >= 128, code - 128, 255 - code).to(torch.uint8).view(FP8)


def widen_fp8_bounds(kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor, index: torch.Tensor,
                      restart: torch.Tensor, stored: torch.Tensor) -> None:
    """:func:`~questkv.ops.reference.append_kv`'s bounds of fp8 pages, whose bounds are fp8 too (no float8 reduction in torch): reduce the
    values' order codes into the touched pages' bytes (``include_self=False``: only this step's candidates), then
    turn those pages' codes back into e4m3 (every slot of a page writes the same bytes)."""
    codes = fp8_order(stored)
    for bound, empty, reduce in ((kmin, 255, "amin"), (kmax, 0, "amax")):
        old = torch.where(restart, empty, fp8_order(bound[pages]))
        best = torch.minimum(old, codes) if reduce == "amin" else torch.maximum(old, codes)
        raw = bound.view(torch.uint8)
        raw.scatter_reduce_(0, index, best, reduce=reduce, include_self=False)
        raw[pages] = fp8_from_order(raw[pages]).view(torch.uint8)
