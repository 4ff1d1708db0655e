"""KV-selection policies behind one interface: Quest, its baselines and its upper bound.

``make_policy(name, token_budget, page_size=16, **options)`` builds one; every policy's
:meth:`~questkv.policies.DecodePolicy.decode` runs one decode step of one layer, batched over
sequences, and reports the tokens it attended as the budget counts them. See ``docs/policies.md``.

================  ======================================================================  ====================================================================
name              selection                                                               options
================  ======================================================================  ====================================================================
``full``          every token (``token_budget=None``)                                     --
``quest``         top-K pages by Quest's key-bound score                                  ``selection``, ``group_reduction``, ``sink_pages``, ``recent_pages``
``oracle``        top-K pages by the true attention mass                                  as ``quest``
``quest-topp``    fewest Quest-ranked pages whose estimated mass reaches ``top_p``, <= K  as ``quest`` + ``top_p``, ``min_budget``
``quest-rerank``  Quest shortlists ``shortlist`` x K pages; their keys (or codes) pick K  as ``quest`` + ``shortlist``, ``rerank``, ``key_bits``
``streaming``     sink tokens + recent window (eviction)                                  ``sink_tokens``
``h2o``           heavy hitters by accumulated attention + recent window (eviction)       ``recent_tokens``
``tova``          tokens with the highest current attention (eviction)                    --
================  ======================================================================  ====================================================================
"""

from __future__ import annotations

from typing import Optional

from questkv.config import QuestConfig
from questkv.policies.base import DecodeOutput, DecodePolicy
from questkv.policies.eviction import EvictionPolicy, EvictionState, H2OPolicy, StreamingPolicy, TOVAPolicy
from questkv.policies.masked_attention import MaskedAttention, masked_decode_attention
from questkv.policies.page_selection import (
    FullPolicy,
    OraclePolicy,
    PagePolicy,
    PageSelection,
    QuestPolicy,
    QuestTopPPolicy,
)
from questkv.policies.rerank import QuestRerankPolicy
from questkv.validation import check_choice

POLICIES: dict[str, type[DecodePolicy]] = {
    cls.name: cls
    for cls in (
        FullPolicy, QuestPolicy, OraclePolicy, QuestTopPPolicy, QuestRerankPolicy,
        StreamingPolicy, H2OPolicy, TOVAPolicy,
    )
}

__all__ = [
    "POLICIES",
    "DecodeOutput",
    "DecodePolicy",
    "EvictionPolicy",
    "EvictionState",
    "FullPolicy",
    "H2OPolicy",
    "MaskedAttention",
    "OraclePolicy",
    "PagePolicy",
    "PageSelection",
    "QuestPolicy",
    "QuestRerankPolicy",
    "QuestTopPPolicy",
    "StreamingPolicy",
    "TOVAPolicy",
    "make_policy",
    "masked_decode_attention",
]


def make_policy(
    name: str, token_budget: Optional[int], page_size: int = QuestConfig.page_size, **options
) -> DecodePolicy:
    """Build the policy ``name`` (a key of :data:`POLICIES`).

    Args:
        token_budget: tokens attended per (sequence, head) and decode step, current token included;
            ``None`` for ``full`` only. Page policies need a multiple of ``page_size``.
        page_size: tokens per page of the KV cache.
        options: the policy's own options (see the module docstring).

    Raises:
        ValueError: unknown ``name``, an option the policy does not take, or a bad value.
    """
    check_choice("policy", name, POLICIES)
    cls = POLICIES[name]
    unknown = sorted(set(options) - set(cls.options))
    if unknown:
        raise ValueError(
            f"policy {name!r} takes no option(s) {', '.join(unknown)}; "
            f"its options: {', '.join(cls.options) or 'none'}"
        )
    return cls(token_budget, page_size, **options)
