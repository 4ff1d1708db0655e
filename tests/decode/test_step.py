"""``QuestDecodeStep``'s argument rules for a step of several queries per sequence (a lossless verify step): it
attends densely; a sparse call refuses them."""

from __future__ import annotations

import pytest
import torch

from questkv import QuestConfig
from questkv.decode import QuestDecodeStep
from questkv.ops import LayerPages

PAGE = 8


def test_a_sparse_step_takes_one_query_per_sequence():
    config = QuestConfig(token_budget=4 * PAGE, page_size=PAGE, dense_layers=0)
    layer = LayerPages(*(torch.randn(8, PAGE, 2, 16) for _ in range(4)))
    table, lens = torch.arange(4, dtype=torch.int32)[None], torch.tensor([20], dtype=torch.int32)
    with pytest.raises(ValueError, match="sparse takes one query per sequence, not 3"):
        QuestDecodeStep(config, 1, 4, 2, 16, 4, torch.float32, "cpu", num_queries=3).sparse(
            torch.randn(3, 4, 16), layer, table, lens)
