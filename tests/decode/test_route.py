"""The route of a decode step (questkv.decode.route): dense without a budget, while the budget covers the context,
and while the context holds at most ``dense_context_ratio`` budgets; a step's route from its rows'."""

import random

import pytest

from questkv.config import QuestConfig
from questkv.decode.route import StepRoute, decodes_densely, step_route


@pytest.mark.parametrize("ratio", [1.0, 4.0, 2.5])
def test_a_row_decodes_densely_up_to_ratio_budgets_and_with_quest_past_them(ratio):
    budget = 16 * random.randint(1, 8)
    quest = QuestConfig(token_budget=128, page_size=16, dense_context_ratio=ratio)
    edge = int(ratio * budget)
    assert decodes_densely(quest, budget, edge) and decodes_densely(quest, budget, random.randint(1, edge))
    assert not decodes_densely(quest, budget, edge + 1)
    assert decodes_densely(quest, None, 10**6) and decodes_densely(None, None, 10**6)  # a dense request or engine


def test_a_steps_route_is_dense_mixed_or_sparse_by_its_rows():
    assert step_route([True, True]) == StepRoute.DENSE
    assert step_route([True, False]) == StepRoute.MIXED
    assert step_route([False, False]) == StepRoute.SPARSE


def test_a_ratio_below_one_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"QuestConfig.dense_context_ratio must be in \[1.0, "):
        QuestConfig(token_budget=64, dense_context_ratio=0.5)
