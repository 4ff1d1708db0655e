"""Reselect kernel (adaptive selection reuse): which (sequence, selecting head) re-estimates in this step.

One launch per sparse layer and decode step, before the estimate: the one launch adaptive reuse adds to a
layer (the estimate and select then read its per-head flags). :func:`reselect_heads_into` has the signature
and the result of :func:`questkv.ops.reference.reselect_heads_into`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from questkv.ops.reference import check_reselect_args
from questkv.ops.triton._common import check_last_dim_contiguous, next_pow2, use_pdl

_NUM_WARPS = 4


@triton.jit
def _reselect_heads_kernel(
    active_ptr, q_ptr, queries_ptr, slots_ptr, forced_ptr, thresholds_ptr, selected_ptr,
    stride_qb, stride_qh,
    stride_mb, stride_mh,
    stride_sb, stride_sh,
    num_extra,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BUDGET: tl.constexpr,
    BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per (selecting head, sequence). It reads the head's query (its group's ``GROUP`` query heads
    of ``HEAD_DIM``, side by side) and the slot's last one, compares their cosine similarity with the sequence's
    threshold and writes the head's flag; a reselecting head also stores its query as the slot's last and
    ``-1`` into its ``num_extra`` selection columns past ``BUDGET``. Each program reads and writes only its own
    head's rows, so programs never race (but padding rows sharing a slot, whose writes are scratch)."""
    head = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    if USE_PDL:
        gdc_wait()
    slot = tl.load(slots_ptr + seq)
    forced = tl.load(forced_ptr + seq)
    threshold = tl.load(thresholds_ptr + seq)
    i = tl.arange(0, BLOCK)
    mask = i < GROUP * HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + (head * GROUP + i // HEAD_DIM) * stride_qh + i % HEAD_DIM,
                mask=mask, other=0.0)
    memory = queries_ptr + slot * stride_mb + head * stride_mh + i
    last = tl.load(memory, mask=mask, other=0.0).to(tl.float32)
    now = q.to(tl.float32)
    norms = tl.sqrt(tl.sum(now * now, axis=0) * tl.sum(last * last, axis=0))
    similarity = tl.sum(now * last, axis=0) / tl.maximum(norms, 1.1754943508222875e-38)
    similarity = tl.minimum(tl.maximum(similarity, -1.0), 1.0)
    flag = (forced != 0) | (similarity < threshold)
    tl.store(active_ptr + seq * tl.num_programs(0) + head, flag.to(tl.int32))
    if flag:
        tl.store(memory, q, mask=mask)
        j = tl.arange(0, BLOCK_E)
        tl.store(selected_ptr + seq * stride_sb + head * stride_sh + BUDGET + j, tl.full([BLOCK_E], -1, tl.int32),
                 mask=j < num_extra)
    if USE_PDL:
        gdc_launch_dependents()


def reselect_heads_into(
    active: torch.Tensor,
    q: torch.Tensor,
    queries: torch.Tensor,
    slots: torch.Tensor,
    forced: torch.Tensor,
    thresholds: torch.Tensor,
    selected: torch.Tensor,
    budget_pages: int,
) -> torch.Tensor:
    """Triton :func:`questkv.ops.reference.reselect_heads_into` (one launch, no host synchronisation; the
    argument shapes there). ``q`` may have any batch and head strides; ``queries`` and ``selected`` must be
    contiguous in their last dimension. Returns ``active``."""
    check_reselect_args(active, q, queries, slots, forced, thresholds, selected, budget_pages)
    batch, heads = active.shape
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    group = num_q_heads // heads
    check_last_dim_contiguous(q=q, queries=queries, selected=selected)
    num_extra = selected.shape[2] - budget_pages
    _reselect_heads_kernel[(heads, batch)](
        active, q, queries, slots, forced, thresholds, selected,
        q.stride(0), q.stride(1),
        queries.stride(0), queries.stride(1),
        selected.stride(0), selected.stride(1),
        num_extra,
        GROUP=group, HEAD_DIM=head_dim, BLOCK=next_pow2(group * head_dim), BUDGET=budget_pages,
        BLOCK_E=next_pow2(num_extra), USE_PDL=use_pdl(q.device),
        num_warps=_NUM_WARPS, launch_pdl=use_pdl(q.device),
    )
    return active
