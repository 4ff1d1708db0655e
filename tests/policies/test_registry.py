"""make_policy, the shared budget accounting, and the token-level masked attention."""

import dataclasses
import inspect
import re

import pytest
import torch

from questkv import QuestConfig
from questkv.config import PAGE_POLICY_OPTIONS
from questkv.policies import (
    POLICIES, OraclePolicy, PagePolicy, QuestPolicy, QuestRerankPolicy, QuestTopPPolicy, make_policy,
    masked_decode_attention,
)

SPARSE = ["quest", "oracle", "quest-topp", "quest-rerank", "streaming", "h2o", "tova"]


def test_registry_names():
    assert sorted(POLICIES) == sorted(["full", *SPARSE])


@pytest.mark.parametrize(
    "name, budget, options, message",
    [
        ("snapkv", 64, {}, "policy must be one of 'full', 'quest', 'oracle', 'quest-topp', 'quest-rerank', 'streaming', "
                           "'h2o', 'tova'; got 'snapkv'"),
        ("quest", 64, {"top_p": 0.9}, "policy 'quest' takes no option(s) top_p"),
        ("tova", 64, {"sink_tokens": 4}, "policy 'tova' takes no option(s) sink_tokens; its options: none"),
        ("quest", 40, {}, "policy 'quest': QuestConfig.token_budget must be a multiple of page_size=16"),
        ("oracle", 16, {"sink_pages": 1}, "fewer than the 2 always-kept pages"),
        ("quest", 64, {"selection": "head"}, "QuestConfig.selection must be one of"),
        ("full", 64, {}, "policy 'full' attends every token; token_budget must be None"),
        ("quest-topp", 64, {"top_p": 0.0}, "policy 'quest-topp': top_p must be in (0, 1], got 0.0"),
        ("quest-topp", 64, {"top_p": 1.5}, "policy 'quest-topp': top_p must be in (0, 1], got 1.5"),
        ("quest-topp", 64, {"top_p": True}, "policy 'quest-topp': top_p must be a finite number, got True"),
        ("quest-topp", 64, {"min_budget": 8}, "policy 'quest-topp': min_budget must be a multiple of page_size=16, got 8"),
        ("quest-topp", 64, {"min_budget": 80}, "policy 'quest-topp': min_budget must be <= 64, got 80"),
        ("quest-topp", 64, {"min_budget": -16}, "policy 'quest-topp': min_budget must be >= 0, got -16"),
        ("quest-rerank", 64, {"shortlist": 0}, "policy 'quest-rerank': shortlist must be >= 1, got 0"),
        ("quest-rerank", 64, {"shortlist": 1.5}, "policy 'quest-rerank': shortlist must be an int, got 1.5"),
        ("quest-rerank", 64, {"rerank": "sum"}, "policy 'quest-rerank': rerank must be one of 'max', 'mass'; got 'sum'"),
        ("quest-rerank", 64, {"top_p": 0.9}, "policy 'quest-rerank' takes no option(s) top_p"),
        ("quest-rerank", 64, {"key_bits": 3}, "policy 'quest-rerank': key_bits must be one of 1, 2, 4, 8; got 3"),
        ("quest-rerank", 64, {"key_bits": True}, "policy 'quest-rerank': key_bits must be an int, got True"),
        ("quest-rerank", 64, {"key_bits": 2.0}, "policy 'quest-rerank': key_bits must be an int, got 2.0"),
        ("streaming", 4, {"sink_tokens": 4}, "sink_tokens=4 leaves no room for the current token"),
        ("streaming", 8, {"sink_tokens": -1}, "sink_tokens must be an int >= 0"),
        ("h2o", 8, {"recent_tokens": 9}, "recent_tokens=9 exceeds token_budget=8"),
        ("h2o", 8, {"recent_tokens": 0}, "recent_tokens must be an int >= 1"),
        ("tova", None, {}, "policy 'tova': token_budget must be an int >= 1, got None"),
        ("h2o", 8.0, {}, "token_budget must be an int"),
    ],
)
def test_bad_arguments_raise_clear_errors(name, budget, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_policy(name, budget, **options)


def test_page_policies_take_quest_config_options_and_defaults():
    fields = {field.name: field for field in dataclasses.fields(QuestConfig)}
    for cls in (QuestPolicy, OraclePolicy, QuestTopPPolicy, QuestRerankPolicy):
        assert cls.options[: len(PAGE_POLICY_OPTIONS)] == PAGE_POLICY_OPTIONS
    parameters = inspect.signature(PagePolicy.__init__).parameters
    for name in ("page_size",) + PAGE_POLICY_OPTIONS:
        assert parameters[name].default == fields[name].default, name
    assert make_policy("quest", 64).config == QuestConfig(token_budget=64)
    options = dict(selection="q_head", group_reduction="max", sink_pages=1, recent_pages=1)
    policy = make_policy("oracle", 64, page_size=8, **options)
    assert policy.config == QuestConfig(token_budget=64, page_size=8, **options)


def test_policy_and_cache_page_sizes_must_agree(random_cache):
    cache = random_cache([9])
    with pytest.raises(ValueError, match="built for page_size=16, the cache has 4"):
        make_policy("quest", 32).decode(torch.randn(1, 4, 8), *cache.step_inputs())


@pytest.mark.parametrize("name", SPARSE)
def test_budget_accounting_is_the_same_for_every_policy(random_cache, name):
    """At token_budget=B no (sequence, head) attends more than B tokens as the budget counts them,
    and a long enough sequence exactly B (a fixed-budget policy uses all of it; top-p with p=1 too).
    Page policies count whole pages, so the tokens they really read are <= tokens_attended."""
    budget, page_size, prefill, steps = 16, 4, [45, 30, 7], 5
    options = {"top_p": 1.0} if name == "quest-topp" else {}
    policy = make_policy(name, budget, page_size=page_size, **options)
    cache = random_cache(prefill, extra_tokens=steps)
    state = policy.init_state(torch.tensor(prefill, dtype=torch.int32), 2)
    for _ in range(steps):
        cache.append_token(torch.randn(3, 2, 8), torch.randn(3, 2, 8))
        layer, page_table, seq_lens = cache.step_inputs()
        result = policy.decode(torch.randn(3, 4, 8), layer, page_table, seq_lens, state)
        assert result.tokens_attended.dtype == torch.int32
        assert torch.all(result.tokens_attended <= budget)
        for b, length in enumerate(seq_lens.tolist()):
            expected = budget if length >= budget else -(-length // page_size) * page_size
            if result.pages is None:  # eviction: the tokens themselves
                expected = min(length, budget)
            assert torch.all(result.tokens_attended[b] == expected), (b, length, result.tokens_attended[b])
        if result.pages is not None:  # tokens really read: the partial current page counts less
            start = result.pages.long() * page_size
            real = (seq_lens.long()[:, None, None] - start).clamp(0, page_size) * (result.pages >= 0)
            assert torch.all(real.sum(-1) <= result.tokens_attended)


def test_masked_attention_matches_sdpa_and_returns_probabilities(random_cache):
    torch.manual_seed(5)
    cache = random_cache([23, 10], num_kv_heads=2, page_size=4)
    layer, page_table, seq_lens = cache.step_inputs()
    max_tokens = page_table.shape[1] * 4
    keep = torch.rand(2, 2, max_tokens) < 0.6
    keep[:, :, 0] = True
    # Unattended slots may hold anything: NaN must not leak.
    k_pages, v_pages = layer.k_pages.clone(), layer.v_pages.clone()
    for t in (~keep[0, 0]).nonzero().flatten().tolist():
        if t < 23:
            page, slot = page_table[0, t // 4], t % 4
            k_pages[page, slot, 0] = float("nan")
            v_pages[page, slot, 0] = float("nan")
    q = torch.randn(2, 4, 8) * 2
    result = masked_decode_attention(q, k_pages, v_pages, page_table, seq_lens, keep, return_probs=True)
    assert torch.isfinite(result.out).all()
    for b, (k, v) in enumerate(zip(cache.keys, cache.values)):
        n = k.shape[0]
        mask = keep[b, :, :n].repeat_interleave(2, dim=0)  # [Hq, n]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[b][:, None].double(), k.repeat_interleave(2, 1).transpose(0, 1).double(),
            v.repeat_interleave(2, 1).transpose(0, 1).double(), attn_mask=mask[:, None, :],
        )[:, 0]
        torch.testing.assert_close(result.out[b].double(), ref, rtol=1e-5, atol=1e-5)
        probs = result.probs[b]
        torch.testing.assert_close(probs.sum(-1), torch.ones(4))
        assert torch.all(probs[:, n:] == 0) and torch.all(probs[:, :n][~mask] == 0)
    with pytest.raises(ValueError, match="keep must have shape"):
        masked_decode_attention(q, k_pages, v_pages, page_table, seq_lens, keep[:, :1])
