"""The ops' own types: the page-pool view every op takes, the kernels' scratch and the selection memory's rows.

They live here, not in :mod:`questkv.ops.reference`, so that ``cache`` depends on ``ops`` and never back, and the
Triton kernels (:mod:`questkv.ops.triton`) import the types and :mod:`questkv.ops.checks`, never the reference.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

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


class AttentionBuffers(NamedTuple):
    """Scratch of the split attention kernel (:func:`questkv.ops.triton.attention_buffers`); the
    reference needs none, so all its fields are ``None`` there (:func:`questkv.ops.reference.attention_buffers`)."""

    part_out: Optional[torch.Tensor] = None
    part_lse: Optional[torch.Tensor] = None
    counters: Optional[torch.Tensor] = None
    items_per_split: int = 0


class SelectBuffers(NamedTuple):
    """Scratch of the split select kernels (:func:`questkv.ops.triton.select_buffers`); the
    reference needs none, so all its fields are ``None`` there (:func:`questkv.ops.reference.select_buffers`)."""

    hist: Optional[torch.Tensor] = None
    chunk_hist: Optional[torch.Tensor] = None
    chunk_above: Optional[torch.Tensor] = None
    counters: Optional[torch.Tensor] = None
    chunk_pages: int = 0


class ReusedSelections(NamedTuple):
    """One decode step's selections in batch order, from :func:`questkv.ops.reuse_reference.gather_selections`
    (shapes there) or its kernel."""

    active: torch.Tensor
    selected: torch.Tensor
    selected_at: torch.Tensor
    num_pages: torch.Tensor
