"""Two-stage Quest (``quest-rerank``): the page bounds shortlist pages, the shortlisted pages' keys (or a low-bit
copy of them) re-rank them. A policy of the HF path (:mod:`questkv.integrations.hf`, run by :mod:`questkv.eval`),
torch only: the engine never runs it.

The low-bit copy ranked by attention mass beat Quest at equal KV bytes but not at equal time: its Triton scoring
kernel was bound by instructions, not bytes (``benchmarks/results/kernels-h200.md``, "Estimate from 2-bit key
codes"). The kernel and its stored-code ops left :mod:`questkv.ops` (git keeps them); the codes' definition lives
here, in :func:`quantize_within_bounds`.
"""

from __future__ import annotations

from typing import Optional

import torch

from questkv.config import RERANKS, QuestConfig
from questkv.ops import LayerPages, reference
from questkv.policies.page_selection import PagePolicy
from questkv.validation import check_choice, check_int

KEY_BITS: tuple[int, ...] = (1, 2, 4, 8)
"""Widths of :class:`QuestRerankPolicy`'s low-bit key codes (``key_bits``; ``None``: exact keys)."""


def quantize_within_bounds(keys: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, bits: int) -> torch.Tensor:
    """Keys as a ``bits``-bit code per element within their page's bounds, decoded.

    Channel ``i`` of a key in a page with bounds ``[kmin_i, kmax_i]`` is stored as the index
    ``c = clamp(floor((k_i - kmin_i) / w_i), 0, 2**bits - 1)`` of the one of ``2**bits`` equal cells
    ``w_i = (kmax_i - kmin_i) / 2**bits`` of that interval that holds it (``c = 0`` where ``w_i = 0``, and for a
    NaN key, an unwritten slot), and decoded to the cell's centre ``kmin_i + (c + 0.5) w_i`` (``kmin_i`` where
    ``w_i = 0``), all in float32. Only ``c`` is new per token: the bounds are Quest's, read for the estimate anyway.

    Args:
        keys: ``[..., page_size, H, D]``, each page's keys.
        kmin, kmax: ``[..., H, D]``, the same pages' bounds (the page dimension broadcast in).
        bits: one of :data:`KEY_BITS`.

    Returns:
        ``[..., page_size, H, D]`` float32, the decoded keys.
    """
    cells = 2**bits
    low = kmin.float().unsqueeze(-3)  # [..., 1, H, D]
    width = (kmax.float().unsqueeze(-3) - low) * (1.0 / cells)  # exact: a power of two
    cell = torch.floor((keys.float() - low) / torch.where(width > 0, width, 1.0))
    cell = torch.where(cell > 0, cell, 0.0)  # NaN -> 0
    cell = torch.where(cell < cells - 1, cell, float(cells - 1))
    return torch.where(width > 0, low + (cell + 0.5) * width, low)


def page_logits(q: torch.Tensor, keys: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Every page token's logit ``q_h . k_t`` (no softmax scale), float32 math.

    Args:
        q: ``[batch, num_q_heads, head_dim]``.
        keys: ``[batch, max_pages, page_size, num_kv_heads, head_dim]``, each sequence's pages in
            page-table order (gathered keys, or keys decoded by :func:`quantize_within_bounds`).
        seq_lens: ``[batch]`` int32.

    Returns:
        ``[batch, num_q_heads, max_pages, page_size]`` float32, ``-inf`` at slots past a sequence's length.
    """
    batch, num_q_heads, head_dim = q.shape
    _, max_pages, page_size, num_kv_heads, _ = keys.shape
    qg = q.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    logits = torch.einsum("bkgd,bptkd->bkgpt", qg, keys.float()).reshape(batch, num_q_heads, max_pages, page_size)
    position = torch.arange(max_pages * page_size, device=q.device).view(max_pages, page_size)
    written = position[None] < seq_lens.long()[:, None, None]  # [B, P, ps]
    return logits.masked_fill(~written[:, None], float("-inf"))


class QuestRerankPolicy(PagePolicy):
    """Two-stage Quest: the page bound shortlists, the shortlisted pages' exact keys re-rank.

    Stage 1 is Quest at ``shortlist`` times the budget: the top ``shortlist * budget_pages`` pages
    per (sequence, selection head) by :func:`questkv.ops.reference.page_scores` (the sink, recent
    and current pages forced in). Stage 2 reads the keys of those pages only and scores each one
    exactly, per query head ``h``:

    * ``rerank="max"``: the page's largest logit ``max_t q_h . k_t`` over its written tokens, the
      exact value that Quest's bound ``sum_i max(q_hi kmin_i, q_hi kmax_i)`` over-estimates (a page
      whose bound is loose, because its keys are mixed, drops to its true best key);
    * ``rerank="mass"``: the page's attention mass within the shortlist, ``Z_hp / sum_j Z_hj`` with
      ``Z_hp = sum_t exp(s q_h . k_t)`` (``s`` the softmax scale) and ``j`` over the shortlist: the
      oracle's ranking restricted to the shortlist.

    Under ``kv_head`` selection the query group's scores combine with ``group_reduction`` as Quest's
    do. The top ``budget_pages`` shortlisted pages by that score are attended, the forced pages
    always. ``shortlist=1`` is Quest exactly; the extra cost is the shortlist's keys, read once
    (:func:`questkv.policies.cost.kv_bytes_per_step`).

    With ``key_bits`` set, stage 2 reads a low-bit copy of the keys instead of the keys: each channel
    as a ``key_bits``-bit code within its page's bounds (:func:`quantize_within_bounds`), so a
    shortlist costs ``key_bits / 16`` of its bf16 keys and can be long (``shortlist`` large enough
    covers every page). A cache would write a page's codes once, when the page is full and its
    bounds final; this policy derives them from the keys at each step, which gives the same codes
    (the current page, whose bounds still change, is always attended).

    Args:
        shortlist: pages shortlisted per attended page, an int >= 1.
        rerank: ``"max"`` or ``"mass"`` (see above).
        key_bits: ``None`` (exact keys) or a width of :data:`KEY_BITS`.
        other arguments: as in :class:`PagePolicy`.
    """

    name = "quest-rerank"
    options = PagePolicy.options + ("shortlist", "rerank", "key_bits")

    def __init__(
        self, token_budget: Optional[int], page_size: int = QuestConfig.page_size, shortlist: int = 4,
        rerank: str = "max", key_bits: Optional[int] = None, **options
    ) -> None:
        self.shortlist = check_int("policy 'quest-rerank': shortlist", shortlist, minimum=1)
        self.rerank = check_choice("policy 'quest-rerank': rerank", rerank, RERANKS)
        if key_bits is not None:
            check_int("policy 'quest-rerank': key_bits", key_bits, minimum=1)
            check_choice("policy 'quest-rerank': key_bits", key_bits, KEY_BITS)
        self.key_bits = key_bits
        super().__init__(token_budget, page_size, **options)

    def shortlist_pages(
        self, q: torch.Tensor, layer: LayerPages, page_table: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """Stage 1: ``[batch, num_sel_heads, shortlist * budget_pages]`` int32, Quest's selection at
        ``shortlist`` times the budget (format of :func:`questkv.ops.reference.select_pages`)."""
        config = self.config
        scores = reference.page_scores(
            q, layer.kmin, layer.kmax, page_table, seq_lens, self.page_size, config.selection, config.group_reduction
        )
        return reference.select_pages(
            scores, seq_lens, self.page_size, self.shortlist * config.budget_pages, config.sink_pages,
            config.recent_pages,
        )

    def rerank_scores(
        self, q: torch.Tensor, layer: LayerPages, page_table: torch.Tensor, seq_lens: torch.Tensor,
        shortlisted: torch.Tensor, sm_scale: Optional[float] = None,
    ) -> torch.Tensor:
        """Stage 2: ``[batch, num_sel_heads, max_pages]`` float32 page scores from the keys (or their
        low-bit codes; see the class docstring); ``-inf`` for pages outside a row's shortlist.

        Args:
            shortlisted: ``[batch, num_sel_heads, max_pages]`` bool, the pages of
                :meth:`shortlist_pages` (a row's other pages are never scored).
        """
        head_dim = q.shape[2]
        num_kv_heads = layer.kmin.shape[1]
        table = page_table.long()
        keys = layer.k_pages[table]  # [B, P, ps, Hkv, D]
        if self.key_bits is not None:
            keys = quantize_within_bounds(keys, layer.kmin[table], layer.kmax[table], self.key_bits)
        logits = page_logits(q, keys, seq_lens)  # [B, Hq, P, ps]
        if self.rerank == "max":
            return self._combine_group(logits.amax(-1), num_kv_heads).masked_fill(~shortlisted, float("-inf"))
        # each query head's softmax over its shortlist of the pages' log-partition sums; under kv_head a KV head's
        # shortlist is its whole query group's
        scale = head_dim**-0.5 if sm_scale is None else sm_scale
        lse = torch.logsumexp(logits * scale, dim=-1)  # [B, Hq, P]
        group = q.shape[1] // num_kv_heads
        per_q = shortlisted if self.config.selection == "q_head" else shortlisted.repeat_interleave(group, 1)
        mass = torch.softmax(lse.masked_fill(~per_q, float("-inf")), dim=-1)
        return self._combine_group(mass, num_kv_heads).masked_fill(~shortlisted, float("-inf"))

    def _select(self, q, layer, page_table, seq_lens, sm_scale):
        config = self.config
        short = self.shortlist_pages(q, layer, page_table, seq_lens)
        batch, heads, _ = short.shape
        max_pages = page_table.shape[1]
        shortlisted = torch.zeros(batch, heads, max_pages + 1, dtype=torch.bool, device=q.device)
        shortlisted.scatter_(-1, torch.where(short >= 0, short, max_pages).long(), True)
        scores = self.rerank_scores(q, layer, page_table, seq_lens, shortlisted[..., :max_pages], sm_scale)
        return reference.select_pages(
            scores, seq_lens, self.page_size, config.budget_pages, config.sink_pages, config.recent_pages
        )
