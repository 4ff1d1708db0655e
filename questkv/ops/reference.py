"""Torch reference of every Quest op: clear, device-agnostic, the oracle for the kernels.

Layouts shared by all ops (FlashInfer's "NHD" page layout):

* ``k_pages``, ``v_pages``: ``[num_pages, page_size, num_kv_heads, head_dim]``, any float dtype.
* ``kmin``, ``kmax``: ``[num_pages, num_kv_heads, head_dim]``, same dtype as ``k_pages`` (float8 e4m3 too): the
  element-wise min / max over the stored keys of each page. Min and max select one of their inputs, so storing them
  in the keys' dtype is exact and the bound property is never lost.
* ``page_table``: ``[batch, max_pages]`` int32, row ``b`` lists the physical pages of sequence
  ``b`` in order; entries at or past ``ceil(seq_lens[b] / page_size)`` are padding and never read.
* ``seq_lens``: ``[batch]`` int32, tokens in each sequence (>= 1 for attention ops), the current
  decode token included.
* ``q``: ``[batch, num_q_heads, head_dim]``, one decode query per sequence (or the decode attention's
  ``[batch, num_queries, num_q_heads, head_dim]``, a lossless verify step's last positions); ``num_q_heads`` is a
  multiple of ``num_kv_heads`` and query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)``.
  Prefill (:func:`paged_prefill_attention`) takes a flat batch of new tokens instead, ``[num_tokens,
  num_q_heads, head_dim]``, with ``query_starts`` ``[batch + 1]`` int32: sequence ``b``'s tokens are rows
  ``[query_starts[b], query_starts[b + 1])``.
* Page selections are *logical* page indices (positions in a page-table row), ``[batch,
  num_sel_heads, k]`` int32 sorted ascending with ``-1`` padding at the end; ``num_sel_heads`` is
  ``num_kv_heads`` (one set per KV head, shared by its query group) or ``num_q_heads``.
* ``budgets``: ``[batch]`` int32 token budget of each sequence (a multiple of ``page_size``, at most
  ``budget_pages * page_size`` and at least the forced pages plus the current one); ``None`` gives every
  sequence ``budget_pages``. Callers validate the values on the host (the ops never synchronise).
* ``active``: contiguous ``[batch]`` int32 flags of :func:`page_scores_into` and :func:`select_pages_into`, one
  per sequence (selection reuse: a sequence re-estimates and re-selects only every ``selection_interval``-th
  step), or ``None`` for every sequence. A sequence whose flag is 0 leaves all its rows of ``out`` untouched; the
  flags are read on the device, so one CUDA graph serves every pattern (:func:`questkv.ops.checks.check_active`).

The estimate, the selection and the decode attention also have an ``*_into`` form writing into preallocated
outputs, with the same signature as the Triton kernels' (:mod:`questkv.ops.triton`), so
:class:`questkv.decode.QuestDecodeStep` calls either backend the same way; :func:`attention_buffers` and
:func:`select_buffers` give the (empty) scratch the kernels' forms take. The types the ops take and return live in
:mod:`questkv.ops.pages`, the argument checks they share with the kernels in :mod:`questkv.ops.checks`.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from questkv.ops.checks import (
    check_active,
    check_mode,
    check_prefill_attention,
    check_row_budgets,
    check_select_out,
)
from questkv.ops.fp8_codes import widen_fp8_bounds
from questkv.ops.pages import AttentionBuffers, SelectBuffers


def to_pool_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a pool of ``dtype`` stores it: cast, and to e4m3 rounded to nearest even and saturated at ±448 (as the
    Triton append rounds). The clamp is not a no-op: torch's own cast gives NaN from ±464 on in some versions (2.11
    on the GPU machine) and saturates in others (2.13)."""
    if dtype == torch.float8_e4m3fn:
        fp8_max = torch.finfo(dtype).max  # 448
        return x.clamp(-fp8_max, fp8_max).to(dtype)
    return x.to(dtype)


def append_kv(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    slots: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Write tokens into the page pool and update the touched pages' key bounds, in place.

    Args:
        k_pages, v_pages: ``[num_pages, page_size, num_kv_heads, head_dim]``, the model's dtype or
            ``torch.float8_e4m3fn`` (an fp8 cache: values are cast, rounding to nearest even, saturating at ±448).
        kmin, kmax: ``[num_pages, num_kv_heads, head_dim]``, ``k_pages``' dtype.
        slots: ``[num_tokens]`` integer, ``page * page_size + offset`` of every new token; slots are
            distinct, and a page's slots are written in order (offset 0 starts a page).
        keys, values: ``[num_tokens, num_kv_heads, head_dim]``; cast to the pool's dtype.

    A token written at offset 0 starts its page: that page's bounds restart from the new keys, so a
    reused page never keeps bounds of its previous owner. Other tokens widen the existing bounds. The bounds are
    taken from the keys as stored (fp8 ones too, exactly), so they bound what attention multiplies. Fixed shapes and
    no host synchronisation: the op runs under a CUDA graph too.
    """
    page_size = k_pages.shape[1]
    slots = slots.long()
    pages = slots // page_size
    offsets = slots % page_size
    stored = to_pool_dtype(keys, k_pages.dtype)
    k_pages[pages, offsets] = stored
    v_pages[pages, offsets] = to_pool_dtype(values, v_pages.dtype)
    # Each slot's page starts from its old bounds, or from nothing when the step writes the page's first token.
    restart = torch.zeros(kmin.shape[0], dtype=torch.int8, device=kmin.device)
    restart = restart.scatter_reduce(0, pages, (offsets == 0).to(torch.int8), reduce="amax")[pages].bool()
    restart = restart[:, None, None]
    index = pages[:, None, None].expand_as(stored)
    if kmin.dtype == torch.float8_e4m3fn:
        widen_fp8_bounds(kmin, kmax, pages, index, restart, stored)
        return
    low = torch.minimum(torch.where(restart, float("inf"), kmin[pages]), stored)
    high = torch.maximum(torch.where(restart, float("-inf"), kmax[pages]), stored)
    kmin.scatter_reduce_(0, index, low, reduce="amin", include_self=False)
    kmax.scatter_reduce_(0, index, high, reduce="amax", include_self=False)


def recompute_key_bounds(
    k_pages: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor, counts: torch.Tensor
) -> None:
    """Set the key bounds of ``pages`` to the min / max of their first ``counts`` keys, in place, in every layer:
    what a page's bounds are after keys were overwritten or dropped (a lossless verify step), equal to appending
    the kept keys from scratch.

    Args:
        k_pages: ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]``.
        kmin, kmax: ``[num_layers, num_pages, num_kv_heads, head_dim]``, ``k_pages``' dtype.
        pages: ``[n]`` int64 distinct physical pages.
        counts: ``[n]`` int64 in ``[1, page_size]``, the keys each page holds.
    """
    page_size = k_pages.shape[2]
    keys = k_pages[:, pages]  # [L, n, page_size, H, D]
    keys = keys.float() if keys.element_size() == 1 else keys  # (no float8 reduction in torch; exact)
    dropped = (torch.arange(page_size, device=counts.device)[None, :] >= counts[:, None])[None, :, :, None, None]
    kmin[:, pages] = keys.masked_fill(dropped, float("inf")).amin(dim=2).to(kmin.dtype)  # exact: a stored key
    kmax[:, pages] = keys.masked_fill(dropped, float("-inf")).amax(dim=2).to(kmax.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[T, H, D]`` by ``cos``, ``sin`` ``[T, D // 2]`` (``x``'s dtype):
    each pair of halves ``(x1, x2)`` becomes ``(x1 cos - x2 sin, x2 cos + x1 sin)``, every product, sum and
    difference rounded to the dtype as eager torch rounds it (transformers' ``q * cos + rotate_half(q) * sin``
    to the bit). Returns a new tensor."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D/2]
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_append_kv(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    slots: torch.Tensor,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Rotate a step's queries and keys by their positions (:func:`rotate`) in place, then :func:`append_kv` the
    rotated keys and the values.

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]``, rotated in place.
        keys: ``[num_tokens, num_kv_heads, head_dim]``, rotated in place (then stored).
        values: ``[num_tokens, num_kv_heads, head_dim]``.
        cos, sin: ``[num_tokens, head_dim // 2]`` in ``q``'s dtype, the tokens' rows of the rotary table.
        Others as in :func:`append_kv`.
    """
    q.copy_(rotate(q, cos, sin))
    keys.copy_(rotate(keys, cos, sin))
    append_kv(k_pages, v_pages, kmin, kmax, slots, keys, values)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """RMSNorm as the Llama family computes it (transformers' ``LlamaRMSNorm``), with an optional residual add.

    With ``residual`` (``x``'s shape and dtype), first ``x = x + residual`` in ``x``'s dtype, as a decoder layer adds
    its residual stream. Then ``weight * (x / sqrt(mean(x^2) + eps))`` over the last dimension, normalised in float32
    and cast back to ``x``'s dtype before the weight.

    Args:
        x: ``[..., H]`` float. weight: ``[H]``. eps: added to the mean square.

    Returns:
        ``normed`` (``x``'s shape, the dtype of ``weight * x``), or ``(normed, x + residual)`` with ``residual``.
    """
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * h.to(dtype)
    return normed if residual is None else (normed, x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The Llama-family MLP's gated activation: ``silu(gate) * up`` where ``x = cat(gate, up)`` along the last
    dimension, ``[..., 2 * I]`` → ``[..., I]`` in ``x``'s dtype (each result rounded to it, as eager torch rounds)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y = x @ weight.T + bias`` (``F.linear``).

    Args:
        x: ``[M, K]``, any float dtype.
        weight: ``[N, K]`` in ``x``'s dtype (``nn.Linear``'s layout). bias: ``[N]`` or ``None``.

    Returns:
        ``[M, N]`` in ``x``'s dtype.
    """
    return F.linear(x, weight, bias)


def page_scores(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    selection: str = "kv_head",
    group_reduction: str = "sum",
) -> torch.Tensor:
    """Quest criticality of every page: ``sum_i max(q_i * kmin_i, q_i * kmax_i)``.

    For every query head the score is an upper bound of ``q . k`` over the keys of the page.

    Args:
        q: ``[batch, num_q_heads, head_dim]``.
        kmin, kmax: ``[num_pages, num_kv_heads, head_dim]``.
        page_table: ``[batch, max_pages]`` int32. seq_lens: ``[batch]`` int32.
        selection: ``"q_head"`` scores per query head; ``"kv_head"`` combines each KV head's
            query group with ``group_reduction`` (``"sum"`` or ``"max"``).

    Returns:
        ``[batch, num_sel_heads, max_pages]`` float32; pages past a sequence's length are ``-inf``.
    """
    check_mode(selection, group_reduction)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = kmin.shape[1]
    group = num_q_heads // num_kv_heads
    table = page_table.long()
    lo = kmin[table].float()  # [B, P, Hkv, D]
    hi = kmax[table].float()
    qg = q.float().view(batch, 1, num_kv_heads, group, head_dim)
    per_q = torch.maximum(qg * lo[:, :, :, None], qg * hi[:, :, :, None]).sum(-1)  # [B, P, Hkv, G]
    if selection == "q_head":
        scores = per_q.reshape(batch, -1, num_q_heads).transpose(1, 2)
    elif group_reduction == "sum":
        scores = per_q.sum(-1).transpose(1, 2)
    else:
        scores = per_q.amax(-1).transpose(1, 2)
    valid = valid_pages(seq_lens, page_size, page_table.shape[1])
    return scores.masked_fill(~valid[:, None, :], float("-inf")).contiguous()


def select_pages(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    budget_pages: int,
    sink_pages: int = 0,
    recent_pages: int = 0,
    budgets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Top-``budget_pages`` pages per (sequence, head), with always-kept pages forced in.

    Forced pages: the first ``sink_pages``, the ``recent_pages`` full pages before the current one,
    and the current (last) page. The rest of the budget goes to the highest-scoring pages; ties go
    to the lower page index. A sequence with no more pages than its budget gets all of them.

    Args:
        scores: ``[batch, num_sel_heads, max_pages]`` float32 from :func:`page_scores`.
        seq_lens: ``[batch]`` int32.
        budget_pages: pages per row of the output (the largest budget).
        budgets: ``[batch]`` int32 token budgets (see the module docstring), or ``None``: row ``b``
            selects ``budgets[b] // page_size`` pages.

    Returns:
        ``[batch, num_sel_heads, budget_pages]`` int32 logical page indices, ascending, ``-1``-padded.
    """
    batch, heads, max_pages = scores.shape
    valid = valid_pages(seq_lens, page_size, max_pages)
    forced = valid & forced_page_mask(seq_lens, page_size, max_pages, sink_pages, recent_pages)
    key = scores.masked_fill(forced[:, None, :], float("inf"))
    # Invalid pages sort after every valid one, even a valid page scored -inf.
    rank = torch.stack([valid[:, None, :].expand_as(key).float(), key], dim=-1)
    order = _lexsort_desc(rank)[..., :budget_pages]
    keep = valid[:, None, :].expand(batch, heads, max_pages).gather(-1, order)
    if budgets is not None:
        row_pages = (budgets.long() // page_size)[:, None, None]
        keep = keep & (torch.arange(order.shape[-1], device=scores.device) < row_pages)
    chosen = torch.where(keep, order, max_pages)
    chosen = chosen.sort(dim=-1).values
    chosen = torch.where(chosen == max_pages, -1, chosen)
    if chosen.shape[-1] < budget_pages:
        pad = chosen.new_full((batch, heads, budget_pages - chosen.shape[-1]), -1)
        chosen = torch.cat([chosen, pad], dim=-1)
    return chosen.to(torch.int32)


def attention_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype the reference attention ops score and accumulate in: float32, or ``q``'s when it is wider
    (float64), so that on a float64 model both prefill paths (:func:`paged_prefill_attention` and the SDPA of
    ``Attention._causal_prefill``) and the decode step round alike, and a key of an fp8 pool lands on the same
    e4m3 value whichever path computed it."""
    return torch.promote_types(q.dtype, torch.float32)


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    selected: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
    budgets: Optional[torch.Tensor] = None,
    selection_cols: Optional[int] = None,
) -> torch.Tensor:
    """Decode attention of each sequence's last query, or its last few, over a set of its pages.

    Args:
        q: ``[batch, num_q_heads, head_dim]``, the query of position ``seq_lens - 1``; or ``[batch, num_queries,
            num_q_heads, head_dim]``, the queries of the last ``num_queries`` positions (a lossless verify step),
            each attending the keys up to its own position (causal among them; ``seq_lens >= num_queries``).
        k_pages, v_pages: ``[num_pages, page_size, num_kv_heads, head_dim]``.
        page_table: ``[batch, max_pages]`` int32. seq_lens: ``[batch]`` int32, each >= 1.
        selected: ``[batch, num_kv_heads or num_q_heads, k]`` int32 logical pages (``-1`` = none),
            or ``None`` for every page of the sequence (dense paged decode).
        sm_scale: softmax scale, default ``1 / sqrt(head_dim)``.
        budgets: with ``selected``, ``[batch]`` int32 token budgets of the rows (a request's below the step's): of
            the first ``selection_cols`` columns of row ``b`` (default: every column) only the first
            ``budgets[b] // page_size`` are read, the columns after them always (a reused selection's extra
            columns). ``None``: every column. The kernel then spreads each row's columns over all its splits.

    Returns:
        ``q``'s shape and dtype. Softmax and accumulation run in :func:`attention_dtype`. Slots past ``seq_lens``
        and pages not selected are never read into the result (NaN there does not propagate).
    """
    selection_cols = check_row_budgets(selected, budgets, selection_cols, q.shape[0])
    if budgets is not None:  # the columns a row's budget leaves out: no page
        column = torch.arange(selected.shape[-1], device=selected.device)
        skipped = (column >= (budgets.long() // k_pages.shape[1])[:, None]) & (column < selection_cols)
        selected = selected.masked_fill(skipped[:, None, :], -1)
    logits, v = _decode_logits(q, k_pages, v_pages, page_table, seq_lens, selected, sm_scale)
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhqgt,bhtd->bqhgd", probs, v)
    return out.reshape(q.shape).to(q.dtype)


def _decode_logits(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    selected: Optional[torch.Tensor],
    sm_scale: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_decode_attention`'s scaled scores ``[batch, num_sel_heads, num_queries, group, k * page_size]``
    (``-inf`` where a query does not see the key: unselected, past the sequence or past the query) and the values
    ``[batch, num_sel_heads, k * page_size, head_dim]`` they weigh (``k``: selected pages, or the page table's
    width), both in :func:`attention_dtype`."""
    queries = q[:, None] if q.dim() == 3 else q
    batch, num_queries, num_q_heads, head_dim = queries.shape
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if selected is None:
        pages = torch.arange(page_table.shape[1], device=q.device, dtype=torch.long)
        selected = pages.expand(batch, num_kv_heads, -1)
    selected = selected.long()
    sel_heads = selected.shape[1]
    group = num_q_heads // sel_heads  # query heads sharing one page set
    kv_head = torch.arange(sel_heads, device=q.device) // (sel_heads // num_kv_heads)
    physical = page_table.long().gather(1, selected.clamp(min=0).flatten(1)).view_as(selected)
    offsets = torch.arange(page_size, device=q.device)
    k = k_pages[physical[..., None], offsets, kv_head[None, :, None, None]]  # [B, Hs, K, ps, D]
    v = v_pages[physical[..., None], offsets, kv_head[None, :, None, None]]
    position = selected[..., None] * page_size + offsets  # [B, Hs, K, ps]
    valid = (selected[..., None] >= 0) & (position < seq_lens.long()[:, None, None, None])
    dtype = attention_dtype(q)
    k = torch.where(valid[..., None], k.to(dtype), 0.0).flatten(2, 3)  # [B, Hs, K*ps, D]
    v = torch.where(valid[..., None], v.to(dtype), 0.0).flatten(2, 3)
    query_position = seq_lens.long()[:, None] - num_queries + torch.arange(num_queries, device=q.device)  # [B, Q]
    seen = valid.flatten(2)[:, :, None] & (position.flatten(2)[:, :, None] <= query_position[:, None, :, None])
    qg = queries.to(dtype).view(batch, num_queries, sel_heads, group, head_dim)
    logits = torch.einsum("bqhgd,bhtd->bhqgt", qg, k) * sm_scale
    return logits.masked_fill(~seen[:, :, :, None, :], float("-inf")), v  # seen: [B, Hs, Q, K*ps]


def paged_prefill_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    query_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: Optional[int] = None,
    sm_scale: Optional[float] = None,
) -> torch.Tensor:
    """Causal prefill attention of a flat batch of new tokens over their sequences' pages.

    Sequence ``i`` brings ``n_i = query_starts[i + 1] - query_starts[i]`` new tokens, rows
    ``[query_starts[i], query_starts[i + 1])`` of ``q``, and holds ``seq_lens[i]`` tokens in the pool with
    them (its cached tokens, then the new ones, whose K/V are already written). New token ``t`` sits at
    position ``seq_lens[i] - n_i + t`` and attends keys ``0 ..`` that position (causal, aligned at the
    bottom right), all read through ``page_table[i]``; a query head reads KV head ``h // group``.

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]``, post-RoPE queries.
        k_pages, v_pages: ``[num_pages, page_size, num_kv_heads, head_dim]``, one float dtype.
        page_table: ``[batch, max_pages]`` int32. seq_lens: ``[batch]`` int32, ``>= n_i``.
        query_starts: ``[batch + 1]`` int32, ``0`` first, non-decreasing, ``num_tokens`` last.
        max_query_len: an upper bound of every ``n_i`` (the kernel's grid; host int), or ``None``.
        sm_scale: softmax scale, default ``1 / sqrt(head_dim)``.

    Returns:
        ``[num_tokens, num_q_heads, head_dim]`` in ``q``'s dtype; softmax and accumulation in :func:`attention_dtype`.
        Slots past ``seq_lens`` are never read into the result.
    """
    check_prefill_attention(q, k_pages, v_pages, page_table, query_starts, seq_lens)
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = num_q_heads // num_kv_heads
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    starts, lens = query_starts.tolist(), seq_lens.tolist()
    news = [end - begin for begin, end in zip(starts[:-1], starts[1:])]
    if starts[0] != 0 or starts[-1] != num_tokens or min(news, default=0) < 0:
        raise ValueError(f"query_starts must rise from 0 to num_tokens={num_tokens}, got {starts}")
    if any(n > length for n, length in zip(news, lens)):
        raise ValueError(f"every sequence must hold its new tokens: new {news}, seq_lens {lens}")
    if max_query_len is not None and max(news, default=0) > max_query_len:
        raise ValueError(f"max_query_len={max_query_len} is below the longest query, {max(news)} tokens")
    out, dtype = torch.empty_like(q), attention_dtype(q)
    for row, (begin, n, seq_len) in enumerate(zip(starts, news, lens)):
        if n == 0:
            continue
        pages = page_table[row, :-(-seq_len // page_size)].long()  # [ceil(L / page_size)]
        k = k_pages[pages].flatten(0, 1)[:seq_len].to(dtype).transpose(0, 1)[None]  # [1, Hkv, L, D]
        v = v_pages[pages].flatten(0, 1)[:seq_len].to(dtype).transpose(0, 1)[None]
        qs = q[begin:begin + n].to(dtype).transpose(0, 1)[None]  # [1, Hq, n, D]
        # SDPA with native GQA, as the prefill without cached tokens calls it on a CPU (Attention._causal_prefill):
        # both prefill paths share their arithmetic, and no copy of the context is expanded per query head.
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=causal_lower_right(n, seq_len), scale=sm_scale,
                                           enable_gqa=group > 1)
        out[begin:begin + n] = o[0].transpose(0, 1).to(q.dtype)
    return out


def num_pages(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pages holding each sequence: ``ceil(seq_lens / page_size)``, ``[batch]`` int64."""
    return (seq_lens.long() + page_size - 1) // page_size


def valid_pages(seq_lens: torch.Tensor, page_size: int, max_pages: int) -> torch.Tensor:
    """``[batch, max_pages]`` bool: page-table column ``j`` holds a page of sequence ``b``."""
    index = torch.arange(max_pages, device=seq_lens.device)[None, :]
    return index < num_pages(seq_lens, page_size)[:, None]


def forced_page_mask(
    seq_lens: torch.Tensor, page_size: int, max_pages: int, sink_pages: int, recent_pages: int
) -> torch.Tensor:
    """``[batch, max_pages]`` bool: the always-attended pages of each sequence — the first
    ``sink_pages``, the ``recent_pages`` full pages before the current one, and the current (last)
    page. Columns past a sequence's pages may be set too: combine with :func:`valid_pages`."""
    index = torch.arange(max_pages, device=seq_lens.device)[None, :]
    return (index < sink_pages) | (index >= num_pages(seq_lens, page_size)[:, None] - 1 - recent_pages)


def attention_buffers(
    batch: int,
    num_q_heads: int,
    num_sel_heads: int,
    head_dim: int,
    num_items: int,
    page_size: int,
    dense: bool,
    device: torch.device,
    num_splits: Optional[int] = None,
    num_queries: int = 1,
    kv_dtype: Optional[torch.dtype] = None,
) -> AttentionBuffers:
    """The reference attention needs no scratch: an empty :class:`AttentionBuffers`."""
    return AttentionBuffers()


def select_buffers(
    batch: int,
    num_sel_heads: int,
    max_pages: int,
    device: torch.device,
    chunk_pages: Optional[int] = None,
    digit_bits: Optional[int] = None,
) -> SelectBuffers:
    """The reference selection needs no scratch: an empty :class:`SelectBuffers`."""
    return SelectBuffers()


def page_scores_into(
    out: torch.Tensor,
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    selection: str = "kv_head",
    group_reduction: str = "sum",
    active: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`page_scores` into ``out`` ``[batch, num_sel_heads, max_pages]`` float32; returns ``out``.

    ``active``: ``None`` (every sequence) or contiguous ``[batch]`` int32 on ``out``'s device (:func:`check_active`);
    a sequence whose flag is 0 leaves its rows of ``out`` untouched. Every row is computed and the active ones
    copied, with no host synchronisation."""
    if active is not None:
        check_active(active, out.shape[0], out.device)
    scores = page_scores(q, kmin, kmax, page_table, seq_lens, page_size, selection, group_reduction)
    return out.copy_(scores if active is None else _where_active(active, scores, out))


def select_pages_into(
    out: torch.Tensor,
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    budget_pages: int,
    sink_pages: int = 0,
    recent_pages: int = 0,
    budgets: Optional[torch.Tensor] = None,
    buffers: Optional[SelectBuffers] = None,
    split: Optional[bool] = None,
    active: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`select_pages` into columns ``[0, budget_pages)`` of ``out`` ``[batch, num_sel_heads, width]``
    int32 (``width >= budget_pages``; the columns past ``budget_pages`` are never touched); ``buffers``
    and ``split`` (the kernel's scratch and path) are unused here. Returns ``out``.

    ``active``: ``None`` (every sequence) or contiguous ``[batch]`` int32 on ``out``'s device (:func:`check_active`);
    a sequence whose flag is 0 leaves its rows of ``out`` untouched (no host synchronisation)."""
    batch, heads, _ = scores.shape
    check_select_out(out, batch, heads, budget_pages)
    if active is not None:
        check_active(active, batch, out.device)
    chosen = select_pages(scores, seq_lens, page_size, budget_pages, sink_pages, recent_pages, budgets)
    columns = out[..., :budget_pages]  # a view: copying into it writes out
    columns.copy_(chosen if active is None else _where_active(active, chosen, columns))
    return out


def paged_decode_attention_into(
    out: torch.Tensor,
    buffers: AttentionBuffers,
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    selected: Optional[torch.Tensor],
    sm_scale: Optional[float] = None,
    budgets: Optional[torch.Tensor] = None,
    selection_cols: Optional[int] = None,
) -> torch.Tensor:
    """:func:`paged_decode_attention` into ``out`` (``q``'s shape); ``buffers`` is unused here (the kernel's
    scratch). Returns ``out``."""
    return out.copy_(paged_decode_attention(q, k_pages, v_pages, page_table, seq_lens, selected, sm_scale, budgets,
                                            selection_cols))


def _lexsort_desc(rank: torch.Tensor) -> torch.Tensor:
    """Indices sorting the last-but-one dim by ``rank[..., 0]`` then ``rank[..., 1]``, descending, stable."""
    order = rank[..., 1].argsort(dim=-1, descending=True, stable=True)
    primary = rank[..., 0].gather(-1, order)
    return order.gather(-1, primary.argsort(dim=-1, descending=True, stable=True))


def _where_active(active: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` ``[batch, num_sel_heads, width]`` in the rows of the sequences whose ``active`` flag (``[batch]``)
    is nonzero, ``old`` elsewhere (no host synchronisation)."""
    return torch.where(active[:, None, None] != 0, new, old)
