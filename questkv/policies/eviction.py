"""Eviction policies: a per-sequence, per-KV-head set of kept tokens that only ever loses tokens.

Every policy here is ``(sink_tokens, recent_tokens, ranking)``: the first ``sink_tokens`` positions
and the ``recent_tokens`` most recent ones (the current token included) are protected; the rest of
the budget goes to the kept tokens that rank highest:

* ``streaming`` (StreamingLLM): ranking by position, so exactly the sinks plus the recent window;
* ``h2o`` (heavy hitters): ranking by the attention each token has accumulated over the decode
  steps (optionally seeded with the prefill's), plus a recent window;
* ``tova``: ranking by the current step's attention only (the current token is its only protection).

Attention probabilities of a query group are summed per KV head (one keep set per KV head).

One decode step, with ``B = token_budget`` (see :meth:`EvictionPolicy.decode`):

1. the current token joins the kept set;
2. if a row keeps more than ``B`` tokens (only after a dense prefill), it is cut to ``B`` by the
   policy's rule, ranking with the current query's attention over the kept set (a scoring pass that
   never reaches the output);
3. the query attends the kept set (at most ``B`` tokens: the budget charged);
4. the set is cut to ``B - 1`` with that step's attention, leaving room for the next token.

Dropped tokens are gone for good: their K/V stay in the paged pool (this is an accuracy reference,
not a memory saving), but no later step attends them.

H2O can be seeded with the prefill's attention: :func:`prefill_attention` computes it from a dense
prefill's queries and keys (the HF drop-in calls it on every layer of a prefill when the policy's
``uses_prefill_attention`` is set), and :meth:`H2OPolicy.init_state` takes it as ``prefill_scores``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Optional

import torch

from questkv.policies.base import DecodeOutput, DecodePolicy
from questkv.policies.masked_attention import masked_decode_attention, token_positions

# Prefill queries per chunk of :func:`prefill_attention`: bounds its ``[B, Hkv, G, chunk, T]`` float32 logits.
PREFILL_QUERY_CHUNK = 256


@dataclasses.dataclass
class EvictionState:
    """One layer's kept tokens.

    Attributes:
        keep: ``[batch, num_kv_heads, max_tokens]`` bool, kept positions (all below ``lengths``).
        lengths: ``[batch]`` int32, tokens seen so far per sequence.
        scores: ``[batch, num_kv_heads, max_tokens]`` float32 accumulated attention (``h2o``), else
            ``None``.
    """

    keep: torch.Tensor
    lengths: torch.Tensor
    scores: Optional[torch.Tensor] = None

    def _resize(self, max_tokens: int) -> None:
        """Pad (or trim, past every sequence's end) the token axis to ``max_tokens``."""
        have = self.keep.shape[-1]
        if have >= max_tokens:
            self.keep = self.keep[..., :max_tokens]
            self.scores = None if self.scores is None else self.scores[..., :max_tokens]
            return
        pad = (0, max_tokens - have)
        self.keep = torch.nn.functional.pad(self.keep, pad, value=False)
        self.scores = None if self.scores is None else torch.nn.functional.pad(self.scores, pad, value=0.0)


@torch.no_grad()
def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    query_mask: torch.Tensor,
    scaling: Optional[float] = None,
    query_chunk: int = PREFILL_QUERY_CHUNK,
) -> torch.Tensor:
    """The attention every key position receives from one prefill forward's queries, summed over
    the real queries and each KV head's query group: H2O's ``prefill_scores`` (see
    :meth:`H2OPolicy.init_state`). Softmax in float32, ``query_chunk`` queries at a time.

    Args:
        query: ``[batch, num_q_heads, new_positions, head_dim]``, post-RoPE.
        key: ``[batch, num_kv_heads, positions, head_dim]``, post-RoPE, every position so far (the
            ``new_positions`` new ones last), as the forward's attention reads them.
        attention_mask: ``[batch, 1, new_positions, positions]`` bool (True = attend), or ``None``
            for plain causal attention.
        query_mask: ``[batch, new_positions]`` bool, False for padding queries (they add nothing).
        scaling: softmax scale, default ``1 / sqrt(head_dim)``.

    Returns:
        ``[batch, num_kv_heads, positions]`` float32 (pads included: a caller that stores only the
        real tokens drops the pad positions itself).
    """
    batch, num_q_heads, new_positions, head_dim = query.shape
    num_kv_heads, positions = key.shape[1], key.shape[2]
    scale = head_dim**-0.5 if scaling is None else scaling
    group = num_q_heads // num_kv_heads
    keys = key.float()[:, :, None]  # [B, Hkv, 1, T, D]
    total = key.new_zeros(batch, num_kv_heads, positions, dtype=torch.float32)
    for start in range(0, new_positions, query_chunk):
        stop = min(start + query_chunk, new_positions)
        q = query[:, :, start:stop].float().view(batch, num_kv_heads, group, stop - start, head_dim)
        logits = (q @ keys.transpose(-1, -2)) * scale  # [B, Hkv, G, n, T]
        if attention_mask is None:
            row = torch.arange(start, stop, device=key.device)[:, None] + positions - new_positions
            allowed = (torch.arange(positions, device=key.device)[None, :] <= row)[None]  # [1, n, T]
        else:
            allowed = attention_mask[:, 0, start:stop].bool()  # [B, n, T]
        allowed = allowed & query_mask[:, start:stop, None]
        logits = logits.masked_fill(~allowed[:, None, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows of pad queries are all -inf
        total += probs.sum(dim=(2, 3))
    return total


def _check_int(policy: str, name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"policy {policy!r}: {name} must be an int >= {minimum}, got {value!r}")
    return value


class EvictionPolicy(DecodePolicy):
    """Base of the eviction policies (see the module docstring).

    Args:
        token_budget: ``B``, tokens attended per (sequence, KV head) and step, current token included.
        page_size: tokens per page of the cache read; it does not constrain ``B``.

    Subclasses set ``sink_tokens`` and ``recent_tokens`` (``sink_tokens + recent_tokens <= B``,
    ``recent_tokens >= 1``) and implement :meth:`_ranking`.
    """

    needs_attention: bool = True  # whether the ranking reads attention probabilities

    def __init__(self, token_budget: int, page_size: int = 16) -> None:
        _check_int(self.name, "token_budget", token_budget, 1)
        _check_int(self.name, "page_size", page_size, 1)
        super().__init__(token_budget, page_size)
        self.sink_tokens = 0
        self.recent_tokens = 1

    def init_state(self, seq_lens: torch.Tensor, num_kv_heads: int, **kwargs) -> EvictionState:
        """State after a dense prefill of ``seq_lens`` ``[batch]`` int32 tokens: all of them kept
        (the first :meth:`decode` cuts them to the budget)."""
        super().init_state(seq_lens, num_kv_heads, **kwargs)
        return self._prefilled(seq_lens, num_kv_heads, None)

    def _prefilled(self, seq_lens: torch.Tensor, num_kv_heads: int, scores: Optional[torch.Tensor]) -> EvictionState:
        max_tokens = int(seq_lens.max()) if seq_lens.numel() else 0
        keep = token_positions(seq_lens, max_tokens)[:, None, :].expand(-1, num_kv_heads, -1).clone()
        return EvictionState(keep, seq_lens.to(torch.int32).clone(), scores)

    @abc.abstractmethod
    def _ranking(self, state: EvictionState, probs: Optional[torch.Tensor]) -> torch.Tensor:
        """``[batch, num_kv_heads, max_tokens]`` float, >= 0: higher is kept first. ``probs`` is the
        group-summed attention of the step's query (``None`` when ``needs_attention`` is False)."""

    def _observe(self, state: EvictionState, probs: torch.Tensor) -> None:
        """Record the attention of a decode step (after its eviction)."""

    def _evict(self, keep: torch.Tensor, ranking: torch.Tensor, seq_lens: torch.Tensor, target: int, reserve: int) -> torch.Tensor:
        """Cut every row of ``keep`` to at most ``target`` positions: protected ones first (sinks and
        the recent window, shifted by the ``reserve`` tokens still to come), then by ``ranking``
        descending, ties to the lower position."""
        position = torch.arange(keep.shape[-1], device=keep.device)
        window_start = seq_lens.long()[:, None, None] + reserve - self.recent_tokens
        protected = keep & ((position < self.sink_tokens) | (position >= window_start))
        key = torch.where(keep, ranking.float(), -1.0).masked_fill(protected, float("inf"))
        rank = key.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        return keep & (rank < target)

    def _group_attention(self, probs: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        batch, num_q_heads, max_tokens = probs.shape
        return probs.view(batch, num_kv_heads, num_q_heads // num_kv_heads, max_tokens).sum(2)

    def decode(self, q, layer, page_table, seq_lens, state=None, sm_scale=None) -> DecodeOutput:
        """One decode step (see the module docstring); ``state`` from :meth:`init_state`, updated in
        place. ``seq_lens`` must be the state's lengths plus one: one new token per sequence.

        Returns:
            :class:`DecodeOutput` with ``tokens_attended`` ``[batch, num_kv_heads]`` int32 (the kept
            tokens attended, at most ``token_budget``) and ``pages=None``.
        """
        self._check_layer(q, layer)
        batch, num_kv_heads = q.shape[0], layer.k_pages.shape[2]
        if not isinstance(state, EvictionState):
            raise ValueError(f"policy {self.name!r} needs the EvictionState from init_state(), got {type(state).__name__}")
        if tuple(state.keep.shape[:2]) != (batch, num_kv_heads):
            raise ValueError(
                f"state is for (batch, num_kv_heads)={tuple(state.keep.shape[:2])}, the step has {(batch, num_kv_heads)}"
            )
        if not torch.equal(seq_lens.long(), state.lengths.long() + 1):
            raise ValueError(
                f"policy {self.name!r} decodes one token per sequence and step: seq_lens must be the state's "
                f"lengths + 1 ({(state.lengths + 1).tolist()}), got {seq_lens.tolist()}"
            )
        max_tokens = page_table.shape[1] * self.page_size
        state._resize(max_tokens)
        current = torch.arange(max_tokens, device=q.device)[None, :] == seq_lens.long()[:, None] - 1
        keep = state.keep | current[:, None, :]
        k_pages, v_pages = layer.k_pages, layer.v_pages
        if bool((keep.sum(-1) > self.token_budget).any()):
            probs = None
            if self.needs_attention:
                probs = masked_decode_attention(q, k_pages, v_pages, page_table, seq_lens, keep, sm_scale, True).probs
                probs = self._group_attention(probs, num_kv_heads)
            keep = self._evict(keep, self._ranking(state, probs), seq_lens, self.token_budget, 0)
        out, probs = masked_decode_attention(q, k_pages, v_pages, page_table, seq_lens, keep, sm_scale, True)
        probs = self._group_attention(probs, num_kv_heads)
        charged = keep.sum(-1, dtype=torch.int32)
        state.keep = self._evict(keep, self._ranking(state, probs), seq_lens, self.token_budget - 1, 1)
        self._observe(state, probs)
        state.lengths = seq_lens.to(torch.int32).clone()
        return DecodeOutput(out, charged, None)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(token_budget={self.token_budget}, sink_tokens={self.sink_tokens}, "
            f"recent_tokens={self.recent_tokens})"
        )


class StreamingPolicy(EvictionPolicy):
    """StreamingLLM (Xiao et al., 2024): the first ``sink_tokens`` tokens plus the most recent
    ``token_budget - sink_tokens`` (the current one included)."""

    name = "streaming"
    options = ("sink_tokens",)
    needs_attention = False

    def __init__(self, token_budget: int, page_size: int = 16, sink_tokens: int = 4) -> None:
        super().__init__(token_budget, page_size)
        _check_int(self.name, "sink_tokens", sink_tokens, 0)
        if sink_tokens >= token_budget:
            raise ValueError(
                f"policy 'streaming': sink_tokens={sink_tokens} leaves no room for the current token in "
                f"token_budget={token_budget}; allowed: sink_tokens < token_budget"
            )
        self.sink_tokens = sink_tokens
        self.recent_tokens = token_budget - sink_tokens

    def _ranking(self, state, probs):
        position = torch.arange(state.keep.shape[-1], device=state.keep.device, dtype=torch.float32)
        return position.expand_as(state.keep)


class H2OPolicy(EvictionPolicy):
    """H2O (Zhang et al., 2023): the ``recent_tokens`` most recent tokens (current included) plus the
    ``token_budget - recent_tokens`` heavy hitters by accumulated attention.

    Args:
        recent_tokens: recent window, default ``max(1, token_budget // 2)`` (H2O's even split).
    """

    name = "h2o"
    options = ("recent_tokens",)
    uses_prefill_attention = True

    def __init__(self, token_budget: int, page_size: int = 16, recent_tokens: Optional[int] = None) -> None:
        super().__init__(token_budget, page_size)
        if recent_tokens is None:
            recent_tokens = max(1, token_budget // 2)
        _check_int(self.name, "recent_tokens", recent_tokens, 1)
        if recent_tokens > token_budget:
            raise ValueError(
                f"policy 'h2o': recent_tokens={recent_tokens} exceeds token_budget={token_budget}; "
                f"allowed: 1 <= recent_tokens <= token_budget"
            )
        self.recent_tokens = recent_tokens

    def init_state(self, seq_lens: torch.Tensor, num_kv_heads: int, prefill_scores: Optional[torch.Tensor] = None):
        """As :meth:`EvictionPolicy.init_state`; ``prefill_scores`` ``[batch, num_kv_heads, T]``
        float (``T >= max(seq_lens)``), the attention each prefilled token received from the prefill
        queries (summed over queries and the query group, from :func:`prefill_attention`, the
        sequence's stored tokens in order), seeds the accumulated attention as in H2O. Without it
        accumulation starts at the first decode step."""
        batch, max_tokens = seq_lens.shape[0], int(seq_lens.max()) if seq_lens.numel() else 0
        if prefill_scores is None:
            scores = torch.zeros(batch, num_kv_heads, max_tokens, device=seq_lens.device)
        elif prefill_scores.shape[:2] != (batch, num_kv_heads) or prefill_scores.shape[2] < max_tokens:
            raise ValueError(
                f"policy 'h2o': prefill_scores must have shape ({batch}, {num_kv_heads}, >= {max_tokens}), "
                f"got {tuple(prefill_scores.shape)}"
            )
        else:
            valid = token_positions(seq_lens, max_tokens)[:, None, :]
            scores = torch.where(valid, prefill_scores[..., :max_tokens].float(), 0.0)
        return self._prefilled(seq_lens, num_kv_heads, scores)

    def _ranking(self, state, probs):
        return state.scores + probs

    def _observe(self, state, probs):
        state.scores = torch.where(state.keep, state.scores + probs, 0.0)


class TOVAPolicy(EvictionPolicy):
    """TOVA (Oren et al., 2024): the ``token_budget`` tokens with the highest attention from the
    current query; no window (the current token is attended, then ranked like any other)."""

    name = "tova"

    def _ranking(self, state, probs):
        return probs
