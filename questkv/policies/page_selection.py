"""Page-selection policies: every step picks logical pages of the whole cache, nothing is dropped.

All of them produce a selection in the format of :func:`questkv.ops.reference.select_pages`
(``[batch, num_sel_heads, k]`` int32, logical pages ascending, ``-1`` padding) and attend it with
:func:`questkv.ops.reference.paged_decode_attention`, so they share the Quest kernels' layout.
``num_sel_heads`` is ``num_kv_heads`` under ``selection="kv_head"`` and ``num_q_heads`` under
``"q_head"``. The sink, recent and current pages are always selected, as in
:class:`questkv.QuestConfig`, and count against the budget. The two-stage ``quest-rerank`` builds on
:class:`PagePolicy` in :mod:`questkv.policies.rerank`.
"""

from __future__ import annotations

import abc
from typing import NamedTuple, Optional

import torch

from questkv.config import PAGE_POLICY_OPTIONS, QuestConfig
from questkv.ops import LayerPages, reference
from questkv.policies.base import DecodeOutput, DecodePolicy
from questkv.policies.masked_attention import masked_decode_attention
from questkv.validation import check_float, check_int


class PageSelection(NamedTuple):
    """Pages one decode step attends.

    pages: ``[batch, num_sel_heads, k]`` int32 logical pages, ascending, ``-1``-padded.
    num_pages: ``[batch, num_sel_heads]`` int32, selected pages per row (``pages >= 0``); the
        tokens attended, as the budget counts them, are ``num_pages * page_size``.
    """

    pages: torch.Tensor
    num_pages: torch.Tensor


class PagePolicy(DecodePolicy):
    """Base of the page-selection policies.

    Args:
        token_budget: a multiple of ``page_size``: ``budget_pages = token_budget // page_size``
            pages per (sequence, selection head), the sink, recent and current pages included.
        page_size, selection, group_reduction, sink_pages, recent_pages: as in
            :class:`questkv.QuestConfig` (validated by it; its defaults). The options are
            :data:`questkv.config.PAGE_POLICY_OPTIONS`.

    Attributes:
        config: the :class:`questkv.QuestConfig` holding these options.
    """

    options = PAGE_POLICY_OPTIONS

    def __init__(
        self,
        token_budget: Optional[int],
        page_size: int = QuestConfig.page_size,
        selection: str = QuestConfig.selection,
        group_reduction: str = QuestConfig.group_reduction,
        sink_pages: int = QuestConfig.sink_pages,
        recent_pages: int = QuestConfig.recent_pages,
    ) -> None:
        try:
            self.config = QuestConfig(
                token_budget=token_budget,
                page_size=page_size,
                selection=selection,
                group_reduction=group_reduction,
                sink_pages=sink_pages,
                recent_pages=recent_pages,
            )
        except ValueError as error:
            raise ValueError(f"policy {self.name!r}: {error}") from error
        super().__init__(token_budget, page_size)

    def select(
        self,
        q: torch.Tensor,
        layer: LayerPages,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        sm_scale: Optional[float] = None,
    ) -> PageSelection:
        """Pages to attend; arguments as in :meth:`DecodePolicy.decode`."""
        pages = self._select(q, layer, page_table, seq_lens, sm_scale)
        return PageSelection(pages, (pages >= 0).sum(-1, dtype=torch.int32))

    @abc.abstractmethod
    def _select(self, q, layer, page_table, seq_lens, sm_scale) -> torch.Tensor:
        """``PageSelection.pages`` of :meth:`select`."""

    def decode(self, q, layer, page_table, seq_lens, state=None, sm_scale=None) -> DecodeOutput:
        if state is not None:
            raise ValueError(f"policy {self.name!r} is stateless; pass state=None")
        self._check_layer(q, layer)
        selection = self.select(q, layer, page_table, seq_lens, sm_scale)
        out = reference.paged_decode_attention(
            q, layer.k_pages, layer.v_pages, page_table, seq_lens, selection.pages, sm_scale
        )
        return DecodeOutput(out, selection.num_pages * self.page_size, selection.pages)

    def _combine_group(self, per_q_head: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        """``[batch, num_q_heads, P]`` -> ``[batch, num_sel_heads, P]``: kept per query head under ``q_head``
        selection, each KV head's query group reduced with ``group_reduction`` (sum or max) under ``kv_head``."""
        if self.config.selection == "q_head":
            return per_q_head
        batch, num_q_heads, max_pages = per_q_head.shape
        grouped = per_q_head.view(batch, num_kv_heads, num_q_heads // num_kv_heads, max_pages)  # [B, Hkv, G, P]
        return grouped.sum(2) if self.config.group_reduction == "sum" else grouped.amax(2)


class FullPolicy(PagePolicy):
    """Dense attention: every page of every sequence (``token_budget=None``); one row per KV head."""

    name = "full"
    options = ()

    def __init__(self, token_budget: Optional[int] = None, page_size: int = QuestConfig.page_size) -> None:
        if token_budget is not None:
            raise ValueError(f"policy 'full' attends every token; token_budget must be None, got {token_budget!r}")
        super().__init__(None, page_size)

    def _select(self, q, layer, page_table, seq_lens, sm_scale):
        batch, max_pages = page_table.shape
        valid = reference.valid_pages(seq_lens, self.page_size, max_pages)
        pages = torch.arange(max_pages, device=q.device).expand(batch, max_pages)
        pages = torch.where(valid, pages, -1).to(torch.int32)
        return pages[:, None, :].expand(batch, layer.kmin.shape[1], max_pages)


class QuestPolicy(PagePolicy):
    """Quest: top-``budget_pages`` pages by the page-bound score ``sum_i max(q_i kmin_i, q_i kmax_i)``
    (:func:`questkv.ops.reference.page_scores` + :func:`questkv.ops.reference.select_pages`)."""

    name = "quest"

    def _select(self, q, layer, page_table, seq_lens, sm_scale):
        config = self.config
        scores = reference.page_scores(
            q, layer.kmin, layer.kmax, page_table, seq_lens, self.page_size, config.selection, config.group_reduction
        )
        return reference.select_pages(
            scores, seq_lens, self.page_size, config.budget_pages, config.sink_pages, config.recent_pages
        )


class OraclePolicy(PagePolicy):
    """Oracle: top-``budget_pages`` pages by the true softmax mass of the step's query.

    A page's mass is the sum of the dense attention probabilities of its tokens (computed from the
    actual keys, at ``sm_scale``); under ``kv_head`` selection the query group's masses are reduced
    with ``group_reduction``. No page selector working from page summaries can capture more
    attention mass at the same budget: the upper bound for Quest and its variants.
    """

    name = "oracle"

    def _select(self, q, layer, page_table, seq_lens, sm_scale):
        config = self.config
        probs = masked_decode_attention(
            q, layer.k_pages, layer.v_pages, page_table, seq_lens, sm_scale=sm_scale, return_probs=True
        ).probs
        batch, num_q_heads, _ = probs.shape
        mass = probs.view(batch, num_q_heads, page_table.shape[1], self.page_size).sum(-1)
        mass = self._combine_group(mass, layer.kmin.shape[1])
        return reference.select_pages(
            mass, seq_lens, self.page_size, config.budget_pages, config.sink_pages, config.recent_pages
        )


class QuestTopPPolicy(PagePolicy):
    """Adaptive budget: the fewest Quest-ranked pages whose estimated attention mass reaches ``top_p``.

    Estimator. For query head ``h`` and page ``p`` with ``n_p`` tokens, Quest's bound ``u_p >= q.k``
    for every key of the page gives ``Z_p = sum_t exp(s q.k_t) <= n_p exp(s u_p)`` (``s`` the softmax
    scale), so the estimated mass is the normalised bound of the page's softmax partition sum::

        m_p = n_p exp(s u_p) / sum_j n_j exp(s u_j)        (a softmax over s u_j + log n_j)

    It is exact when every page's keys coincide. Otherwise every page's term is over-estimated, the
    most for pages with loose bounds (mixed keys), which moves estimated mass away from the pages that
    really hold the attention: reaching ``top_p`` then takes more pages, not fewer, and the cap K
    bounds that cost. Under ``kv_head`` selection the group's
    estimates are combined with ``group_reduction`` (``"sum"`` is applied as the mean, so the result
    stays a distribution; ``"max"`` takes the group maximum). Pages are ranked by the combined
    estimate (for one query head this is the Quest score order), the sink, recent and current pages
    first; the selection is the shortest prefix of that ranking whose estimated mass reaches
    ``top_p``, never fewer than the forced pages nor ``min_budget // page_size`` pages, and never
    more than ``budget_pages`` (the cap K).

    The floor ``min_budget`` keeps at least that many tokens' worth of pages (the top of the same
    ranking) even when fewer reach ``top_p``: the estimate is an upper bound, so on a step where a
    few loose pages seem to hold all the mass the floor still attends the next-best pages.

    Args:
        top_p: target estimated mass, in ``(0, 1]``.
        min_budget: the floor, in tokens: a multiple of ``page_size`` in ``[0, token_budget]``
            (``0``: none beyond the sink, recent and current pages; ``token_budget``: plain Quest).
        other arguments: as in :class:`PagePolicy`.
    """

    name = "quest-topp"
    options = PagePolicy.options + ("top_p", "min_budget")

    def __init__(
        self, token_budget: Optional[int], page_size: int = QuestConfig.page_size, top_p: float = 0.9,
        min_budget: int = 0, **options
    ) -> None:
        self.top_p = check_float("policy 'quest-topp': top_p", top_p, low=0, high=1, low_open=True)
        super().__init__(token_budget, page_size, **options)
        self.min_budget = check_int("policy 'quest-topp': min_budget", min_budget, minimum=0, maximum=token_budget)
        if min_budget % page_size:
            raise ValueError(
                f"policy 'quest-topp': min_budget must be a multiple of page_size={page_size}, got {min_budget}"
            )

    def estimated_mass(
        self, q: torch.Tensor, layer: LayerPages, page_table: torch.Tensor, seq_lens: torch.Tensor,
        sm_scale: Optional[float] = None,
    ) -> torch.Tensor:
        """``[batch, num_sel_heads, max_pages]`` float32 estimated attention mass per page (0 past
        a sequence's pages); see the class docstring."""
        head_dim = q.shape[-1]
        scale = head_dim**-0.5 if sm_scale is None else sm_scale
        bounds = reference.page_scores(q, layer.kmin, layer.kmax, page_table, seq_lens, self.page_size, "q_head")
        start = torch.arange(page_table.shape[1], device=q.device)[None, :] * self.page_size
        tokens = (seq_lens.long()[:, None] - start).clamp(0, self.page_size)  # [B, P], 0 past the end
        mass = torch.softmax(bounds * scale + tokens.float().log()[:, None, :], dim=-1)
        mass = self._combine_group(mass, layer.kmin.shape[1])
        if self.config.selection == "kv_head" and self.config.group_reduction == "sum":
            mass = mass / (q.shape[1] // layer.kmin.shape[1])
        return mass

    def _select(self, q, layer, page_table, seq_lens, sm_scale):
        config = self.config
        mass = self.estimated_mass(q, layer, page_table, seq_lens, sm_scale)
        batch, heads, max_pages = mass.shape
        num_pages = reference.num_pages(seq_lens, self.page_size)  # [B]
        index = torch.arange(max_pages, device=q.device)[None, :]
        valid = reference.valid_pages(seq_lens, self.page_size, max_pages)  # [B, P]
        forced = valid & reference.forced_page_mask(
            seq_lens, self.page_size, max_pages, config.sink_pages, config.recent_pages
        )
        # Rank: forced pages (key 2), then by estimated mass in [0, 1], invalid pages last (key -1).
        key = torch.where(forced, 2.0, torch.where(valid, 0.0, -1.0))[:, None, :] + torch.where(
            forced[:, None, :], 0.0, mass
        )
        order = key.argsort(dim=-1, descending=True, stable=True)
        reached = mass.gather(-1, order).cumsum(-1) >= self.top_p
        needed = torch.where(reached.any(-1), reached.int().argmax(-1) + 1, max_pages)  # [B, H]
        floor = forced.sum(-1, keepdim=True).clamp(min=self.min_budget // self.page_size)
        cap = num_pages.clamp(max=config.budget_pages)[:, None]
        count = torch.maximum(needed, floor).minimum(cap)
        keep = order.argsort(dim=-1) < count[..., None]  # rank within the ordering < count
        pages = torch.where(keep, index, max_pages).sort(dim=-1).values[..., : config.budget_pages]
        pages = torch.where(pages == max_pages, -1, pages)
        if pages.shape[-1] < config.budget_pages:
            pages = torch.cat([pages, pages.new_full((batch, heads, config.budget_pages - max_pages), -1)], dim=-1)
        return pages.to(torch.int32)
