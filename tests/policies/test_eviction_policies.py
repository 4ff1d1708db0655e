"""Eviction policies (streaming, h2o, tova) against a brute-force simulation, and hand-made patterns."""

import pytest
import torch

from questkv.policies import EvictionState, make_policy, masked_decode_attention


def simulate(name, budget, sink, recent, prefill_len, queries, keys, brute_probs):
    """Brute-force eviction for one sequence and KV head.

    queries: list of ``[group, D]`` per step; keys: ``[prefill_len + steps, D]``.
    Returns, per step, the attended positions and the kept positions after the step.
    """
    kept, acc, history = list(range(prefill_len)), {}, []

    def group_probs(query, positions):
        probs = brute_probs(query, keys[positions][:, None, :].expand(-1, 1, -1))  # [group, n]
        return dict(zip(positions, probs.sum(0).tolist()))

    def cut(positions, ranking, length, target, reserve):
        protected = [t for t in positions if t < sink or t >= length + reserve - recent]
        others = sorted((t for t in positions if t not in protected), key=lambda t: (-ranking[t], t))
        return sorted(protected + others[: target - len(protected)])

    def rank(probs):
        if name == "streaming":
            return {t: t for t in probs}
        if name == "tova":
            return probs
        return {t: acc.get(t, 0.0) + p for t, p in probs.items()}

    for step, query in enumerate(queries):
        length = prefill_len + step + 1
        candidates = kept + [length - 1]
        if len(candidates) > budget:
            candidates = cut(candidates, rank(group_probs(query, candidates)), length, budget, 0)
        probs = group_probs(query, candidates)
        kept = cut(candidates, rank(probs), length, budget - 1, 1)
        acc = {t: acc.get(t, 0.0) + probs[t] for t in kept}
        history.append((candidates, kept))
    return history


def options_for(name, budget):
    return {"streaming": (2, budget - 2), "h2o": (0, 3), "tova": (0, 1)}[name]


@pytest.mark.parametrize("name", ["streaming", "h2o", "tova"])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 2), (2, 2), (3, 1)])
def test_eviction_matches_brute_force_simulation(random_cache, brute_probs, name, num_q_heads, num_kv_heads):
    torch.manual_seed(3)
    budget, steps, prefill, head_dim = 8, 7, [19, 5, 8], 8
    sink, recent = options_for(name, budget)
    extra = {"streaming": {"sink_tokens": sink}, "h2o": {"recent_tokens": recent}, "tova": {}}[name]
    policy = make_policy(name, budget, page_size=4, **extra)
    cache = random_cache(prefill, num_kv_heads=num_kv_heads, head_dim=head_dim, extra_tokens=steps)
    state = policy.init_state(torch.tensor(prefill, dtype=torch.int32), num_kv_heads)
    group = num_q_heads // num_kv_heads
    queries, results, kept_sets = [], [], []
    for _ in range(steps):
        cache.append_token(torch.randn(3, num_kv_heads, head_dim) * 2, torch.randn(3, num_kv_heads, head_dim))
        queries.append(torch.randn(3, num_q_heads, head_dim) * 2)
        results.append(policy.decode(queries[-1], *cache.step_inputs(), state))
        kept_sets.append(state.keep.clone())
        assert results[-1].pages is None
    for b in range(3):
        for h in range(num_kv_heads):
            heads = slice(h * group, (h + 1) * group)
            keys, values = cache.keys[b][:, h], cache.values[b][:, h]
            history = simulate(name, budget, sink, recent, prefill[b], [q[b, heads] for q in queries], keys, brute_probs)
            for step, (attended, kept) in enumerate(history):
                assert results[step].tokens_attended[b, h] == len(attended) <= budget
                assert kept_sets[step][b, h].nonzero().flatten().tolist() == kept
                probs = brute_probs(queries[step][b, heads], keys[attended][:, None])
                expected = probs @ values[attended].double()
                torch.testing.assert_close(results[step].out[b, heads].double(), expected, rtol=1e-5, atol=1e-5)


def run_steps(policy, cache, steps, num_q_heads, prefill, make_query=None):
    """Decode ``steps`` tokens after a dense prefill; returns the state and the outputs."""
    batch, num_kv_heads, head_dim = len(cache.ids), cache.cache.num_kv_heads, cache.cache.head_dim
    state = policy.init_state(torch.tensor(prefill, dtype=torch.int32), num_kv_heads)
    outputs = []
    for step in range(steps):
        cache.append_token(torch.randn(batch, num_kv_heads, head_dim), torch.randn(batch, num_kv_heads, head_dim))
        q = make_query(step) if make_query else torch.randn(batch, num_q_heads, head_dim)
        outputs.append(policy.decode(q, *cache.step_inputs(), state))
    return state, outputs


def test_streaming_keeps_exactly_sink_and_window(random_cache):
    budget, sink, prefill = 10, 3, [40, 17]
    cache = random_cache(prefill, extra_tokens=6)
    state, outputs = run_steps(make_policy("streaming", budget, page_size=4, sink_tokens=sink), cache, 6, 4, prefill)
    for b, length in enumerate(cache.cache.seq_lens[: len(prefill)].tolist()):
        expected = list(range(sink)) + list(range(length - (budget - 1 - sink), length))
        for h in range(2):
            assert state.keep[b, h].nonzero().flatten().tolist() == expected
    assert all(torch.all(out.tokens_attended == budget) for out in outputs)


def test_h2o_keeps_a_heavy_hitter_outside_the_window(cache_of):
    """Token 5's key is aligned with every query: it stays although the window has long passed it;
    tokens nobody attends are evicted first."""
    torch.manual_seed(1)
    head_dim, prefill = 8, 30
    direction = torch.nn.functional.normalize(torch.randn(head_dim), dim=0)
    keys = torch.randn(prefill, 1, head_dim) * 0.1
    keys[5, 0] = direction * 6
    cache = cache_of([keys], [torch.randn(prefill, 1, head_dim)], 4, extra_tokens=12)
    policy = make_policy("h2o", 6, page_size=4, recent_tokens=3)
    state, _ = run_steps(policy, cache, 12, 2, [prefill], lambda step: direction.expand(1, 2, head_dim) * 4)
    kept = state.keep[0, 0].nonzero().flatten().tolist()
    length = prefill + 12
    assert 5 in kept and len(kept) == 5
    assert set(range(length - 2, length)) <= set(kept)  # window of 3 minus the slot for the next token


def test_tova_dropped_tokens_are_gone_for_good(cache_of):
    """A token the first query ignores is evicted; a later query aimed at it cannot bring it back."""
    torch.manual_seed(2)
    head_dim, prefill = 4, 12
    keys = torch.randn(prefill, 1, head_dim) * 0.1
    keys[:, 0, 0] = 1.0
    keys[7, 0] = torch.tensor([-8.0, 0.0, 0.0, 8.0])  # the target
    values = torch.randn(prefill, 1, head_dim)
    values[7, 0] = 1000.0  # would dominate any output that attends it
    cache = cache_of([keys], [values], 4, extra_tokens=2)
    policy = make_policy("tova", 4, page_size=4)
    away = torch.tensor([4.0, 0.0, 0.0, 0.0]).expand(1, 1, head_dim)
    toward = torch.tensor([0.0, 0.0, 0.0, 6.0]).expand(1, 1, head_dim)
    state, outputs = run_steps(policy, cache, 2, 1, [prefill], lambda step: away if step == 0 else toward)
    assert not state.keep[0, 0, 7]
    assert outputs[1].out.abs().max() < 100
    # Dense attention with the same query would have read it.
    layer, page_table, seq_lens = cache.step_inputs()
    full = masked_decode_attention(toward, layer.k_pages, layer.v_pages, page_table, seq_lens)
    assert full.out.abs().max() > 100


def test_prefill_scores_seed_h2o(random_cache):
    prefill = [12]
    cache = random_cache(prefill, num_kv_heads=1, extra_tokens=1)
    seed = torch.rand(1, 1, 16) * 0.01
    seed[0, 0, 4] = 50.0  # the prefill's heavy hitter
    policy = make_policy("h2o", 4, page_size=4, recent_tokens=2)
    state = policy.init_state(torch.tensor(prefill, dtype=torch.int32), 1, prefill_scores=seed)
    cache.append_token(torch.randn(1, 1, 8), torch.randn(1, 1, 8))
    policy.decode(torch.randn(1, 2, 8), *cache.step_inputs(), state)
    assert state.keep[0, 0, 4]
    with pytest.raises(ValueError, match="prefill_scores must have shape"):
        policy.init_state(torch.tensor(prefill, dtype=torch.int32), 2, prefill_scores=seed)
    with pytest.raises(ValueError, match="takes no init_state options"):
        make_policy("tova", 4).init_state(torch.tensor(prefill, dtype=torch.int32), 1, prefill_scores=seed)


def test_decode_checks_its_state(random_cache):
    cache = random_cache([9], extra_tokens=2)
    policy = make_policy("tova", 4, page_size=4)
    state = policy.init_state(torch.tensor([9], dtype=torch.int32), 2)
    q = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="one token per sequence"):
        policy.decode(q, *cache.step_inputs(), state)  # no new token appended
    cache.append_token(torch.randn(1, 2, 8), torch.randn(1, 2, 8))
    with pytest.raises(ValueError, match="needs the EvictionState"):
        policy.decode(q, *cache.step_inputs(), None)
    wrong = EvictionState(state.keep[:, :1], state.lengths)
    with pytest.raises(ValueError, match="num_kv_heads"):
        policy.decode(q, *cache.step_inputs(), wrong)
    with pytest.raises(ValueError, match="stateless"):
        make_policy("quest", 16, page_size=4).decode(q, *cache.step_inputs(), state)
