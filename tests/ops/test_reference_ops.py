"""The torch reference ops against brute force and dense SDPA."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from questkv import QuestConfig, quest_decode
from questkv.ops import reference
from tests.helpers import random_cache


def sdpa_decode(q, keys, values, mask=None):
    """Dense SDPA of one query per sequence; keys/values lists of [len, Hkv, D]; mask list of [Hq, len] bool."""
    outs = []
    for b, (k, v) in enumerate(zip(keys, values)):
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1).double()
        v = v.repeat_interleave(group, dim=1).transpose(0, 1).double()
        attn_mask = None if mask is None else mask[b][:, None, :]
        out = torch.nn.functional.scaled_dot_product_attention(q[b][:, None].double(), k, v, attn_mask=attn_mask)
        outs.append(out[:, 0])
    return torch.stack(outs).float()


HEADS = [(4, 2), (4, 4), (8, 1)]  # (q heads, kv heads): GQA, MHA, MQA


@pytest.mark.parametrize("num_q_heads, num_kv_heads", HEADS)
@pytest.mark.parametrize("selection, reduction", [("q_head", "sum"), ("kv_head", "sum"), ("kv_head", "max")])
def test_page_score_bounds_every_key_of_its_page(num_q_heads, num_kv_heads, selection, reduction):
    page_size = 4
    lens = [13, 7]
    cache = random_cache(lens, num_kv_heads=num_kv_heads, head_dim=16, page_size=page_size)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.randn(2, num_q_heads, 16) * 3 - 1
    scores = reference.page_scores(q, layer.kmin, layer.kmax, page_table, seq_lens, page_size, selection, reduction)
    group = num_q_heads // num_kv_heads
    for b, k in enumerate(cache.keys):
        dots = torch.einsum("hd,thd->ht", q[b].view(num_kv_heads, group, -1).flatten(0, 1),
                            k.repeat_interleave(group, dim=1))  # [Hq, len]
        dots = dots.view(num_kv_heads, group, -1)
        if selection == "q_head":
            target = dots.flatten(0, 1)
        else:
            target = dots.sum(1) if reduction == "sum" else dots.amax(1)
        for t in range(lens[b]):
            assert torch.all(scores[b, :, t // page_size] >= target[:, t] - 1e-4)
        pages = math.ceil(lens[b] / page_size)
        assert torch.isneginf(scores[b, :, pages:]).all()
        assert torch.isfinite(scores[b, :, :pages]).all()


def brute_force_selection(scores, num_pages, budget, sink, recent):
    """Set of selected pages for one (sequence, head): forced pages, then best by (score desc, index asc)."""
    if num_pages <= budget:
        return list(range(num_pages))
    forced = {p for p in range(num_pages) if p < sink or p >= num_pages - 1 - recent}
    rest = sorted((p for p in range(num_pages) if p not in forced), key=lambda p: (-scores[p], p))
    return sorted(forced | set(rest[: budget - len(forced)]))


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    page_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 8),
    sink=st.integers(0, 2),
    recent=st.integers(0, 2),
)
def test_selection_equals_brute_force_with_forced_pages_and_stable_ties(data, page_size, budget, sink, recent):
    budget = max(budget, sink + recent + 1)
    lens = data.draw(st.lists(st.integers(1, 12 * page_size), min_size=1, max_size=3))
    max_pages = max(math.ceil(n / page_size) for n in lens)
    heads = 2
    # Small integer scores: many ties.
    values = data.draw(st.lists(st.integers(-3, 3), min_size=len(lens) * heads * max_pages,
                                max_size=len(lens) * heads * max_pages))
    scores = torch.tensor(values, dtype=torch.float32).view(len(lens), heads, max_pages)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scores = scores.masked_fill(~reference.valid_pages(seq_lens, page_size, max_pages)[:, None], float("-inf"))
    selected = reference.select_pages(scores, seq_lens, page_size, budget, sink, recent)
    assert selected.shape == (len(lens), heads, budget) and selected.dtype == torch.int32
    for b, n in enumerate(lens):
        num_pages = math.ceil(n / page_size)
        for h in range(heads):
            expected = brute_force_selection(scores[b, h].tolist(), num_pages, budget, sink, recent)
            row = selected[b, h].tolist()
            assert row == expected + [-1] * (budget - len(expected))
            assert num_pages - 1 in row  # the current page is always attended


@pytest.mark.parametrize("num_q_heads, num_kv_heads", HEADS)
@pytest.mark.parametrize("selection", ["kv_head", "q_head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_budget_covering_context_equals_dense_sdpa(num_q_heads, num_kv_heads, selection, dtype):
    page_size = 4
    lens = [29, 5, 16]
    cache = random_cache(lens, num_kv_heads=num_kv_heads, head_dim=16, page_size=page_size, dtype=dtype)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.randn(3, num_q_heads, 16).to(dtype)
    config = QuestConfig(token_budget=8 * page_size, page_size=page_size, dense_layers=0, selection=selection)
    out = quest_decode(q, layer, page_table, seq_lens, config)
    dense = quest_decode(q, layer, page_table, seq_lens, QuestConfig(page_size=page_size))
    expected = sdpa_decode(q.float(), cache.keys, cache.values)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(dense.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("num_q_heads, num_kv_heads", HEADS)
def test_float64_queries_are_attended_in_float64(num_q_heads, num_kv_heads):
    """The decode step scores and sums a float64 model's queries in float64 (``reference.attention_dtype``), as its
    prefill does: within float64 rounding of SDPA, not float32's."""
    cache = random_cache([29, 5, 16], num_kv_heads=num_kv_heads, head_dim=16, dtype=torch.float64)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.randn(3, num_q_heads, 16, dtype=torch.float64)
    out = reference.paged_decode_attention(q, layer.k_pages, layer.v_pages, page_table, seq_lens)
    assert out.dtype == torch.float64
    expected = [torch.nn.functional.scaled_dot_product_attention(
        q[b][:, None], k.repeat_interleave(num_q_heads // num_kv_heads, dim=1).transpose(0, 1).double(),
        v.repeat_interleave(num_q_heads // num_kv_heads, dim=1).transpose(0, 1).double())[:, 0]
        for b, (k, v) in enumerate(zip(cache.keys, cache.values))]
    torch.testing.assert_close(out, torch.stack(expected), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("num_q_heads, num_kv_heads", HEADS)
@pytest.mark.parametrize("selection", ["kv_head", "q_head"])
def test_sparse_attention_equals_dense_with_unselected_tokens_masked(num_q_heads, num_kv_heads, selection):
    page_size = 4
    lens = [37, 22]
    cache = random_cache(lens, num_kv_heads=num_kv_heads, head_dim=16, page_size=page_size)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.randn(2, num_q_heads, 16)
    scores = reference.page_scores(q, layer.kmin, layer.kmax, page_table, seq_lens, page_size, selection)
    selected = reference.select_pages(scores, seq_lens, page_size, 3, sink_pages=1)
    out = reference.paged_decode_attention(q, layer.k_pages, layer.v_pages, page_table, seq_lens, selected)
    masks = []
    for b, n in enumerate(lens):
        page_of_token = torch.arange(n) // page_size
        sel = selected[b].repeat_interleave(num_q_heads // selected.shape[1], dim=0)  # [Hq, K]
        masks.append((page_of_token[None, :, None] == sel[:, None, :]).any(-1))
    torch.testing.assert_close(out, sdpa_decode(q, cache.keys, cache.values, masks), atol=1e-5, rtol=1e-5)


def test_unselected_pages_and_unwritten_slots_are_never_read():
    page_size = 4
    lens = [23, 10]
    cache = random_cache(lens, num_kv_heads=2, head_dim=16, page_size=page_size)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.randn(2, 4, 16)
    scores = reference.page_scores(q, layer.kmin, layer.kmax, page_table, seq_lens, page_size, "kv_head")
    selected = reference.select_pages(scores, seq_lens, page_size, 2)
    before = reference.paged_decode_attention(q, layer.k_pages, layer.v_pages, page_table, seq_lens, selected)
    read = torch.zeros(cache.cache.num_pages, page_size, 2, dtype=torch.bool)
    for b, n in enumerate(lens):
        for h in range(2):
            for logical in selected[b, h].tolist():
                if logical >= 0:
                    valid = min(page_size, n - logical * page_size)
                    read[page_table[b, logical], :valid, h] = True
    layer.k_pages[~read] = float("nan")
    layer.v_pages[~read] = float("nan")
    after = reference.paged_decode_attention(q, layer.k_pages, layer.v_pages, page_table, seq_lens, selected)
    assert torch.isfinite(after).all()
    torch.testing.assert_close(after, before, atol=0, rtol=0)


def test_custom_softmax_scale():
    cache = random_cache([9], num_kv_heads=1, head_dim=16)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.randn(1, 2, 16)
    out = reference.paged_decode_attention(q, layer.k_pages, layer.v_pages, page_table, seq_lens, sm_scale=0.5)
    expected = sdpa_decode(q * 0.5 * math.sqrt(16), cache.keys, cache.values)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_active_flags_keep_inactive_rows_and_all_ones_equal_no_flags():
    """The reference ``*_into`` ops with ``active``: all ones (any nonzero) give the output without flags bit for
    bit; sequences flagged 0 keep their rows of ``out`` as they were; the selection fills only the first
    ``budget_pages`` columns of a wider ``out``."""
    page_size, lens = 4, [29, 6, 17]
    cache = random_cache(lens, num_kv_heads=2, head_dim=16, page_size=page_size)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.randn(3, 4, 16)
    max_pages = page_table.shape[1]
    scores = reference.page_scores(q, layer.kmin, layer.kmax, page_table, seq_lens, page_size)
    selected = reference.select_pages(scores, seq_lens, page_size, 3, 1, 1)
    for active in (torch.ones(3, dtype=torch.int32), torch.tensor([0, 7, 0], dtype=torch.int32)):
        keep = active == 0
        old = torch.randn(3, 2, max_pages)
        out = reference.page_scores_into(old.clone(), q, layer.kmin, layer.kmax, page_table, seq_lens, page_size,
                                         active=active)
        assert torch.equal(out[keep], old[keep]) and torch.equal(out[~keep], scores[~keep])
        old_sel = torch.randint(-100, 100, (3, 2, 5), dtype=torch.int32)
        sel = reference.select_pages_into(old_sel.clone(), scores, seq_lens, page_size, 3, 1, 1, active=active)
        assert torch.equal(sel[..., 3:], old_sel[..., 3:]) and torch.equal(sel[keep], old_sel[keep])
        assert torch.equal(sel[~keep][..., :3], selected[~keep])
