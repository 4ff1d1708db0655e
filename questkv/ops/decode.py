"""One Quest decode step for one layer: estimate -> select -> attend."""

from __future__ import annotations

import functools
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


class QuestDecodeStep:
    """A preallocated decode step for one layer shape: estimate -> select -> attend, no host sync.

    Every buffer is allocated once for ``batch`` sequences and ``max_pages`` page-table columns, and
    the Triton path launches three kernels (estimate, select, split attention with the merge fused
    in) whose grids depend on those shapes only, so a step is capturable in a CUDA graph: keep ``q``,
    ``page_table`` (padded ``[batch, max_pages]``) and ``seq_lens`` in fixed tensors, update them in
    place between replays. The torch backend runs the reference ops into the same buffers.

    Args:
        config: the Quest config (a dense config makes every call dense paged decode).
        batch, num_q_heads, num_kv_heads, head_dim: the layer's decode shape.
        max_pages: page-table width (``page_table.shape[1]``).
        dtype, device: of ``q`` and the page pool.
        num_splits: split count of the attention kernel (default: one wave of a few programs per SM).

    Buffers (overwritten by every call): ``scores`` ``[batch, num_sel_heads, max_pages]`` float32,
    ``selected`` ``[batch, num_sel_heads, budget_pages]`` int32, ``out`` ``[batch, num_q_heads,
    head_dim]`` in ``dtype``, float32 split partials and int32 merge counters (zero between calls).
    """

    def __init__(
        self,
        config: QuestConfig,
        batch: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_pages: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_splits: Optional[int] = None,
    ) -> None:
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        device = torch.device(device)
        self.config = config
        self.kernels = ops.resolve_backend(torch.empty(0, device=device), config.backend)
        self.use_triton = self.kernels is not ops.reference
        sel_heads = num_q_heads if config.selection == "q_head" else num_kv_heads
        self.scores = self.selected = None
        if not config.is_dense:
            self.scores = torch.empty((batch, sel_heads, max_pages), dtype=torch.float32, device=device)
            self.selected = torch.empty((batch, sel_heads, config.budget_pages), dtype=torch.int32, device=device)
        self.out = torch.empty((batch, num_q_heads, head_dim), dtype=dtype, device=device)
        self._dense = self._sparse = None
        if self.use_triton:
            buffers = functools.partial(
                self.kernels.attention_buffers, batch, num_q_heads, head_dim=head_dim, page_size=config.page_size,
                device=device, num_splits=num_splits,
            )
            self._dense = buffers(num_sel_heads=num_kv_heads, num_items=max_pages, dense=True)
            if not config.is_dense:
                self._sparse = buffers(num_sel_heads=sel_heads, num_items=config.budget_pages, dense=False)

    def estimate(self, q: torch.Tensor, layer: LayerPages, page_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Page scores into ``self.scores``."""
        cfg = self.config
        if self.use_triton:
            return self.kernels.page_scores_into(
                self.scores, q, layer.kmin, layer.kmax, page_table, seq_lens, cfg.page_size, cfg.selection, cfg.group_reduction
            )
        scores = ops.reference.page_scores(
            q, layer.kmin, layer.kmax, page_table, seq_lens, cfg.page_size, cfg.selection, cfg.group_reduction
        )
        return self.scores.copy_(scores)

    def select(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """Top-K pages of ``self.scores`` into ``self.selected``."""
        cfg = self.config
        args = (seq_lens, cfg.page_size, cfg.budget_pages, cfg.sink_pages, cfg.recent_pages)
        if self.use_triton:
            return self.kernels.select_pages_into(self.selected, self.scores, *args)
        return self.selected.copy_(ops.reference.select_pages(self.scores, *args))

    def attend(
        self,
        q: torch.Tensor,
        layer: LayerPages,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        selected: Optional[torch.Tensor],
        sm_scale: Optional[float] = None,
    ) -> torch.Tensor:
        """Attention over ``selected`` pages (``None``: all pages) into ``self.out``."""
        if not self.use_triton:
            out = ops.reference.paged_decode_attention(q, layer.k_pages, layer.v_pages, page_table, seq_lens, selected, sm_scale)
            return self.out.copy_(out)
        part_out, part_lse, counters, items_per_split = self._dense if selected is None else self._sparse
        return self.kernels.paged_decode_attention_into(
            self.out, part_out, part_lse, counters, q, layer.k_pages, layer.v_pages, page_table, seq_lens, selected,
            sm_scale, items_per_split,
        )

    def __call__(
        self,
        q: torch.Tensor,
        layer: LayerPages,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        sm_scale: Optional[float] = None,
    ) -> torch.Tensor:
        """One layer's decode attention, as :func:`quest_decode`; returns ``self.out``."""
        if self.config.is_dense:
            return self.attend(q, layer, page_table, seq_lens, None, sm_scale)
        self.estimate(q, layer, page_table, seq_lens)
        self.select(seq_lens)
        return self.attend(q, layer, page_table, seq_lens, self.selected, sm_scale)
