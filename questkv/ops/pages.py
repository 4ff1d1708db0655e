"""The page-pool views every op takes (the ops' own types, so that ``cache`` depends on ``ops``, never back)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class LayerPages(NamedTuple):
    """One layer's view of a page pool.

    k_pages, v_pages: ``[num_pages, page_size, num_kv_heads, head_dim]``;
    kmin, kmax: ``[num_pages, num_kv_heads, head_dim]``, the dtype of ``k_pages``.
    """

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    kmin: torch.Tensor
    kmax: torch.Tensor
