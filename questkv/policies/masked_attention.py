"""Token-level decode attention over a paged cache: the reference for token-granular policies.

Page-granular policies attend through :func:`questkv.ops.reference.paged_decode_attention`. Policies
that keep or drop single tokens (StreamingLLM, H2O, TOVA) and the page oracle (which needs the true
attention probabilities) use :func:`masked_decode_attention` instead. Layouts are those of
:mod:`questkv.ops.reference`; in addition:

* token positions are logical: position ``t`` of sequence ``b`` lives in slot ``t % page_size`` of
  logical page ``t // page_size`` (``page_table[b, t // page_size]``); a batch spans
  ``max_tokens = max_pages * page_size`` positions.
* ``keep``: ``[batch, num_kv_heads, max_tokens]`` bool, the positions each KV head (and so its whole
  query group) may attend. Positions at or past ``seq_lens[b]`` are never attended, whatever
  ``keep`` says.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch


class MaskedAttention(NamedTuple):
    """Result of :func:`masked_decode_attention`.

    out: ``[batch, num_q_heads, head_dim]`` in ``q``'s dtype.
    probs: ``[batch, num_q_heads, max_tokens]`` float32 softmax probabilities (exactly 0 at masked
        positions; every row sums to 1), or ``None`` unless requested.
    """

    out: torch.Tensor
    probs: Optional[torch.Tensor]


def token_positions(seq_lens: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """``[batch, max_tokens]`` bool: positions holding a token (``t < seq_lens[b]``)."""
    index = torch.arange(max_tokens, device=seq_lens.device)[None, :]
    return index < seq_lens.long()[:, None]


def masked_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    keep: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
    return_probs: bool = False,
) -> MaskedAttention:
    """Decode attention of one query per sequence over a per-KV-head subset of its tokens.

    Args:
        q: ``[batch, num_q_heads, head_dim]``; query head ``h`` reads KV head
            ``h // (num_q_heads // num_kv_heads)``.
        k_pages, v_pages: ``[num_pages, page_size, num_kv_heads, head_dim]``.
        page_table: ``[batch, max_pages]`` int32. seq_lens: ``[batch]`` int32, each >= 1.
        keep: ``[batch, num_kv_heads, max_pages * page_size]`` bool, or ``None`` for every token.
            Every (sequence, KV head) must keep at least one position below its length.
        sm_scale: softmax scale, default ``1 / sqrt(head_dim)``.
        return_probs: also return the softmax probabilities.

    Returns:
        :class:`MaskedAttention`. Logits, softmax and accumulation run in float32; slots not
        attended never reach the result (NaN there does not propagate).
    """
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    max_tokens = page_table.shape[1] * page_size
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    valid = token_positions(seq_lens, max_tokens)[:, None, :]  # [B, 1, T]
    if keep is not None:
        if tuple(keep.shape) != (batch, num_kv_heads, max_tokens):
            raise ValueError(
                f"keep must have shape {(batch, num_kv_heads, max_tokens)} (batch, num_kv_heads, "
                f"max_pages * page_size), got {tuple(keep.shape)}"
            )
        valid = valid & keep
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    group = num_q_heads // num_kv_heads
    table = page_table.long()
    k = k_pages[table].flatten(1, 2).transpose(1, 2)  # [B, Hkv, T, D]
    v = v_pages[table].flatten(1, 2).transpose(1, 2)
    valid = valid.expand(batch, num_kv_heads, max_tokens)
    k = torch.where(valid[..., None], k.float(), 0.0)
    v = torch.where(valid[..., None], v.float(), 0.0)
    qg = q.float().view(batch, num_kv_heads, group, head_dim)
    logits = torch.einsum("bhgd,bhtd->bhgt", qg, k) * sm_scale
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhgt,bhtd->bhgd", probs, v).reshape(batch, num_q_heads, head_dim).to(q.dtype)
    return MaskedAttention(out, probs.reshape(batch, num_q_heads, max_tokens) if return_probs else None)
