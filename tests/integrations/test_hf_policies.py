"""questkv.enable(model, policy): every questkv.policies policy on the sparse layers of tiny random
HF models (fp32, CPU): agreement with the QuestConfig path and with dense decoding, the QuestCache's
policy state, prefill attention recording and budget accounting."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import questkv
from questkv.integrations import hf
from questkv.policies import H2OPolicy, make_policy

PAGE = 8
VOCAB = 96
FAMILIES = {
    "llama-gqa": (LlamaForCausalLM, LlamaConfig, dict(num_key_value_heads=2)),
    "qwen2-mha": (Qwen2ForCausalLM, Qwen2Config, dict(num_key_value_heads=4)),
}


def make_model(family: str = "llama-gqa", seed: int = 0, layers: int = 3):
    model_cls, config_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        max_position_embeddings=1024, pad_token_id=0, **extra,
    )
    model = model_cls(config).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, as the manual loops do
    with torch.no_grad():  # sharper queries than the near-uniform random init: selection matters
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    return model


def prompt(length: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, new_tokens=10, **kwargs):
    return model.generate(
        ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
        pad_token_id=0, **kwargs,
    )


def cache_of(out) -> "questkv.QuestCache":
    cache = getattr(out, "past_key_values", None)
    cache = cache if cache is not None else getattr(out, "cache", None)
    assert isinstance(cache, questkv.QuestCache)
    return cache


def assert_same(a, b, atol):
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.logits) == len(b.logits)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, atol=atol, rtol=0)


def manual_decode(model, cache, ids, steps, attention_mask=None, position_ids=None):
    """Prefill ``ids`` into ``cache`` then decode ``steps`` greedy tokens one forward at a time;
    returns the stacked last-position logits ``[steps + 1, batch, vocab]``."""
    name = hf.cache_argument(model)
    logits = []
    with torch.no_grad():
        out = model(ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True, **{name: cache})
        logits.append(out.logits[:, -1])
        mask = attention_mask
        positions = None if position_ids is None else position_ids[:, -1:]
        for _ in range(steps):
            token = logits[-1].argmax(-1, keepdim=True)
            kwargs = {}
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(token)], dim=1)
                kwargs["attention_mask"] = mask
            if positions is not None:
                positions = positions + 1
                kwargs["position_ids"] = positions
            out = model(token, use_cache=True, **{name: cache}, **kwargs)
            logits.append(out.logits[:, -1])
    return torch.stack(logits)


def left_padded(lengths, seed):
    """A left-padded batch of random prompts: ``(ids, attention_mask, position_ids)``."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = prompt(n, seed + row)[0]
        mask[row, width - n:] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


# -- agreement ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,selection", [("llama-gqa", "kv_head"), ("llama-gqa", "q_head"), ("qwen2-mha", "kv_head")])
def test_quest_policy_equals_quest_config(family, selection):
    model = make_model(family)
    ids = prompt(70, seed=torch.randint(0, 10**6, ()).item())
    dense = greedy(model, ids)
    budget = 3 * PAGE
    # the policy path has no route: Quest's selection at every context (dense_context_ratio 1) on the config path too
    questkv.enable(model, questkv.QuestConfig(token_budget=budget, page_size=PAGE, dense_layers=1, selection=selection,
                                              dense_context_ratio=1.0))
    config_run = greedy(model, ids)
    questkv.enable(model, make_policy("quest", budget, page_size=PAGE, selection=selection), dense_layers=1)
    policy_run = greedy(model, ids)
    assert_same(policy_run, config_run, atol=1e-5)
    assert cache_of(policy_run).mean_tokens_attended == cache_of(config_run).mean_tokens_attended == budget
    # Not vacuous: the selection changed the logits.
    assert max((a - b).abs().max().item() for a, b in zip(policy_run.logits, dense.logits)) > 1e-3


def test_full_policy_equals_unpatched():
    model = make_model("llama-gqa")
    ids = prompt(45, seed=torch.randint(0, 10**6, ()).item())
    dense = greedy(model, ids)
    questkv.enable(model, make_policy("full", None, page_size=PAGE), dense_layers=1)
    full = greedy(model, ids)
    assert_same(full, dense, atol=1e-4)
    assert cache_of(full).sparse_steps == 2 * (len(full.logits) - 1)  # the policy ran on layers 1 and 2


@pytest.mark.parametrize(
    "name,options",
    [("oracle", {}), ("quest-topp", {"top_p": 1.0}), ("streaming", {}), ("h2o", {}), ("tova", {})],
)
def test_budget_covering_the_whole_context_is_exact(name, options):
    model = make_model("llama-gqa")
    ids = prompt(40, seed=torch.randint(0, 10**6, ()).item())
    new_tokens = 10
    dense = greedy(model, ids, new_tokens)
    budget = 56  # >= 40 + 10 tokens, a multiple of PAGE
    questkv.enable(model, make_policy(name, budget, page_size=PAGE, **options), dense_layers=1)
    out = greedy(model, ids, new_tokens)
    assert_same(out, dense, atol=1e-4)
    cache = cache_of(out)
    assert cache.sparse_steps == 2 * (new_tokens - 1)
    assert cache.mean_tokens_attended <= budget


def test_small_budget_eviction_changes_the_output():
    """Non-vacuity of the exactness test above: the same policies at a small budget do differ."""
    model = make_model("llama-gqa")
    ids = prompt(60, seed=torch.randint(0, 10**6, ()).item())
    dense = greedy(model, ids)
    for name in ("streaming", "h2o", "tova"):
        questkv.enable(model, make_policy(name, 12, page_size=PAGE), dense_layers=1)
        out = greedy(model, ids)
        assert max((a - b).abs().max().item() for a, b in zip(out.logits, dense.logits)) > 1e-3, name


# -- the cache's policy state ------------------------------------------------------------------------


@pytest.mark.parametrize("name,budget", [("h2o", 12), ("streaming", 12), ("quest", 2 * PAGE)])
@pytest.mark.parametrize("dense_layers", [1, 3])
def test_dense_layers_never_create_policy_state(name, budget, dense_layers):
    layers = 4
    model = make_model("llama-gqa", layers=layers)
    questkv.enable(model, make_policy(name, budget, page_size=PAGE), dense_layers=dense_layers)
    cache = questkv.QuestCache(model.config, PAGE)
    steps = 4
    manual_decode(model, cache, prompt(30, seed=torch.randint(0, 10**6, ()).item()), steps)
    assert set(cache.policy_states) == set(range(dense_layers, layers))
    assert cache.sparse_steps == steps * (layers - dense_layers)
    if name != "quest":
        assert all(cache.policy_states[layer] is not None for layer in cache.policy_states)


def test_prefill_alone_creates_no_policy_state():
    model = make_model("llama-gqa")
    questkv.enable(model, make_policy("h2o", 12, page_size=PAGE), dense_layers=1)
    cache = questkv.QuestCache(model.config, PAGE)
    manual_decode(model, cache, prompt(30, seed=torch.randint(0, 10**6, ()).item()), 0)
    assert cache.policy_states == {} and cache.sparse_steps == 0 and cache.mean_tokens_attended is None


@pytest.mark.parametrize("name", ["h2o", "streaming"])
def test_evicted_tokens_never_come_back(name):
    model = make_model("llama-gqa")
    questkv.enable(model, make_policy(name, 12, page_size=PAGE), dense_layers=1)
    cache = questkv.QuestCache(model.config, PAGE)
    manual_decode(model, cache, prompt(30, seed=torch.randint(0, 10**6, ()).item()), 3)
    more = prompt(5, seed=torch.randint(0, 10**6, ()).item())
    name_arg = hf.cache_argument(model)
    with pytest.raises(ValueError, match="dropped tokens for good"):
        model(more, **{name_arg: cache})
    other = "streaming" if name == "h2o" else "h2o"
    questkv.enable(model, make_policy(other, 12, page_size=PAGE), dense_layers=1)
    with pytest.raises(ValueError, match="cannot continue under"):
        model(more[:, :1], **{name_arg: cache})
    # The same policy with another budget is another policy too.
    questkv.enable(model, make_policy(name, 16, page_size=PAGE), dense_layers=1)
    with pytest.raises(ValueError, match="cannot continue under"):
        model(more[:, :1], **{name_arg: cache})


def test_stateless_page_policies_can_be_switched_mid_decode():
    model = make_model("llama-gqa")
    questkv.enable(model, make_policy("quest", 2 * PAGE, page_size=PAGE), dense_layers=1)
    cache = questkv.QuestCache(model.config, PAGE)
    manual_decode(model, cache, prompt(40, seed=torch.randint(0, 10**6, ()).item()), 2)
    assert set(cache.policy_states) == {1, 2}
    questkv.enable(model, make_policy("oracle", 2 * PAGE, page_size=PAGE), dense_layers=2)
    token = prompt(1, seed=torch.randint(0, 10**6, ()).item())
    model(token, use_cache=True, **{hf.cache_argument(model): cache})
    assert set(cache.policy_states) == {2}  # the oracle's own layers, created afresh


def test_deepcopy_of_a_prefill_decodes_under_two_policies_independently():
    model = make_model("llama-gqa")
    ids = prompt(50, seed=torch.randint(0, 10**6, ()).item())
    name = hf.cache_argument(model)
    policies = [make_policy("h2o", 12, page_size=PAGE), make_policy("streaming", 12, page_size=PAGE)]

    def decode(cache, policy, first, steps=6):
        questkv.enable(model, policy, dense_layers=1)
        token, logits = first, []
        with torch.no_grad():
            for _ in range(steps):
                logits.append(model(token, use_cache=True, **{name: cache}).logits[:, -1])
                token = logits[-1].argmax(-1, keepdim=True)
        return torch.stack(logits)

    # Alone: a fresh prefill per policy (collecting prefill attention, as generate does for h2o).
    alone = []
    for policy in policies:
        questkv.enable(model, policy, dense_layers=1)
        cache = questkv.QuestCache(model.config, PAGE, collect_prefill_attention=True)
        with torch.no_grad():
            first = model(ids, use_cache=True, **{name: cache}).logits[:, -1].argmax(-1, keepdim=True)
        alone.append(decode(cache, policy, first))
    # Shared: one prefill, two deep copies decoded in an interleaved order.
    questkv.enable(model, questkv.QuestConfig(token_budget=None, page_size=PAGE))
    prefilled = questkv.QuestCache(model.config, PAGE, collect_prefill_attention=True)
    with torch.no_grad():
        first = model(ids, use_cache=True, **{name: prefilled}).logits[:, -1].argmax(-1, keepdim=True)
    copies = [copy.deepcopy(prefilled), copy.deepcopy(prefilled)]
    shared = [decode(copies[1], policies[1], first), decode(copies[0], policies[0], first)][::-1]
    for a, b in zip(shared, alone):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert not torch.allclose(alone[0], alone[1], atol=1e-3)  # the two policies really differ
    assert prefilled.policy_states == {} and prefilled.sparse_steps == 0
    assert prefilled.get_seq_length() == ids.shape[1]
    assert [c.get_seq_length() for c in copies] == [ids.shape[1] + 6] * 2


# -- prefill attention -------------------------------------------------------------------------------


def eager_prefill_attention(model, ids, mask, positions):
    """Per layer ``[batch, num_kv_heads, positions]``: attention each key position receives from the
    real queries, summed over queries and each KV head's query group, from an unpatched eager model."""
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=positions, output_attentions=True, use_cache=False)
    config = model.config
    kv_heads = config.num_key_value_heads
    result = []
    for attn in out.attentions:  # [B, Hq, Q, K]
        batch, heads, queries, keys = attn.shape
        attn = attn.double() * mask[:, None, :, None].double()  # pad queries contribute nothing
        result.append(attn.view(batch, kv_heads, heads // kv_heads, queries, keys).sum(dim=(2, 3)))
    return result


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("lengths", [[37], [37, 20, 29]])
def test_recorded_prefill_attention_matches_eager(family, lengths):
    model = make_model(family)
    ids, mask, positions = left_padded(lengths, seed=torch.randint(0, 10**6, ()).item())
    expected = eager_prefill_attention(model, ids, mask, positions)
    questkv.enable(model, make_policy("h2o", 12, page_size=PAGE), dense_layers=1)
    cache = questkv.QuestCache(model.config, PAGE, collect_prefill_attention=True)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=positions, use_cache=True, **{hf.cache_argument(model): cache})
    config = model.config
    group = config.num_attention_heads // config.num_key_value_heads
    assert set(cache.prefill_attention) == set(range(config.num_hidden_layers))
    for layer in range(config.num_hidden_layers):
        recorded = cache.prefill_attention[layer]
        assert recorded.shape == (len(lengths), config.num_key_value_heads, ids.shape[1])
        assert recorded.dtype == torch.float32
        sums = recorded.double().sum(-1)
        for row, n in enumerate(lengths):
            torch.testing.assert_close(sums[row], torch.full_like(sums[row], float(n * group)), atol=1e-3, rtol=0)
            assert torch.all(recorded[row, :, : ids.shape[1] - n] == 0)  # pad positions get nothing
        torch.testing.assert_close(recorded.double(), expected[layer], atol=1e-4, rtol=1e-5)


def test_prefill_attention_is_not_recorded_by_default():
    model = make_model("llama-gqa")
    questkv.enable(model, make_policy("streaming", 12, page_size=PAGE), dense_layers=1)
    out = greedy(model, prompt(30, seed=torch.randint(0, 10**6, ()).item()), 3)
    cache = cache_of(out)
    assert not cache.collect_prefill_attention and cache.prefill_attention == {}


def test_h2o_is_seeded_with_the_prefill_attention(monkeypatch):
    model = make_model("llama-gqa")
    lengths = [41, 26]
    ids, mask, positions = left_padded(lengths, seed=torch.randint(0, 10**6, ()).item())
    expected = eager_prefill_attention(model, ids, mask, positions)
    seen = {}
    original = H2OPolicy.init_state

    def spy(self, seq_lens, num_kv_heads, prefill_scores=None):
        seen[len(seen)] = (seq_lens.clone(), None if prefill_scores is None else prefill_scores.clone())
        return original(self, seq_lens, num_kv_heads, prefill_scores=prefill_scores)

    monkeypatch.setattr(H2OPolicy, "init_state", spy)
    questkv.enable(model, make_policy("h2o", 12, page_size=PAGE), dense_layers=1)
    out = greedy(model, ids, 5, attention_mask=mask)
    cache = cache_of(out)
    assert cache.collect_prefill_attention  # generate made a recording cache for h2o
    assert len(seen) == 2  # layers 1 and 2, once each
    for index, layer in enumerate((1, 2)):
        seq_lens, scores = seen[index]
        assert seq_lens.tolist() == lengths
        assert scores is not None
        for row, n in enumerate(lengths):
            # each row's real tokens, in order (the left pads dropped)
            torch.testing.assert_close(scores[row, :, :n].double(), expected[layer][row, :, -n:], atol=1e-4, rtol=1e-5)
    # Seeding changes H2O's decisions: the same decode without the prefill scores differs.
    generated = out.sequences[:, ids.shape[1]:]
    seeded = manual_decode_with(model, ids, mask, positions, collect=True, steps=4)
    unseeded = manual_decode_with(model, ids, mask, positions, collect=False, steps=4)
    torch.testing.assert_close(torch.stack(out.logits[:5]), seeded, atol=1e-4, rtol=0)
    assert torch.equal(seeded.argmax(-1).T, generated)
    assert (seeded - unseeded).abs().max() > 1e-4


def manual_decode_with(model, ids, mask, positions, collect, steps):
    cache = questkv.QuestCache(model.config, PAGE, collect_prefill_attention=collect)
    return manual_decode(model, cache, ids, steps, attention_mask=mask, position_ids=positions)


# -- budget accounting -------------------------------------------------------------------------------


def enabled_with_budget(name: str, budget: int):
    """A llama-gqa model enabled with ``name`` at ``budget`` on layers >= 1 ("quest-config": the
    QuestConfig path, else the policy of that name)."""
    model = make_model("llama-gqa")
    if name == "quest-config":
        questkv.enable(model, questkv.QuestConfig(token_budget=budget, page_size=PAGE, dense_layers=1,
                                                  dense_context_ratio=1.0))  # Quest from short contexts
    else:
        questkv.enable(model, make_policy(name, budget, page_size=PAGE), dense_layers=1)
    return model


@pytest.mark.parametrize(
    "name,exact",
    [("quest-config", True), ("quest", True), ("oracle", True), ("streaming", True), ("h2o", True), ("tova", True),
     ("quest-topp", False)],
)
def test_every_policy_charges_the_same_budget(name, exact):
    budget = 2 * PAGE
    model = enabled_with_budget(name, budget)
    ids, mask, _ = left_padded([90, 75], seed=torch.randint(0, 10**6, ()).item())
    new_tokens = 6
    out = greedy(model, ids, new_tokens, attention_mask=mask)
    cache = cache_of(out)
    assert cache.sparse_steps == 2 * (new_tokens - 1)
    used = cache.mean_tokens_attended
    assert 0 < used <= budget
    if exact:
        assert used == budget
    else:
        assert used >= PAGE  # at least the current page


# -- errors ------------------------------------------------------------------------------------------


def test_enable_rejects_bad_arguments():
    model = make_model("llama-gqa")
    with pytest.raises(ValueError, match="must be a questkv.QuestConfig or a questkv.policies.DecodePolicy, got str"):
        questkv.enable(model, "quest")
    with pytest.raises(ValueError, match="dense_layers=1 is only for a policy"):
        questkv.enable(model, questkv.QuestConfig(token_budget=2 * PAGE, page_size=PAGE), dense_layers=1)
    with pytest.raises(ValueError, match="dense_layers=3 leaves no sparse layer in a model of 3 layers"):
        questkv.enable(model, make_policy("h2o", 12, page_size=PAGE), dense_layers=3)
    with pytest.raises(ValueError, match="dense_layers"):
        questkv.enable(model, make_policy("h2o", 12, page_size=PAGE), dense_layers=-1)
    assert not hf.is_enabled(model)


@pytest.mark.parametrize("name", ["quest-config", "quest", "oracle", "streaming", "h2o", "tova"])
def test_mean_tokens_attended_per_sequence_charges_short_rows_what_they_hold(name):
    """Rows shorter than the budget are charged what they hold: whole pages (page policies) or
    tokens (eviction policies); rows longer than the budget are charged the budget."""
    budget = 4 * PAGE
    model = enabled_with_budget(name, budget)
    lengths = [70, 11, 29]
    ids, mask, _ = left_padded(lengths, seed=torch.randint(0, 10**6, ()).item())
    new_tokens = 7
    cache = cache_of(greedy(model, ids, new_tokens, attention_mask=mask))
    paged = name in ("quest-config", "quest", "oracle")

    def charge(tokens):  # one decode step over `tokens` tokens, the new one included
        return min(-(-tokens // PAGE) * PAGE if paged else tokens, budget)

    expected = [sum(charge(n + t) for t in range(1, new_tokens)) / (new_tokens - 1) for n in lengths]
    per_sequence = cache.mean_tokens_attended_per_sequence
    assert per_sequence.shape == (3,)
    torch.testing.assert_close(per_sequence, torch.tensor(expected, dtype=torch.float64), atol=1e-9, rtol=0)
    assert cache.mean_tokens_attended == pytest.approx(sum(expected) / 3)


def test_a_dropped_cache_is_freed_without_the_garbage_collector():
    import gc
    import weakref

    model = make_model("llama-gqa")
    questkv.enable(model, make_policy("h2o", 2 * PAGE, page_size=PAGE), dense_layers=1)
    cache = questkv.QuestCache(model.config, PAGE)
    manual_decode(model, cache, prompt(40, seed=torch.randint(0, 10**6, ()).item()), 2)
    copy_ref = weakref.ref(cache)
    gc.disable()
    try:
        del cache
        assert copy_ref() is None  # no reference cycle keeps its page pool alive
    finally:
        gc.enable()


def test_policy_layers_run_the_policy_and_dense_layers_the_decode_step(monkeypatch):
    from questkv.decode.step import QuestDecodeStep

    model = make_model("llama-gqa")  # 3 layers
    policy = make_policy("streaming", 12, page_size=PAGE)
    questkv.enable(model, policy, dense_layers=1)
    calls = []
    for name in ("dense", "sparse"):
        original = getattr(QuestDecodeStep, name)
        monkeypatch.setattr(
            QuestDecodeStep, name, lambda self, *a, _name=name, _original=original, **k: calls.append(_name) or _original(self, *a, **k)
        )
    decode = type(policy).decode
    monkeypatch.setattr(type(policy), "decode", lambda self, *a, **k: calls.append("policy") or decode(self, *a, **k))
    new_tokens = 6
    greedy(model, prompt(30, seed=torch.randint(0, 10**6, ()).item()), new_tokens)
    assert calls == ["dense", "policy", "policy"] * (new_tokens - 1)
