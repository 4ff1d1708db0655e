"""KV-cache bytes one decode step reads under each policy: the cost side of an accuracy comparison.

:func:`kv_bytes_per_step` is the one formula, for one layer and one sequence;
:func:`model_kv_bytes_per_step` adds the layers of a model (the first ``dense_layers`` in full).
Counted: every key or value vector (``head_dim * dtype_bytes`` bytes per head and token) and every
page bound a step reads from the cache; not counted: the query, the output, page tables, and
working state such as an eviction policy's scores.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

from questkv.config import QuestConfig
from questkv.policies.rerank import KEY_BITS
from questkv.validation import check_choice, check_float, check_int

PAGE_BOUND_POLICIES: tuple[str, ...] = ("quest", "quest-topp", "quest-rerank")
"""Page policies whose estimate reads every page's ``kmin`` and ``kmax``."""
EVICTION_POLICIES: tuple[str, ...] = ("streaming", "h2o", "tova")
COSTED_POLICIES: tuple[str, ...] = ("full", "oracle", *PAGE_BOUND_POLICIES, *EVICTION_POLICIES)


def kv_bytes_per_step(
    policy: str,
    context: int,
    token_budget: Optional[int],
    page_size: int,
    head_dim: int,
    num_kv_heads: int,
    num_q_heads: int,
    dtype_bytes: int,
    options: Optional[Mapping[str, Any]] = None,
    tokens_attended: Optional[float] = None,
    selection_rate: Optional[float] = None,
) -> float:
    """KV bytes one decode step of one layer reads for one sequence of ``context`` tokens.

    With ``n = context``, ``P = ceil(n / page_size)`` pages, ``r = head_dim * dtype_bytes`` (one
    key or value vector of one head), ``H = num_kv_heads``, ``S`` selection heads (``H`` under
    ``selection="kv_head"``, ``num_q_heads`` under ``"q_head"``: each query head reads its own
    pages), ``K = token_budget // page_size`` and ``A`` tokens attended per selection head
    (``tokens_attended`` when given, e.g. a measured mean; else ``min(K, P) * page_size``, whole
    pages as the budget counts them)::

        full                      2 n H r                       K and V of every token
        quest, quest-topp         2 P H r / C + 2 S A r         kmin/kmax of every page + K,V attended
        quest-rerank              as quest + S min(L K, P) page_size c    + keys of the shortlist (L = shortlist),
                                                                        c = r (exact keys) or head_dim * key_bits / 8
        oracle                    n H r + 2 S A r               every key (true attention) + K,V attended
        streaming, h2o, tova      2 H A r                       A = min(token_budget, n) unless given

    ``quest-topp``'s ``A`` is adaptive (at most the cap ``K * page_size``): pass its measured mean.
    ``C`` is ``quest``'s ``selection_interval`` (default 1): a sequence reads the bounds on one decode
    step in ``C`` and reuses that selection in between (a mean over steps; the pages begun since a
    selection, which a reusing step attends too, belong in a measured ``A``).
    The rerank shortlist's keys are counted apart from the attended pages' keys (two passes, as
    the torch reference runs them). Sink and recent pages change what is read, not how much.

    Args:
        policy: a name of :data:`COSTED_POLICIES`.
        context: tokens in the sequence, the current one included (>= 1).
        token_budget: the policy's budget in tokens (``None`` for ``full`` only).
        page_size, head_dim, num_kv_heads, num_q_heads: the cache's and model's shape.
        dtype_bytes: bytes per element of the KV cache (2 for bf16/fp16, 4 for fp32).
        options: the policy's options; only ``selection`` (default ``"kv_head"``), ``selection_interval``
            of ``quest`` (default 1), and ``shortlist`` (default 4) and ``key_bits`` (default ``None``: exact
            keys) of ``quest-rerank``, matter.
        tokens_attended: ``A`` above, instead of the budget's count.
        selection_rate: the measured fraction of steps that read the bounds (the engine's
            :attr:`~questkv.engine.sequence.RequestMetrics.selection_rate`, adaptive reuse's included), instead of
            ``1 / C``.

    Returns:
        Bytes (a float, since ``tokens_attended`` may be a mean).

    Raises:
        ValueError: an unknown policy, a non-positive size, or a budget missing or given wrongly.
    """
    check_choice("kv_bytes_per_step policy", policy, COSTED_POLICIES)
    for name, value in (("context", context), ("page_size", page_size), ("head_dim", head_dim),
                        ("num_kv_heads", num_kv_heads), ("num_q_heads", num_q_heads), ("dtype_bytes", dtype_bytes)):
        check_int(f"kv_bytes_per_step {name}", value, minimum=1)
    options = dict(options or {})
    row = head_dim * dtype_bytes
    if policy == "full":
        if token_budget is not None:
            raise ValueError(f"kv_bytes_per_step: policy 'full' takes token_budget=None, got {token_budget!r}")
        return float(2 * context * num_kv_heads * row)
    check_int("kv_bytes_per_step token_budget", token_budget, minimum=1)
    if policy in EVICTION_POLICIES:
        attended = min(token_budget, context) if tokens_attended is None else tokens_attended
        return float(2 * num_kv_heads * attended * row)
    selection = check_choice("kv_bytes_per_step selection", options.get("selection", QuestConfig.selection),
                             ("kv_head", "q_head"))
    sel_heads = num_q_heads if selection == "q_head" else num_kv_heads
    pages = math.ceil(context / page_size)
    budget_pages = token_budget // page_size
    attended = min(budget_pages, pages) * page_size if tokens_attended is None else tokens_attended
    read = 2 * sel_heads * attended * row
    if policy == "oracle":
        return float(context * num_kv_heads * row + read)
    interval = check_int("kv_bytes_per_step selection_interval", options.get("selection_interval", 1), minimum=1)
    if selection_rate is not None:
        check_float("kv_bytes_per_step selection_rate", selection_rate, low=0.0, high=1.0)
    read += 2 * pages * num_kv_heads * row * (1 / interval if selection_rate is None else selection_rate)
    if policy == "quest-rerank":
        shortlist = check_int("kv_bytes_per_step shortlist", options.get("shortlist", 4), minimum=1)
        key_bits = options.get("key_bits")
        if key_bits is not None:
            check_int("kv_bytes_per_step key_bits", key_bits, minimum=1)
            check_choice("kv_bytes_per_step key_bits", key_bits, KEY_BITS)
        key_row = row if key_bits is None else head_dim * key_bits / 8
        read += sel_heads * min(shortlist * budget_pages, pages) * page_size * key_row
    return float(read)


def model_kv_bytes_per_step(num_layers: int, dense_layers: int, policy: str, token_budget: Optional[int],
                            **layer: Any) -> float:
    """:func:`kv_bytes_per_step` summed over a model's layers: the first ``dense_layers`` (at most
    ``num_layers``) read like ``full``, the others like ``policy``. ``layer``: the other arguments
    of :func:`kv_bytes_per_step` (``tokens_attended`` and ``selection_rate``, if given, apply to the sparse
    layers)."""
    check_int("model_kv_bytes_per_step num_layers", num_layers, minimum=1)
    check_int("model_kv_bytes_per_step dense_layers", dense_layers, minimum=0)
    dense = min(dense_layers, num_layers) if policy != "full" else num_layers
    dense_layer = {**layer, "options": None, "tokens_attended": None, "selection_rate": None}
    total = dense * kv_bytes_per_step("full", token_budget=None, **dense_layer)
    if dense < num_layers:
        total += (num_layers - dense) * kv_bytes_per_step(policy, token_budget=token_budget, **layer)
    return total
