"""The page-pool views every op takes (the ops' own types, so that ``cache`` depends on ``ops``, never back)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class LayerPages(NamedTuple):
    """One layer's view of a page pool.

    k_pages, v_pages: ``[num_pages, page_size, num_kv_heads, head_dim]`` (any strides with a contiguous last
    dimension; the pools of :func:`page_pool` keep each head's page contiguous);
    kmin, kmax: ``[num_pages, num_kv_heads, head_dim]``, the dtype of ``k_pages``.
    """

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    kmin: torch.Tensor
    kmax: torch.Tensor


def page_pool(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, device: Optional[torch.device | str] = None) -> torch.Tensor:
    """A zeroed K or V pool: ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]`` indexed as every op
    takes it, stored head-major within a page (memory order ``[layers, pages, heads, page_size, head_dim]``).

    A sparse decode step reads each selection head's own pages: stored this way one (page, head) is one
    contiguous block (4 KiB at 16 bf16 rows of 128), where token-major storage spreads it over ``page_size`` rows
    of 256 bytes, ``num_kv_heads * head_dim`` elements apart.
    """
    page = num_kv_heads * page_size * head_dim
    strides = (num_pages * page, page, head_dim, page_size * head_dim, 1)
    # a tensor of its own with these strides, not a view (a view made under no_grad could not be written in place
    # with grad mode on)
    pool = torch.empty_strided((num_layers, num_pages, page_size, num_kv_heads, head_dim), strides, dtype=dtype,
                               device=device)
    return pool.zero_()
