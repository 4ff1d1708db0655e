"""Selection-memory kernels (selection reuse): a step's gather of the memory's selections into batch order, and
its store back with the selection counts.

One launch each per decode step, where the torch reference runs about twenty small kernels.
:func:`gather_selections` and :func:`store_selections` have the signatures and results of
:func:`questkv.ops.reuse_reference.gather_selections` and :func:`questkv.ops.reuse_reference.store_selections`.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from questkv.ops.checks import check_selection_memory, check_stored_selections
from questkv.ops.pages import ReusedSelections
from questkv.ops.triton._common import next_pow2, use_pdl

_NUM_WARPS = 4


@triton.jit
def _gather_selections_kernel(
    pages_ptr, selected_at_ptr, slots_ptr, due_ptr, lens_ptr,
    active_ptr, selected_ptr, row_at_ptr, num_pages_ptr,
    max_seqs, batch,
    LAYERS: tl.constexpr, HEADS: tl.constexpr, WIDTH: tl.constexpr, BUDGET: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per (sparse layer, row) copies the row's slot's ``[HEADS, BUDGET]`` selection and writes the
    extra columns; layer 0's program also writes the row's flag and page counts (grid ``(max(LAYERS, 1),
    batch)``: a memory of no sparse layer still gets them)."""
    layer = tl.program_id(0)
    row = tl.program_id(1)
    if USE_PDL:
        gdc_wait()
    slot = tl.load(slots_ptr + row)
    count = (tl.load(lens_ptr + row) + PAGE_SIZE - 1) // PAGE_SIZE
    before = tl.load(selected_at_ptr + slot)
    active = (tl.load(due_ptr + row) != 0) | (before < 0) | (count - before > WIDTH - BUDGET)
    row_at = tl.where(active, count, before)
    if layer == 0:
        tl.store(active_ptr + row, active.to(tl.int32))
        tl.store(row_at_ptr + row, row_at)
        tl.store(num_pages_ptr + row, count)
    if layer < LAYERS:
        h = tl.arange(0, BLOCK_H)
        w = tl.arange(0, BLOCK_W)[None, :]
        hmask = h < HEADS
        stored = tl.load(pages_ptr + ((layer * max_seqs + slot) * HEADS + h[:, None]) * WIDTH + w,
                         mask=hmask[:, None] & (w < BUDGET), other=-1)
        begun = row_at + (w - BUDGET)
        value = tl.where(w < BUDGET, stored, tl.where(begun < count, begun, -1))
        tl.store(selected_ptr + ((layer * batch + row) * HEADS + h[:, None]) * WIDTH + w, value,
                 mask=hmask[:, None] & (w < WIDTH))
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def _store_selections_kernel(
    pages_ptr, selected_at_ptr, selections_ptr, steps_ptr, last_ptr, slots_ptr,
    selected_ptr, row_at_ptr, active_ptr,
    max_seqs, batch,
    LAYERS: tl.constexpr, HEADS: tl.constexpr, WIDTH: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per (sparse layer, row) copies the row's selections to its slot; layer
    0's program also stores the row's page count and adds the step to the slot's counters (grid as the
    gather's)."""
    layer = tl.program_id(0)
    row = tl.program_id(1)
    if USE_PDL:
        gdc_wait()
    slot = tl.load(slots_ptr + row)
    if layer < LAYERS:
        h = tl.arange(0, BLOCK_H)
        w = tl.arange(0, BLOCK_W)[None, :]
        mask = (h < HEADS)[:, None] & (w < WIDTH)
        value = tl.load(selected_ptr + ((layer * batch + row) * HEADS + h[:, None]) * WIDTH + w, mask=mask)
        tl.store(pages_ptr + ((layer * max_seqs + slot) * HEADS + h[:, None]) * WIDTH + w, value, mask=mask)
    if layer == 0:
        tl.store(selected_at_ptr + slot, tl.load(row_at_ptr + row))
        made = tl.load(active_ptr + row).to(tl.int64) * (LAYERS * HEADS)
        # not atomic: only padding rows share a slot, and theirs is scratch
        tl.store(selections_ptr + slot, tl.load(selections_ptr + slot) + made)
        tl.store(steps_ptr + slot, tl.load(steps_ptr + slot) + 1)
        tl.store(last_ptr + slot, made)
    if USE_PDL:
        gdc_launch_dependents()


def _check_memory_contiguous(**tensors: Optional[torch.Tensor]) -> None:
    """The kernels index the memory's tensors as contiguous: raise ``ValueError`` for one that is not."""
    for name, tensor in tensors.items():
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()} for shape "
                             f"{tuple(tensor.shape)}")


def gather_selections(
    pages: torch.Tensor,
    selected_at: torch.Tensor,
    slots: torch.Tensor,
    due: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    budget_pages: int,
) -> ReusedSelections:
    """Triton :func:`questkv.ops.reuse_reference.gather_selections` (one launch, no host synchronisation). The memory's
    tensors must be contiguous (``ValueError`` otherwise)."""
    check_selection_memory(pages, selected_at, slots, budget_pages)
    _check_memory_contiguous(pages=pages, selected_at=selected_at)
    layers, max_seqs, heads, width = pages.shape
    batch = slots.shape[0]
    device = pages.device
    active, row_at, count = (torch.empty(batch, dtype=torch.int32, device=device) for _ in range(3))
    selected = torch.empty((layers, batch, heads, width), dtype=torch.int32, device=device)
    if batch:
        _gather_selections_kernel[(max(layers, 1), batch)](
            pages, selected_at, slots.contiguous(), due.contiguous(), seq_lens.contiguous(),
            active, selected, row_at, count,
            max_seqs, batch,
            LAYERS=layers, HEADS=heads, WIDTH=width, BUDGET=budget_pages, PAGE_SIZE=page_size,
            BLOCK_H=next_pow2(heads), BLOCK_W=next_pow2(width), USE_PDL=use_pdl(device),
            num_warps=_NUM_WARPS, launch_pdl=use_pdl(device),
        )
    return ReusedSelections(active, selected, row_at, count)


def store_selections(
    pages: torch.Tensor,
    selected_at: torch.Tensor,
    counters: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    rows: ReusedSelections,
) -> None:
    """Triton :func:`questkv.ops.reuse_reference.store_selections` (one launch, no host synchronisation). The memory's
    tensors (counters included) must be contiguous (``ValueError`` otherwise); padding rows sharing a slot race
    there (scratch)."""
    check_stored_selections(pages, selected_at, slots, rows)
    selections, steps, last_selections = counters
    _check_memory_contiguous(pages=pages, selected_at=selected_at, selections=selections, steps=steps, last_selections=last_selections)
    layers, max_seqs, heads, width = pages.shape
    batch = slots.shape[0]
    if not batch:
        return
    _store_selections_kernel[(max(layers, 1), batch)](
        pages, selected_at, selections, steps, last_selections, slots.contiguous(),
        rows.selected.contiguous(), rows.selected_at.contiguous(), rows.active.contiguous(),
        max_seqs, batch,
        LAYERS=layers, HEADS=heads, WIDTH=width, BLOCK_H=next_pow2(heads), BLOCK_W=next_pow2(width),
        USE_PDL=use_pdl(pages.device),
        num_warps=_NUM_WARPS, launch_pdl=use_pdl(pages.device),
    )
