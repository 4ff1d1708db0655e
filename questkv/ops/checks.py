"""Argument checks of the Quest ops, shared by the torch reference and the Triton kernels.

Each raises ``ValueError`` naming the argument, what it got and what is allowed, and reads shapes, dtypes and
devices only (no host synchronisation), so the decode step's CUDA graphs may call them. Layouts: the module
docstring of :mod:`questkv.ops.reference`.
"""

from __future__ import annotations

import torch

from questkv.config import GROUP_REDUCTIONS, SELECTIONS
from questkv.ops.pages import ReusedSelections


def check_prefill_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    query_starts: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """``ValueError`` unless the shapes, dtypes and devices of
    :func:`questkv.ops.reference.paged_prefill_attention`'s tensors agree (the values are the caller's to get
    right)."""
    if q.dim() != 3 or not q.dtype.is_floating_point:
        raise ValueError(f"q must be a float [num_tokens, num_q_heads, head_dim] tensor, got {q.dtype} "
                         f"of shape {tuple(q.shape)}")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    if k_pages.dim() != 4 or k_pages.shape[3] != head_dim or not k_pages.dtype.is_floating_point:
        raise ValueError(f"k_pages must be a float [num_pages, page_size, num_kv_heads, {head_dim}] tensor, got "
                         f"{k_pages.dtype} of shape {tuple(k_pages.shape)}")
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages must match k_pages ({k_pages.dtype}, {tuple(k_pages.shape)}), got "
                         f"{v_pages.dtype}, {tuple(v_pages.shape)}")
    num_kv_heads = k_pages.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    batch = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    for name, tensor, shape in (("seq_lens", seq_lens, (batch,)), ("query_starts", query_starts, (batch + 1,)),
                                ("page_table", page_table, (batch, page_table.shape[-1]))):
        if tensor.dtype != torch.int32 or tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must be int32 of shape {shape} (batch from seq_lens), got {tensor.dtype} "
                             f"of shape {tuple(tensor.shape)}")
    for name, tensor in (("k_pages", k_pages), ("v_pages", v_pages), ("page_table", page_table),
                         ("query_starts", query_starts), ("seq_lens", seq_lens)):
        if tensor.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {tensor.device}")


def check_active(active: torch.Tensor, batch: int, device: torch.device) -> None:
    """``ValueError`` unless ``active`` (the ``*_into`` ops' flags, one per sequence) is a contiguous ``[batch]``
    int32 tensor on ``device``."""
    if not isinstance(active, torch.Tensor):
        raise ValueError(f"active must be None or a contiguous [batch] int32 tensor, got {type(active).__name__}")
    if (tuple(active.shape) != (batch,) or active.dtype != torch.int32 or active.device != torch.device(device)
            or not active.is_contiguous()):
        raise ValueError(f"active must be None or a contiguous int32 tensor of shape ({batch},) on {device}, "
                         f"got shape {tuple(active.shape)}, {active.dtype} on {active.device}"
                         f"{'' if active.is_contiguous() else ', not contiguous'}")


def check_row_budgets(selected, budgets, selection_cols, batch: int) -> int:
    """The decode attention's per-row budgets: ``ValueError`` unless ``budgets`` is ``None`` or, with ``selected``, a
    contiguous ``[batch]`` int32 tensor on its device, and ``selection_cols`` is ``None`` or an int in ``[1,
    selected.shape[-1]]``; returns ``selection_cols`` resolved (default: every column)."""
    if budgets is None:
        if selection_cols is not None:
            raise ValueError("selection_cols is given without budgets; it only tells which columns budgets limit")
        return 0 if selected is None else selected.shape[-1]
    if selected is None:
        raise ValueError("budgets limit a selection's columns: dense attention (selected=None) takes none")
    if (not isinstance(budgets, torch.Tensor) or tuple(budgets.shape) != (batch,) or budgets.dtype != torch.int32
            or budgets.device != selected.device or not budgets.is_contiguous()):
        got = (f"shape {tuple(budgets.shape)}, {budgets.dtype} on {budgets.device}" if isinstance(budgets, torch.Tensor)
               else type(budgets).__name__)
        raise ValueError(f"budgets must be None or a contiguous int32 tensor of shape ({batch},) on {selected.device}, "
                         f"got {got}")
    if selection_cols is None:
        return selected.shape[-1]
    if isinstance(selection_cols, bool) or not isinstance(selection_cols, int) or not (
            1 <= selection_cols <= selected.shape[-1]):
        raise ValueError(f"selection_cols must be an int in [1, {selected.shape[-1]}] (selected's columns), "
                         f"got {selection_cols!r}")
    return selection_cols


def check_select_out(out: torch.Tensor, batch: int, num_sel_heads: int, budget_pages: int) -> None:
    """``ValueError`` unless ``out`` is ``[batch, num_sel_heads, width]`` with ``width >= budget_pages``
    (the selection fills its first ``budget_pages`` columns)."""
    if out.dim() != 3 or tuple(out.shape[:2]) != (batch, num_sel_heads) or out.shape[2] < budget_pages:
        raise ValueError(f"out must have shape ({batch}, {num_sel_heads}, >= budget_pages={budget_pages}), "
                         f"got {tuple(out.shape)}")


def check_mode(selection: str, group_reduction: str) -> None:
    """``ValueError`` unless ``selection`` is one of :data:`questkv.config.SELECTIONS` and ``group_reduction`` one
    of :data:`questkv.config.GROUP_REDUCTIONS` (the page-score ops' modes)."""
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
    if group_reduction not in GROUP_REDUCTIONS:
        raise ValueError(f"group_reduction must be one of {GROUP_REDUCTIONS}, got {group_reduction!r}")


def check_selection_memory(pages: torch.Tensor, selected_at: torch.Tensor, slots: torch.Tensor, budget_pages: int
                           ) -> None:
    """``ValueError`` unless a selection memory's tensors agree (the shapes of
    :func:`questkv.ops.reuse_reference.gather_selections`)."""
    if pages.dim() != 4 or pages.dtype != torch.int32 or not 1 <= budget_pages <= pages.shape[-1]:
        raise ValueError(f"pages must be [num_sparse_layers, max_seqs, num_sel_heads, width >= budget_pages="
                         f"{budget_pages}] int32, got {tuple(pages.shape)} {pages.dtype}")
    max_seqs = pages.shape[1]
    if tuple(selected_at.shape) != (max_seqs,) or selected_at.dtype != torch.int32:
        raise ValueError(f"selected_at must be [{max_seqs}] int32, got {tuple(selected_at.shape)} {selected_at.dtype}")
    if slots.dim() != 1 or slots.dtype != torch.int64:
        raise ValueError(f"slots must be [batch] int64, got {tuple(slots.shape)} {slots.dtype}")


def check_stored_selections(pages: torch.Tensor, selected_at: torch.Tensor, slots: torch.Tensor,
                            rows: ReusedSelections) -> None:
    """``ValueError`` unless :func:`questkv.ops.reuse_reference.store_selections`' arguments agree."""
    check_selection_memory(pages, selected_at, slots, 1)
    layers, _, heads, width = pages.shape
    if tuple(rows.selected.shape) != (layers, slots.shape[0], heads, width):
        raise ValueError(f"rows.selected must be [{layers}, {slots.shape[0]}, {heads}, {width}], got "
                         f"{tuple(rows.selected.shape)}")
