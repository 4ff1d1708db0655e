"""KV bytes per decode step (questkv.policies.cost) on hand-computed cases."""

import re

import pytest

from questkv.policies.cost import kv_bytes_per_step, model_kv_bytes_per_step

# A Qwen2.5-0.5B-like layer: 2 KV heads, 14 query heads, head_dim 64, bf16; 16k tokens in pages of 16.
SHAPE = dict(context=16384, page_size=16, head_dim=64, num_kv_heads=2, num_q_heads=14, dtype_bytes=2)
ROW = 64 * 2  # bytes of one key (or value) vector of one head
PAGES = 16384 // 16


@pytest.mark.parametrize(
    "policy, budget, options, tokens_attended, expected",
    [
        ("full", None, None, None, 2 * 16384 * 2 * ROW),
        # bounds of every page + K and V of 16 pages, per KV head
        ("quest", 256, None, None, 2 * PAGES * 2 * ROW + 2 * 2 * 256 * ROW),
        ("quest", 256, {"sink_pages": 1, "recent_pages": 2}, None, 2 * PAGES * 2 * ROW + 2 * 2 * 256 * ROW),
        # q_head: every query head reads its own 16 pages; the bounds are read once per KV head
        ("quest", 256, {"selection": "q_head"}, None, 2 * PAGES * 2 * ROW + 2 * 14 * 256 * ROW),
        ("quest-topp", 256, {"top_p": 0.9}, 100.5, 2 * PAGES * 2 * ROW + 2 * 2 * 100.5 * ROW),
        # selection reuse: the bounds on one step in 4; a reusing step also attends the pages begun since
        ("quest", 256, {"selection_interval": 4}, 262.0, 2 * PAGES * 2 * ROW / 4 + 2 * 2 * 262.0 * ROW),
        # + the keys of 4 x 16 shortlisted pages
        ("quest-rerank", 256, {"shortlist": 4}, None, 2 * PAGES * 2 * ROW + 2 * 2 * 256 * ROW + 2 * 64 * 16 * ROW),
        ("quest-rerank", 256, None, None, 2 * PAGES * 2 * ROW + 2 * 2 * 256 * ROW + 2 * 64 * 16 * ROW),
        ("quest-rerank", 256, {"shortlist": 2, "selection": "q_head"}, None,
         2 * PAGES * 2 * ROW + 2 * 14 * 256 * ROW + 14 * 32 * 16 * ROW),
        # 2-bit codes of every page's keys (shortlist past the pages): head_dim / 4 bytes per key
        ("quest-rerank", 256, {"shortlist": 1000, "key_bits": 2}, None,
         2 * PAGES * 2 * ROW + 2 * 2 * 256 * ROW + 2 * PAGES * 16 * 64 * 2 / 8),
        # every key (the true attention) + K and V attended
        ("oracle", 256, None, None, 16384 * 2 * ROW + 2 * 2 * 256 * ROW),
        ("streaming", 256, {"sink_tokens": 4}, None, 2 * 2 * 256 * ROW),
        ("h2o", 256, None, None, 2 * 2 * 256 * ROW),
    ],
)
def test_bytes_of_a_16k_step(policy, budget, options, tokens_attended, expected):
    got = kv_bytes_per_step(policy, token_budget=budget, options=options, tokens_attended=tokens_attended, **SHAPE)
    assert got == expected


def test_short_contexts_and_small_pages():
    shape = dict(SHAPE, context=20)  # 2 pages of 16, the second holding 4 tokens
    assert kv_bytes_per_step("full", token_budget=None, **shape) == 2 * 20 * 2 * ROW
    # a budget past the context attends both pages, counted whole
    assert kv_bytes_per_step("quest", token_budget=64, **shape) == 2 * 2 * 2 * ROW + 2 * 2 * 32 * ROW
    # the shortlist is capped by the pages there are
    assert kv_bytes_per_step("quest-rerank", token_budget=16, options={"shortlist": 8}, **shape) == (
        2 * 2 * 2 * ROW + 2 * 2 * 16 * ROW + 2 * 2 * 16 * ROW
    )
    assert kv_bytes_per_step("tova", token_budget=64, **shape) == 2 * 2 * 20 * ROW
    # page 8: twice the bounds of page 16 at the same budget
    page8 = kv_bytes_per_step("quest", token_budget=256, **dict(SHAPE, page_size=8))
    assert page8 == 2 * 2048 * 2 * ROW + 2 * 2 * 256 * ROW
    fp32 = kv_bytes_per_step("quest", token_budget=256, **dict(SHAPE, dtype_bytes=4))
    assert fp32 == 2 * kv_bytes_per_step("quest", token_budget=256, **SHAPE)


def test_model_bytes_count_dense_layers_in_full():
    full = kv_bytes_per_step("full", token_budget=None, **SHAPE)
    quest = kv_bytes_per_step("quest", token_budget=256, **SHAPE)
    assert model_kv_bytes_per_step(24, 2, "quest", 256, **SHAPE) == 2 * full + 22 * quest
    assert model_kv_bytes_per_step(24, 2, "full", None, **SHAPE) == 24 * full
    assert model_kv_bytes_per_step(2, 5, "quest", 256, **SHAPE) == 2 * full
    topp = model_kv_bytes_per_step(24, 2, "quest-topp", 256, tokens_attended=64.0, **SHAPE)
    assert topp == 2 * full + 22 * kv_bytes_per_step("quest-topp", token_budget=256, tokens_attended=64.0, **SHAPE)


@pytest.mark.parametrize(
    "policy, budget, changes, message",
    [
        ("snapkv", 64, {}, "kv_bytes_per_step policy must be one of"),
        ("full", 64, {}, "policy 'full' takes token_budget=None, got 64"),
        ("quest", None, {}, "kv_bytes_per_step token_budget must be an int, got None"),
        ("quest", 64, {"context": 0}, "kv_bytes_per_step context must be >= 1, got 0"),
        ("quest", 64, {"dtype_bytes": 2.0}, "kv_bytes_per_step dtype_bytes must be an int, got 2.0"),
        ("quest", 64, {"options": {"selection": "head"}}, "kv_bytes_per_step selection must be one of"),
        ("quest-rerank", 64, {"options": {"shortlist": 0}}, "kv_bytes_per_step shortlist must be >= 1, got 0"),
        ("quest-rerank", 64, {"options": {"key_bits": 3}}, "kv_bytes_per_step key_bits must be one of 1, 2, 4, 8; got 3"),
    ],
)
def test_bad_arguments_raise_clear_errors(policy, budget, changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        kv_bytes_per_step(policy, token_budget=budget, **{**SHAPE, **changes})
