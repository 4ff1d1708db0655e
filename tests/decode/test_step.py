"""A verify step's choice of the next round's draft pages (``QuestDecodeStep.dense`` with ``select_into``): the top
pages by the attention mass of its queries, summed over them and each selection head's query heads, among the pages
before the round, with the config's forced pages and each row's budget; on the reference backend and on the Triton
kernels (interpreter), against masses computed from a plain softmax over every key."""

from __future__ import annotations

import pytest
import torch

from questkv import QuestConfig
from questkv.decode import QuestDecodeStep
from questkv.ops import LayerPages, reference
from tests.helpers import softmax_page_masses

PAGE = 8


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("selection", ["kv_head", "q_head"])
def test_the_next_rounds_pages_are_the_top_pages_by_the_verify_steps_attention_mass(backend, selection):
    if backend == "triton":
        pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    num_q, num_kv, head_dim, queries = 8, 2, 16, 4
    lens = torch.tensor([83, 61], dtype=torch.int32)
    max_pages = 12
    num_pages = 2 * max_pages
    k_pages = torch.randn(num_pages, PAGE, num_kv, head_dim, generator=gen) * 3  # peaked attention: distinct masses
    v_pages = torch.randn(num_pages, PAGE, num_kv, head_dim, generator=gen)
    layer = LayerPages(k_pages, v_pages, k_pages.amin(1), k_pages.amax(1))
    table = torch.randperm(num_pages, generator=gen)[:2 * max_pages].view(2, max_pages).int()
    q = torch.randn(2, queries, num_q, head_dim, generator=gen)
    config = QuestConfig(token_budget=4 * PAGE, page_size=PAGE, dense_layers=0, sink_pages=1, recent_pages=1,
                         selection=selection, backend=backend)
    step = QuestDecodeStep(config, 2, num_q, num_kv, head_dim, max_pages, torch.float32, "cpu", num_queries=queries)
    sel_heads = num_q if selection == "q_head" else num_kv
    chosen = torch.full((2, sel_heads, 6), -1, dtype=torch.int32)
    first = lens - queries  # the round's first position
    budgets = torch.tensor([4 * PAGE, 3 * PAGE], dtype=torch.int32)
    out = step.dense(q.flatten(0, 1), layer, table, lens, None, chosen, first + 1, budgets)
    want_out = reference.paged_decode_attention(q, k_pages, v_pages, table, lens)
    torch.testing.assert_close(out.view_as(q), want_out, rtol=1e-5, atol=1e-5)
    rows = softmax_page_masses(q, k_pages, table, lens)  # [batch, queries * num_q, pages]
    masses = rows.view(2, queries, sel_heads, num_q // sel_heads, -1).sum((1, 3))
    torch.testing.assert_close(step.scores.double()[masses > 0], masses[masses > 0], rtol=1e-4, atol=1e-6)
    want = reference.select_pages(masses.float(), first + 1, PAGE, 4, 1, 1, budgets)
    assert torch.equal(chosen[..., :4], want)
    assert (chosen[..., 4:] == -1).all()  # columns past the budget untouched


def test_a_one_query_or_dense_step_does_not_select():
    config = QuestConfig(token_budget=4 * PAGE, page_size=PAGE, dense_layers=0)
    one = QuestDecodeStep(config, 1, 4, 2, 16, 4, torch.float32, "cpu")
    dense = QuestDecodeStep(QuestConfig(page_size=PAGE), 1, 4, 2, 16, 4, torch.float32, "cpu", num_queries=3)
    layer = LayerPages(*(torch.randn(8, PAGE, 2, 16) for _ in range(4)))
    table, lens = torch.arange(4, dtype=torch.int32)[None], torch.tensor([20], dtype=torch.int32)
    for step, queries in ((one, 1), (dense, 3)):
        with pytest.raises(ValueError, match="selects only in a step of several queries with a sparse config"):
            step.dense(torch.randn(queries, 4, 16), layer, table, lens, None, torch.zeros(1, 2, 4, dtype=torch.int32),
                       lens, None)
    with pytest.raises(ValueError, match="sparse takes one query per sequence, not 3"):
        QuestDecodeStep(config, 1, 4, 2, 16, 4, torch.float32, "cpu", num_queries=3).sparse(
            torch.randn(3, 4, 16), layer, table, lens)
