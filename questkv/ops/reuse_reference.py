"""Torch reference of the selection memory's ops (selection reuse): the oracle of :mod:`questkv.ops.triton.reuse`.

The memory (:class:`~questkv.decode.selection_memory.SelectionMemory`) keeps every cache slot's last selection per
sparse layer; a decode step lays them out in batch order (:func:`gather_selections`) and keeps the step's own after
it (:func:`store_selections`). Layouts as in :mod:`questkv.ops.reference`.
"""

from __future__ import annotations

import torch

from questkv.ops.checks import check_selection_memory, check_stored_selections
from questkv.ops.pages import ReusedSelections
from questkv.ops.reference import num_pages


def gather_selections(
    pages: torch.Tensor,
    selected_at: torch.Tensor,
    slots: torch.Tensor,
    due: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    budget_pages: int,
) -> ReusedSelections:
    """Lay a selection memory's last selections out in batch order for one decode step (selection reuse).

    A row selects (``active``) when ``due`` says so, when its slot holds no selection (``selected_at < 0``) or
    when more pages began since its selection than the memory's extra columns hold. Every row gets its slot's
    stored selection in its first ``budget_pages`` columns (an active row's are overwritten by the step's select)
    and, in the extra columns ``[budget_pages, width)``, the pages begun since the selection was made (``-1``
    past the row's pages), counted from ``selected_at``. No host synchronisation.

    Args:
        pages: ``[num_sparse_layers, max_seqs, num_sel_heads, width]`` int32, the memory's selections.
        selected_at: ``[max_seqs]`` int32, each slot's page count at its last selection (``-1``: none).
        slots: ``[batch]`` int64 cache slots of the rows (padding rows may repeat one).
        due: ``[batch]`` integer, nonzero where the row's phase makes it select.
        seq_lens: ``[batch]`` int32, the current token included.

    Returns:
        ``active`` ``[batch]`` int32; ``selected`` ``[num_sparse_layers, batch, num_sel_heads, width]`` int32;
        ``selected_at`` ``[batch]`` int32 (the step's page count for active rows); ``num_pages`` ``[batch]``
        int32.
    """
    check_selection_memory(pages, selected_at, slots, budget_pages)
    extra_pages = pages.shape[-1] - budget_pages
    count = num_pages(seq_lens, page_size)  # [B]
    before = selected_at.index_select(0, slots).long()
    active = (due != 0) | (before < 0) | (count - before > extra_pages)
    row_at = torch.where(active, count, before)
    selected = pages.index_select(1, slots)  # [L, B, H, W]
    begun = row_at[:, None, None] + torch.arange(extra_pages, device=slots.device)  # [B, 1, extra]
    selected[..., budget_pages:] = torch.where(begun < count[:, None, None], begun, -1)
    return ReusedSelections(active.to(torch.int32), selected, row_at.to(torch.int32), count.to(torch.int32))


def store_selections(
    pages: torch.Tensor,
    selected_at: torch.Tensor,
    counters: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    rows: ReusedSelections,
) -> None:
    """Keep a step's selections (``rows`` from :func:`gather_selections` of the same ``slots``, its ``selected``
    written by the step) in the memory and count the (layer, head) selections the step made: every head of an
    active row. ``counters``: the memory's
    ``selections``, ``steps`` and ``last_selections`` ``[max_seqs]`` int64 (:func:`count_selections`). Padding
    rows sharing a slot race there; real rows have slots of their own. No host synchronisation."""
    check_stored_selections(pages, selected_at, slots, rows)
    layers, heads = pages.shape[0], pages.shape[2]
    pages.index_copy_(1, slots, rows.selected)
    selected_at.index_copy_(0, slots, rows.selected_at)
    count_selections(counters, slots, rows.active.long() * (layers * heads))


def count_selections(counters: tuple[torch.Tensor, torch.Tensor, torch.Tensor], slots: torch.Tensor,
                     made: torch.Tensor) -> None:
    """Add one decode step making ``made`` (``[batch]`` int64) (layer, head) selections to slots ``slots``'
    counters (``selections``, ``steps``, ``last_selections``, each ``[max_seqs]`` int64): the first two add up,
    the last holds the step's."""
    selections, steps, last_selections = counters
    selections.index_add_(0, slots, made)
    steps.index_add_(0, slots, torch.ones_like(made))
    last_selections.index_copy_(0, slots, made)
