"""One Quest decode step for one layer: estimate -> select -> attend."""

from __future__ import annotations

from typing import Optional

import torch

from questkv import ops
from questkv.cache.paged import LayerPages
from questkv.config import QuestConfig


def quest_decode(
    q: torch.Tensor,
    layer: LayerPages,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    config: QuestConfig,
    sm_scale: Optional[float] = None,
) -> torch.Tensor:
    """Attention of one decode query per sequence, reading only the pages Quest selects.

    Args:
        q: ``[batch, num_q_heads, head_dim]``, post-RoPE.
        layer: the layer's pages and bounds (:meth:`PagedKVCache.layer`).
        page_table: ``[batch, max_pages]`` int32; seq_lens: ``[batch]`` int32, current token included.
        config: a dense config (``token_budget=None``) attends every page.

    Returns:
        ``[batch, num_q_heads, head_dim]`` in ``q``'s dtype.
    """
    backend = config.backend
    if config.is_dense:
        return ops.paged_decode_attention(q, layer.k_pages, layer.v_pages, page_table, seq_lens, None, sm_scale, backend)
    scores = ops.page_scores(
        q, layer.kmin, layer.kmax, page_table, seq_lens, config.page_size, config.selection, config.group_reduction, backend
    )
    selected = ops.select_pages(
        scores, seq_lens, config.page_size, config.budget_pages, config.sink_pages, config.recent_pages, backend
    )
    return ops.paged_decode_attention(q, layer.k_pages, layer.v_pages, page_table, seq_lens, selected, sm_scale, backend)
