"""The one Quest decode step of one layer: estimate -> select -> attend, into preallocated buffers.

:class:`QuestDecodeStep` is the only implementation of the step: it calls the ``*_into`` entry
points of one backend module (the torch reference or the Triton kernels, which share their
signatures), so it has no backend branches, and on CUDA it never synchronises with the host, so a
whole model's decode step captures in a CUDA graph. :func:`quest_decode` is a one-off call through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from questkv import ops
from questkv.config import QuestConfig
from questkv.ops.pages import LayerPages

if TYPE_CHECKING:
    from questkv.cache.paged import PagedKVCache


class QuestDecodeStep:
    """A preallocated decode step for one decode shape, shared by every layer of that shape.

    Every buffer is allocated once for ``batch`` sequences and ``max_pages`` page-table columns;
    the Triton backend launches estimate, select (one kernel, or the split select's few launches
    for long rows) and split attention with the merge fused in, with grids that depend on those
    shapes only, so a step is capturable in a CUDA graph:
    keep ``q``, ``page_table`` (padded ``[batch, max_pages]``), ``seq_lens`` and ``budgets`` in fixed
    tensors, update them in place between replays. Calls overwrite the buffers, so one step serves
    the layers of a model one after another.

    Args:
        config: the Quest config; a dense config (``token_budget=None``) allocates no selection
            buffers and :meth:`sparse` is unavailable.
        batch, num_q_heads, num_kv_heads, head_dim: the layer's decode shape.
        max_pages: page-table width (``page_table.shape[1]``).
        dtype, device: of ``q`` and the page pool.
        num_splits: split count of the attention kernel (default: one wave of a few programs per SM).
        kv_dtype: the dtype the pool stores K/V in, if not ``dtype`` (``torch.float8_e4m3fn``: the attention's
            split plan for fp8 pages).
        num_queries: queries per sequence, its last positions, causal among them (a lossless verify step: with
            more than one, :meth:`dense` only).
        row_budgets: whether a row's budget below the config's limits the selection columns its attention reads
            (its first ``budget // page_size``, then the reuse extra columns), spread over all its splits; ``False``
            for selections laid out otherwise (the engine's steps of dense and Quest rows, where a dense row's
            selection holds every page whatever its budget).

    Buffers: ``scores`` ``[batch, num_sel_heads, max_pages]`` float32, ``selected`` ``[batch,
    num_sel_heads, budget_pages + config.reuse_extra_pages]`` int32 (the extra columns, for a reused
    selection's pages begun since, are ``-1``), ``out`` ``[batch * num_queries, num_q_heads, head_dim]`` in
    ``dtype``, and the select's scratch ``select_buffers`` (:func:`questkv.ops.triton.select_buffers`).

    Selection reuse (:mod:`questkv.decode.selection_memory`): :meth:`sparse` given ``active`` and ``selected`` estimates
    and selects only the active rows, into ``selected``, and attends every row's ``selected`` (with
    ``selecting=False``, a step where no row is active, it launches the attend alone).
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
        num_queries: int = 1,
        kv_dtype: Optional[torch.dtype] = None,
        row_budgets: bool = True,
    ) -> None:
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if num_queries < 1:
            raise ValueError(f"num_queries={num_queries}: a step takes at least 1 query per sequence")
        device = torch.device(device)
        self.config = config
        self.batch, self.max_pages, self.num_queries = batch, max_pages, num_queries
        self.row_budgets = row_budgets
        self.backend = ops.resolve_backend(torch.empty(0, device=device), config.backend)
        sel_heads = num_q_heads if config.selection == "q_head" else num_kv_heads
        self.out = torch.empty((batch * num_queries, num_q_heads, head_dim), dtype=dtype, device=device)
        buffers = lambda heads, items, dense: self.backend.attention_buffers(  # noqa: E731
            batch, num_q_heads, heads, head_dim, items, config.page_size, dense, device, num_splits, num_queries,
            kv_dtype,
        )
        self._dense_buffers = buffers(num_kv_heads, max_pages, True)
        self.scores = self.selected = self.select_buffers = self._sparse_buffers = None
        if not config.is_dense:
            width = config.budget_pages + config.reuse_extra_pages
            self.scores = torch.empty((batch, sel_heads, max_pages), dtype=torch.float32, device=device)
            # The extra columns stay -1 here; a reused selection (decode/selection_memory.py) brings its own.
            self.selected = torch.full((batch, sel_heads, width), -1, dtype=torch.int32, device=device)
            self.select_buffers = self.backend.select_buffers(batch, sel_heads, max_pages, device)
            self._sparse_buffers = buffers(sel_heads, width, False)

    @classmethod
    def for_cache(
        cls,
        config: Optional[QuestConfig],
        cache: "PagedKVCache",
        batch: int,
        num_q_heads: int,
        max_pages: Optional[int] = None,
        num_queries: int = 1,
        row_budgets: bool = True,
    ) -> "QuestDecodeStep":
        """A step over ``cache``'s pool for ``batch`` sequences of ``num_queries`` queries; ``config=None`` is dense
        (the cache's page size and backend); ``max_pages`` defaults to ``cache.max_pages_per_seq``; ``row_budgets``
        as in the constructor."""
        if config is None:
            config = QuestConfig(page_size=cache.page_size, backend=cache.backend)
        elif config.page_size != cache.page_size:
            raise ValueError(f"QuestConfig.page_size={config.page_size} differs from the cache's page_size={cache.page_size}")
        max_pages = cache.max_pages_per_seq if max_pages is None else max_pages
        return cls(config, batch, num_q_heads, cache.num_kv_heads, cache.head_dim, max_pages, cache.dtype, cache.device,
                   num_queries=num_queries, kv_dtype=cache.kv_dtype, row_budgets=row_budgets)

    def estimate(
        self, q: torch.Tensor, layer: LayerPages, page_table: torch.Tensor, seq_lens: torch.Tensor,
        active: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Page scores of ``q`` ``[batch, num_q_heads, head_dim]`` into ``self.scores``, for the rows whose
        ``active`` ``[batch]`` int32 flag is nonzero (``None``: every row)."""
        cfg = self.config
        return self.backend.page_scores_into(
            self.scores, q, layer.kmin, layer.kmax, page_table, seq_lens, cfg.page_size, cfg.selection,
            cfg.group_reduction, active=active,
        )

    def select(
        self, seq_lens: torch.Tensor, budgets: Optional[torch.Tensor] = None, split: Optional[bool] = None,
        active: Optional[torch.Tensor] = None, selected: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Top pages of ``self.scores`` into the first ``budget_pages`` columns of ``selected`` (default
        ``self.selected``) for the ``active`` rows (``None``: every row); ``budgets`` ``[batch]`` int32 token
        budgets (``None``: the config's for every sequence); ``split`` forces the Triton select's split
        (``True``) or one-program-per-row (``False``) path, ``None`` picks by ``max_pages``."""
        cfg = self.config
        return self.backend.select_pages_into(
            self.selected if selected is None else selected, self.scores, seq_lens, cfg.page_size, cfg.budget_pages,
            cfg.sink_pages, cfg.recent_pages, budgets, self.select_buffers, split, active=active,
        )

    def dense(
        self,
        q: torch.Tensor,
        layer: LayerPages,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        sm_scale: Optional[float] = None,
    ) -> torch.Tensor:
        """Dense paged decode attention over every page into ``self.out``; returns ``self.out``. ``q``: ``[batch *
        num_queries, num_q_heads, head_dim]``, each sequence's queries in a run (its last positions)."""
        out = self.out
        if self.num_queries > 1:
            q = q.view(self.batch, self.num_queries, *q.shape[1:])
            out = out.view(q.shape)
        self.backend.paged_decode_attention_into(
            out, self._dense_buffers, q, layer.k_pages, layer.v_pages, page_table, seq_lens, None, sm_scale,
        )
        return self.out

    def sparse(
        self,
        q: torch.Tensor,
        layer: LayerPages,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        sm_scale: Optional[float] = None,
        budgets: Optional[torch.Tensor] = None,
        active: Optional[torch.Tensor] = None,
        selected: Optional[torch.Tensor] = None,
        selecting: bool = True,
    ) -> torch.Tensor:
        """Quest attention (estimate, select, attend) into ``self.out``; returns ``self.out``.

        Args:
            q: ``[batch, num_q_heads, head_dim]``, post-RoPE.
            layer: the layer's pages and bounds.
            page_table: ``[batch, max_pages]`` int32; seq_lens: ``[batch]`` int32, current token included.
            budgets: ``[batch]`` int32 token budgets, each a multiple of ``page_size`` in
                ``[page_size * (forced pages + 1), config.token_budget]`` (not checked here: no host sync).
            active, selected: selection reuse (both or neither): ``[batch]`` int32 flags of the rows that
                select in this step, and the ``[batch, num_sel_heads, budget_pages + reuse_extra_pages]`` int32
                selections that every row attends (an inactive row's as given, see
                :class:`~questkv.decode.selection_memory.ReuseRows`).
            selecting: ``False`` when the caller knows that no row is active (selection reuse): only the attend
                launches, over ``selected``; ``active`` must then be all zero (not checked here: no host sync).
        """
        if self.selected is None:
            raise ValueError("QuestDecodeStep.sparse needs a sparse config (token_budget set)")
        if self.num_queries > 1:
            raise ValueError(f"QuestDecodeStep.sparse takes one query per sequence, not {self.num_queries}")
        if (active is None) != (selected is None):
            raise ValueError("QuestDecodeStep.sparse takes active and selected together (selection reuse) or neither")
        if not selecting:
            if selected is None:
                raise ValueError("QuestDecodeStep.sparse with selecting=False needs selected (selection reuse)")
            return self.attend(q, layer, page_table, seq_lens, sm_scale, selected, budgets)
        self.estimate(q, layer, page_table, seq_lens, active)
        self.select(seq_lens, budgets, active=active, selected=selected)
        return self.attend(q, layer, page_table, seq_lens, sm_scale, selected, budgets)

    def attend(
        self,
        q: torch.Tensor,
        layer: LayerPages,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        sm_scale: Optional[float] = None,
        selected: Optional[torch.Tensor] = None,
        budgets: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Attention over the pages in ``selected`` (default ``self.selected``) into ``self.out`` (the last
        part of :meth:`sparse`); with ``row_budgets`` a row of ``budgets`` below the config's reads only its budget's
        columns of the selection (and the extra ones), spread over all its splits."""
        selected = self.selected if selected is None else selected
        budgets = budgets if self.row_budgets else None
        return self.backend.paged_decode_attention_into(
            self.out, self._sparse_buffers, q, layer.k_pages, layer.v_pages, page_table, seq_lens, selected, sm_scale,
            budgets, None if budgets is None else self.config.budget_pages,
        )

    def __call__(
        self,
        q: torch.Tensor,
        layer: LayerPages,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        sm_scale: Optional[float] = None,
        budgets: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """:meth:`dense` for a dense config, :meth:`sparse` otherwise."""
        if self.config.is_dense:
            return self.dense(q, layer, page_table, seq_lens, sm_scale)
        return self.sparse(q, layer, page_table, seq_lens, sm_scale, budgets)


def quest_decode(
    q: torch.Tensor,
    layer: LayerPages,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    config: QuestConfig,
    sm_scale: Optional[float] = None,
    budgets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of one decode query per sequence, reading only the pages Quest selects (one call
    through a fresh :class:`QuestDecodeStep`).

    Args:
        q: ``[batch, num_q_heads, head_dim]``, post-RoPE.
        layer: the layer's pages and bounds (:meth:`PagedKVCache.layer`).
        page_table: ``[batch, max_pages]`` int32; seq_lens: ``[batch]`` int32, current token included.
        config: a dense config (``token_budget=None``) attends every page.
        budgets: ``[batch]`` int32 per-sequence token budgets (see :meth:`QuestDecodeStep.sparse`).

    Returns:
        ``[batch, num_q_heads, head_dim]`` in ``q``'s dtype.
    """
    batch, num_q_heads, head_dim = q.shape
    step = QuestDecodeStep(
        config, batch, num_q_heads, layer.k_pages.shape[2], head_dim, page_table.shape[1], q.dtype, q.device,
        kv_dtype=layer.k_pages.dtype,
    )
    return step(q, layer, page_table, seq_lens, sm_scale, budgets)


def sparse_tokens_attended(seq_lens: torch.Tensor, budgets: torch.Tensor, page_size: int) -> torch.Tensor:
    """Tokens one Quest layer's decode step attends per sequence, Quest's accounting: its pages up to
    the budget, each page counted in full (the current, partial one too).

    Args:
        seq_lens: ``[batch]`` integer, the current token included.
        budgets: ``[batch]`` integer token budgets (multiples of ``page_size``).

    Returns:
        ``[batch]`` float64 on ``seq_lens``' device (no host synchronisation).
    """
    num_pages = (seq_lens.long() + page_size - 1) // page_size  # [B]
    return torch.minimum(num_pages, budgets.long() // page_size).double() * page_size
