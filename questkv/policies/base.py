"""The interface every KV-selection policy implements: one decode step of one layer, batched.

A policy decides which cached tokens one decode query attends, then attends them. Two families:

* page-selection policies (:mod:`questkv.policies.page_selection`, :mod:`questkv.policies.rerank`) are stateless:
  every step they pick logical pages from the whole cache (nothing is ever dropped) and attend them with
  :func:`questkv.ops.reference.paged_decode_attention`;
* eviction policies (:mod:`questkv.policies.eviction`) keep a per-sequence, per-KV-head set of
  token positions that only shrinks (plus the newest token each step): a dropped token is gone for
  good. Their state lives in an :class:`~questkv.policies.eviction.EvictionState` per layer.

Budget accounting is the same for all: a policy built with ``token_budget=B`` attends at most ``B``
tokens per (sequence, selection head) and decode step, the current token included, as the budget
counts them (:attr:`DecodeOutput.tokens_attended`; averaged over steps and layers, this is the
``mean_tokens_attended`` that evaluations report). Page policies count every selected page in full
(``pages * page_size``, Quest's accounting, the partial current page included); eviction policies
count the tokens they attend.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, NamedTuple, Optional

import torch

from questkv.ops import LayerPages


class DecodeOutput(NamedTuple):
    """Result of :meth:`DecodePolicy.decode`.

    out: ``[batch, num_q_heads, head_dim]`` in ``q``'s dtype.
    tokens_attended: ``[batch, num_sel_heads]`` int32, tokens attended per (sequence, selection
        head) as the budget counts them (page policies: whole pages): ``num_kv_heads`` or
        ``num_q_heads`` columns for page policies (their ``selection``), ``num_kv_heads`` for
        eviction policies. Never above ``token_budget``.
    pages: ``[batch, num_sel_heads, k]`` int32 page selection (logical pages ascending, ``-1``
        padding, the format of :func:`questkv.ops.reference.select_pages`) for page policies;
        ``None`` for eviction policies.
    """

    out: torch.Tensor
    tokens_attended: torch.Tensor
    pages: Optional[torch.Tensor]


class DecodePolicy(abc.ABC):
    """Attention of one decode step of one layer under a KV-selection policy.

    Attributes:
        name: registry name (see :func:`questkv.policies.make_policy`).
        token_budget: tokens attended per (sequence, head) and step, current token included;
            ``None`` only for ``full``.
        page_size: tokens per KV page of the cache the policy reads.
        options: names of the keyword options the constructor takes beyond these two.
        uses_prefill_attention: :meth:`init_state` takes ``prefill_scores``, the attention each
            prefilled token received from the prefill queries (the HF integration records it).
    """

    name: ClassVar[str]
    options: ClassVar[tuple[str, ...]] = ()
    uses_prefill_attention: ClassVar[bool] = False

    def __init__(self, token_budget: Optional[int], page_size: int) -> None:
        self.token_budget = token_budget
        self.page_size = page_size

    def init_state(self, seq_lens: torch.Tensor, num_kv_heads: int, **kwargs: Any) -> Any:
        """Per-layer state after a dense prefill of ``seq_lens`` ``[batch]`` int32 tokens.

        Stateless policies return ``None``; pass the returned object to every :meth:`decode` of
        that layer, in order.
        """
        if kwargs:
            raise ValueError(f"policy {self.name!r} takes no init_state options, got {sorted(kwargs)}")
        return None

    @abc.abstractmethod
    def decode(
        self,
        q: torch.Tensor,
        layer: LayerPages,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        state: Any = None,
        sm_scale: Optional[float] = None,
    ) -> DecodeOutput:
        """Attend one decode query per sequence.

        The current token's key and value must already be in the cache (``seq_lens`` counts it).

        Args:
            q: ``[batch, num_q_heads, head_dim]``, post-RoPE.
            layer: the layer's pages and key bounds (:meth:`questkv.PagedKVCache.layer`).
            page_table: ``[batch, max_pages]`` int32. seq_lens: ``[batch]`` int32, each >= 1.
            state: what :meth:`init_state` returned for this layer (updated in place).
            sm_scale: softmax scale, default ``1 / sqrt(head_dim)``.
        """

    def _check_layer(self, q: torch.Tensor, layer: LayerPages) -> None:
        """Raise ``ValueError`` unless ``layer`` has this policy's page size and ``q`` fits its heads."""
        page_size, num_kv_heads = layer.k_pages.shape[1], layer.k_pages.shape[2]
        if page_size != self.page_size:
            raise ValueError(f"policy {self.name!r} was built for page_size={self.page_size}, the cache has {page_size}")
        if q.dim() != 3 or q.shape[1] % num_kv_heads:
            raise ValueError(
                f"q must be [batch, num_q_heads, head_dim] with num_q_heads a multiple of num_kv_heads="
                f"{num_kv_heads}, got {tuple(q.shape)}"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(token_budget={self.token_budget}, page_size={self.page_size})"
