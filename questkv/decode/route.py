"""The route of one sequence's decode step: dense attention or Quest's page selection. The one place that decides
it, read by the engine's runner (:mod:`questkv.engine.model_runner`) and the HF drop-in
(:mod:`questkv.integrations.layer_decoder`) alike.

A step decodes densely where Quest cannot win:

* the request has no budget (a dense request, or no Quest at all);
* its budget covers its context: Quest would select every page, dense attention's result at a higher cost;
* its context holds at most ``QuestConfig.dense_context_ratio`` budgets: the cost model. A sparse layer's step
  reads ``1/page_size`` of the keys (the bounds) plus the budget's pages and adds its estimate and select launches
  (a fixed cost per layer that grows with the page count); dense reads the whole context. On the H200 at the 8B
  shape, batch 1, budget 2048 (committed ``benchmarks/results/e2e-h200-8k-bf16-final.md`` and the short-context
  points in ``docs/results.md``), Quest's step was 0.91x dense's at 1k (the budget covers it), 0.95x at 8k
  (4 budgets), 1.02x at 32k (16 budgets) and 1.16x at 64k: below about 4 budgets the sparse step costs more than
  it saves, so the default ratio is 4 (an evaluation sets 1: it measures Quest's answers at every context).

The rule depends on the row's own length and budget only, never on what shares its batch, so a request's tokens do
not depend on its batch.
"""

from __future__ import annotations

import enum
from typing import Iterable, Optional

from questkv.config import QuestConfig


class StepRoute(str, enum.Enum):
    """How a step of several rows runs its sparse layers: every row with Quest (``SPARSE``), every row densely
    (``DENSE``: the dense step, no estimate or select), or both kinds of row (``MIXED``: Quest's step with the dense
    rows selecting every page of theirs). ``VERIFY``: a lossless verify step, every row dense over the same number
    of positions (the engine's runner; never :func:`step_route`'s answer)."""

    SPARSE = "sparse"
    MIXED = "mixed"
    DENSE = "dense"
    VERIFY = "verify"


def decodes_densely(quest: Optional[QuestConfig], token_budget: Optional[int], seq_len: int) -> bool:
    """Whether a decode step of a sequence of ``seq_len`` tokens (the new one included) with Quest budget
    ``token_budget`` (``None``: dense) under the engine's or model's ``quest`` config attends densely."""
    if quest is None or token_budget is None:
        return True
    return seq_len <= quest.dense_context_ratio * token_budget


def step_route(dense_rows: Iterable[bool]) -> StepRoute:
    """The route of a step whose rows decode densely where ``dense_rows`` (of :func:`decodes_densely`) says so."""
    dense_rows = list(dense_rows)
    if all(dense_rows):
        return StepRoute.DENSE
    return StepRoute.MIXED if any(dense_rows) else StepRoute.SPARSE
