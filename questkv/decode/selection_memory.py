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
from typing import Optional

import torch

from questkv import ops
from questkv.config import QuestConfig
from questkv.ops.pages import ReusedSelections


@dataclasses.dataclass(frozen=True)
class ReuseRows:
    """One decode step's selections in batch order.

    Attributes:
        gathered: from :func:`questkv.ops.gather_selections`; its fields read as this class's properties.
        selecting: ``False`` when the host knows that no row of the step selects (every row is off its phase and
            holds a selection; padding rows aside): the sparse layers launch the attend alone, and ``active`` is all
            zero on the real rows.
        stored: a step with dense and Quest rows (the runner's mixed step): these rows are widened from the memory's
            ``stored`` rows, which the step's store narrows them back into; else ``None``.
    """

    gathered: ReusedSelections
    selecting: bool = True
    stored: Optional["ReuseRows"] = None

    @property
    def active(self) -> torch.Tensor:
        """``[batch]`` int32, 1 where the row estimates and selects in this step (every head of it), 0 where it
        reuses."""
        return self.gathered.active

    @property
    def selected(self) -> torch.Tensor:
        """``[num_sparse_layers, batch, num_sel_heads, budget_pages + extra_pages]`` int32 logical pages, ``-1``
        padding: a reusing row's last selection (its first ``budget_pages`` columns) and the pages begun since (the
        last ``extra_pages``); an active row's selection is written into its first ``budget_pages`` columns by the
        step, its last ones are ``-1``."""
        return self.gathered.selected

    @property
    def selected_at(self) -> torch.Tensor:
        """``[batch]`` int32, the page count of each row's selection (this step's for active rows)."""
        return self.gathered.selected_at


class SelectionMemory:
    """The last selection of every sparse layer for every cache sequence slot, and per slot the selections made.

    Args:
        config: the engine's sparse Quest config (``selection_interval`` > 1).
        num_layers: the model's layers (the first ``config.dense_layers`` have no selection).
        num_sel_heads: heads that select (KV heads for ``kv_head`` selection, query heads for ``q_head``).
        max_seqs: cache sequence slots (``PagedKVCache.max_seqs``).
        backend: of the gather and store ops (:func:`questkv.ops.resolve_backend`).

    Buffers: ``pages`` ``[num_sparse_layers, max_seqs, num_sel_heads, budget_pages + extra_pages]`` int32 and
    ``selected_at`` ``[max_seqs]`` int32 (the page count when the slot's sequence last selected, ``-1`` for
    none: a slot whose sequence was (re)prefilled or whose step could not keep its selection). The selection-rate
    counters,
    ``selections``, ``steps`` and ``last_selections`` ``[max_seqs]`` int64: (sparse layer, head) selections and
    decode steps of each slot's sequence since its (re)prefill, and the selections of its latest step, on the
    device (:meth:`selection_rate` reads them).
    """

    def __init__(self, config: QuestConfig, num_layers: int, num_sel_heads: int, max_seqs: int,
                 device: torch.device | str, backend: str = "auto") -> None:
        if config.is_dense or config.selection_interval < 2:
            raise ValueError(f"SelectionMemory needs a sparse config with selection_interval >= 2, got {config}")
        self.backend = backend
        self.page_size = config.page_size
        self.budget_pages = config.budget_pages
        self.extra_pages = config.reuse_extra_pages
        width = self.budget_pages + self.extra_pages
        self.sparse_layers = num_layers - min(config.dense_layers, num_layers)
        self.num_sel_heads = num_sel_heads
        self.pages = torch.full((self.sparse_layers, max_seqs, num_sel_heads, width), -1, dtype=torch.int32,
                                device=device)
        self.selected_at = torch.full((max_seqs,), -1, dtype=torch.int32, device=device)
        self.selections = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        self.steps = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        self.last_selections = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        self._one = torch.ones(1, dtype=torch.int64, device=device)

    @staticmethod
    def nbytes(config: QuestConfig, num_layers: int, num_sel_heads: int, max_seqs: int) -> int:
        """Device bytes a memory of these arguments takes (0 when the config has no reuse)."""
        if config.is_dense or config.selection_interval < 2:
            return 0
        sparse_layers = num_layers - min(config.dense_layers, num_layers)
        width = config.budget_pages + config.reuse_extra_pages
        return 4 * (sparse_layers * max_seqs * num_sel_heads * width + max_seqs) + 8 * (3 * max_seqs + 1)

    @property
    def counters(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The selection-rate counters (``selections``, ``steps``, ``last_selections``), which a step adds to."""
        return self.selections, self.steps, self.last_selections

    def forget(self, seq_ids: torch.Tensor) -> None:
        """Drop the selections of slots ``seq_ids`` (``[n]`` int64 on the device): their next step selects."""
        self.selected_at.index_fill_(0, seq_ids, -1)

    def restart(self, seq_ids: torch.Tensor) -> None:
        """A (re)prefill of slots ``seq_ids`` (``[n]`` int64 on the device): :meth:`forget` and zero their
        selection-rate counters."""
        self.forget(seq_ids)
        for counter in self.counters:
            counter.index_fill_(0, seq_ids, 0)

    def forget_where(self, seq_ids: torch.Tensor, flags: torch.Tensor) -> None:
        """:meth:`forget` the slots ``seq_ids`` (``[batch]`` int64) whose ``flags`` (``[batch]`` bool) are set, on the
        device (no host synchronisation: padding rows sharing a slot leave it as the last of them says)."""
        kept = self.selected_at.index_select(0, seq_ids)
        self.selected_at.index_copy_(0, seq_ids, torch.where(flags, torch.full_like(kept, -1), kept))

    def count_dense_step(self, seq_ids: torch.Tensor) -> None:
        """A step where every row decodes densely (its route): no selection is made or kept; counted as a step
        without selections for the selection rate of slots ``seq_ids`` (``[batch]`` int64). Three index kernels
        and no temporary: the step of a lossless engine's dense requests costs little more than a dense engine's."""
        self.forget(seq_ids)
        self.steps.index_add_(0, seq_ids, self._one.expand(seq_ids.shape[0]))
        self.last_selections.index_fill_(0, seq_ids, 0)

    def selection_rate(self, slot: int, discard_last: bool = False) -> Optional[float]:
        """The fraction of (decode step, sparse layer, selecting head) of slot ``slot``'s sequence, since its
        (re)prefill, that estimated and selected; ``None`` before its first decode step. ``discard_last``: leave
        its latest step out (one whose tokens were discarded: asynchronous scheduling ran it after the step that
        finished the sequence). Reads the device counters (one host synchronisation: call it when the request
        finishes)."""
        selections, steps, last = torch.stack(
            [self.selections[slot], self.steps[slot], self.last_selections[slot]]).tolist()
        if discard_last and steps:
            selections, steps = selections - last, steps - 1
        if not steps or not self.sparse_layers:
            return None
        return selections / (steps * self.sparse_layers * self.num_sel_heads)

    def rows(self, seq_ids: torch.Tensor, due: torch.Tensor, seq_lens: torch.Tensor, selecting: bool = True
             ) -> ReuseRows:
        """The step's selections of slots ``seq_ids`` in batch order.

        A row selects when ``due`` says so, when its slot holds no selection, or when more pages began since
        its selection than the extra columns hold (a step that could not keep one, see :meth:`forget`).

        Args:
            seq_ids: ``[batch]`` int64 cache slots (padding rows may repeat one).
            due: ``[batch]`` integer, nonzero where the row's phase makes it select.
            seq_lens: ``[batch]`` int32, the current token included.
            selecting: ``False``: the caller knows that no real row selects (see :attr:`ReuseRows.selecting`).
        """
        rows = ops.gather_selections(self.pages, self.selected_at, seq_ids, due, seq_lens, self.page_size,
                                     self.budget_pages, backend=self.backend)
        return ReuseRows(rows, selecting)

    def store_step(self, seq_ids: torch.Tensor, rows: ReuseRows, dense: torch.Tensor) -> None:
        """:meth:`store` a decode step's rows (slots ``seq_ids``); a step of dense and Quest rows (its rows widened
        from the memory's ``stored`` ones, see :class:`ReuseRows`) keeps its Quest rows' selections, narrowed to the
        memory's columns, and forgets the rows flagged ``dense`` (``[batch]`` bool), which kept none."""
        if rows.stored is None:
            self.store(seq_ids, rows)
            return
        stored = rows.stored
        narrow = stored.gathered._replace(active=rows.active, selected=rows.selected[..., :stored.selected.shape[-1]])
        self.store(seq_ids, ReuseRows(narrow))
        self.forget_where(seq_ids, dense)

    def store(self, seq_ids: torch.Tensor, rows: ReuseRows) -> None:
        """Keep the step's selections (``rows`` from :meth:`rows` of the same ``seq_ids``) for the next steps and
        count the (layer, head) selections the step made."""
        ops.store_selections(self.pages, self.selected_at, self.counters, seq_ids, rows.gathered,
                             backend=self.backend)


def selection_seq_len(seq_len: int, num_prompt_tokens: int, interval: int) -> int:
    """The sequence length at the decode step that made the selection a step bringing the sequence to ``seq_len``
    tokens attends (``seq_len`` on a due step; see :func:`is_due`). Assumes the regular phase (no selection
    forced by a prefill or a dense request's step in between)."""
    return seq_len - (seq_len - num_prompt_tokens - 1) % interval


def is_due(seq_len: int, num_prompt_tokens: int, interval: int) -> bool:
    """Whether a decode step whose input token brings the sequence to ``seq_len`` tokens selects by phase:
    output ``k = seq_len - num_prompt_tokens - 1`` feeds it, and it selects when ``k % interval == 0``."""
    return (seq_len - num_prompt_tokens - 1) % interval == 0
