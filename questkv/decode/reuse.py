"""Selection reuse (``QuestConfig.selection_interval`` C > 1): every sequence's last page selection, kept
between decode steps.

A sequence selects on the decode steps its phase makes due (its first decode step after a prefill and every
C-th after it, counted on its own outputs, so the batch it shares does not matter) and whenever it has no
usable selection; on the other steps every sparse layer attends the pages that layer selected last plus the
pages begun since. :class:`SelectionMemory` holds those selections per cache sequence slot and lays them out in
batch order for a step (:meth:`SelectionMemory.rows`), with device ops only, so a step with reuse captures in a
CUDA graph: the estimate and select kernels skip the rows that reuse (their ``active`` flag is 0).
"""

from __future__ import annotations

import dataclasses

import torch

from questkv.config import QuestConfig


@dataclasses.dataclass(frozen=True)
class ReuseRows:
    """One decode step's selections in batch order.

    Attributes:
        active: ``[batch]`` int32, 1 where the row estimates and selects in this step, 0 where it reuses.
        selected: ``[num_sparse_layers, batch, num_sel_heads, budget_pages + extra_pages]`` int32 logical
            pages, ``-1`` padding: a reusing row's last selection (its first ``budget_pages`` columns) and the
            pages begun since (the last ``extra_pages``); an active row's selection is written into its first
            ``budget_pages`` columns by the step, its last ones are ``-1``.
        selected_at: ``[batch]`` int32, the page count of each row's selection (this step's for active rows).
    """

    active: torch.Tensor
    selected: torch.Tensor
    selected_at: torch.Tensor


class SelectionMemory:
    """The last selection of every sparse layer for every cache sequence slot.

    Args:
        config: the engine's sparse Quest config (``selection_interval`` > 1).
        num_layers: the model's layers (the first ``config.dense_layers`` have no selection).
        num_sel_heads: heads that select (KV heads for ``kv_head`` selection, query heads for ``q_head``).
        max_seqs: cache sequence slots (``PagedKVCache.max_seqs``).

    Buffers: ``pages`` ``[num_sparse_layers, max_seqs, num_sel_heads, budget_pages + extra_pages]`` int32 and
    ``selected_at`` ``[max_seqs]`` int32 (the page count when the slot's sequence last selected, ``-1`` for
    none: a slot whose sequence was (re)prefilled or whose step could not keep its selection).
    """

    def __init__(self, config: QuestConfig, num_layers: int, num_sel_heads: int, max_seqs: int,
                 device: torch.device | str) -> None:
        if config.is_dense or config.selection_interval < 2:
            raise ValueError(f"SelectionMemory needs a sparse config with selection_interval >= 2, got {config}")
        self.page_size = config.page_size
        self.budget_pages = config.budget_pages
        self.extra_pages = config.reuse_extra_pages
        width = self.budget_pages + self.extra_pages
        sparse_layers = num_layers - min(config.dense_layers, num_layers)
        self.pages = torch.full((sparse_layers, max_seqs, num_sel_heads, width), -1, dtype=torch.int32, device=device)
        self.selected_at = torch.full((max_seqs,), -1, dtype=torch.int32, device=device)

    @staticmethod
    def nbytes(config: QuestConfig, num_layers: int, num_sel_heads: int, max_seqs: int) -> int:
        """Device bytes a memory of these arguments takes (0 when the config has no reuse)."""
        if config.is_dense or config.selection_interval < 2:
            return 0
        sparse_layers = num_layers - min(config.dense_layers, num_layers)
        width = config.budget_pages + config.reuse_extra_pages
        return 4 * (sparse_layers * max_seqs * num_sel_heads * width + max_seqs)

    def forget(self, seq_ids: torch.Tensor) -> None:
        """Drop the selections of slots ``seq_ids`` (``[n]`` int64 on the device): their next step selects."""
        self.selected_at.index_fill_(0, seq_ids, -1)

    def rows(self, seq_ids: torch.Tensor, due: torch.Tensor, seq_lens: torch.Tensor) -> ReuseRows:
        """The step's selections of slots ``seq_ids`` in batch order.

        A row selects when ``due`` says so, when its slot holds no selection, or when more pages began since
        its selection than the extra columns hold (a step that could not keep one, see :meth:`forget`).

        Args:
            seq_ids: ``[batch]`` int64 cache slots (padding rows may repeat one).
            due: ``[batch]`` integer, nonzero where the row's phase makes it select.
            seq_lens: ``[batch]`` int32, the current token included.
        """
        pages = (seq_lens + self.page_size - 1) // self.page_size  # [B]
        before = self.selected_at.index_select(0, seq_ids)  # [B]
        active = (due != 0) | (before < 0) | (pages - before > self.extra_pages)
        selected_at = torch.where(active, pages, before)
        selected = self.pages.index_select(1, seq_ids)  # [L, B, H, W]
        begun = selected_at[:, None] + torch.arange(self.extra_pages, device=seq_ids.device, dtype=torch.int32)
        extra = torch.where(begun < pages[:, None], begun, -1)  # [B, E]: pages begun since the selection
        selected[..., self.budget_pages:] = extra[None, :, None, :]
        return ReuseRows(active.to(torch.int32), selected, selected_at.to(torch.int32))

    def store(self, seq_ids: torch.Tensor, rows: ReuseRows) -> None:
        """Keep the step's selections (``rows`` from :meth:`rows` of the same ``seq_ids``) for the next steps."""
        self.pages.index_copy_(1, seq_ids, rows.selected)
        self.selected_at.index_copy_(0, seq_ids, rows.selected_at)


def selection_seq_len(seq_len: int, num_prompt_tokens: int, interval: int) -> int:
    """The sequence length at the decode step that made the selection a step bringing the sequence to ``seq_len``
    tokens attends (``seq_len`` on a due step; see :func:`is_due`). Assumes the regular phase (no selection
    forced by a prefill or a dense request's step in between)."""
    return seq_len - (seq_len - num_prompt_tokens - 1) % interval


def is_due(seq_len: int, num_prompt_tokens: int, interval: int) -> bool:
    """Whether a decode step whose input token brings the sequence to ``seq_len`` tokens selects by phase:
    output ``k = seq_len - num_prompt_tokens - 1`` feeds it, and it selects when ``k % interval == 0``."""
    return (seq_len - num_prompt_tokens - 1) % interval == 0
