"""Automatic prefix caching end to end on CPU: a hit gives the tokens of ``enable_prefix_caching=False`` (dense,
Quest, mixed, selection reuse, teacher forcing), multi-turn conversations hit, preemption, aborts and eviction keep
the pages right. The tiny random model of ``test_llm`` (page size 4), fp32: greedy tokens must match exactly.
"""

import dataclasses
import math
import random

import pytest

from questkv.cli_args import add_engine_args, engine_kwargs
from questkv.engine.sampling_params import SamplingParams
from tests.engine.test_llm import FULL, SMALL, VOCAB, greedy, make_llm, pool_memory, prompt
from tests.helpers import save_tiny_model

REUSE = dataclasses.replace(SMALL, selection_interval=3)
ENGINES = {"dense": None, "quest full budget": FULL, "quest small budget": SMALL, "quest reusing selections": REUSE}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), VOCAB, seed=random.randrange(1 << 16))


def generate(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def tokens(outputs):
    return [(out.token_ids, out.forced_choices) for out in outputs]


def distinct(n):
    """``n`` different token ids: the first tokens of questions that must not be copies of one another."""
    return random.sample(range(2, VOCAB), n)


def expected_hit(tokens, cached, page):
    """Tokens of ``tokens`` a prefix cache holding the token lists ``cached`` finds: the longest common prefix in
    whole pages, leaving at least one token to compute."""
    common = max((next((i for i, (a, b) in enumerate(zip(tokens, c)) if a != b), min(len(tokens), len(c)))
                  for c in cached), default=0)
    return min(common // page, (len(tokens) - 1) // page) * page


def assert_pages_all_back(llm):
    cache = llm.engine.cache
    scratch = cache.pages_of(llm.engine.runner.scratch_seq)  # (one page; a lossless engine's padding rows take more)
    assert cache.sequences == [llm.engine.runner.scratch_seq] and cache.num_free_pages == cache.num_pages - len(scratch)
    assert all(cache.refcount(page) == 0 for page in range(cache.num_pages) if page not in scratch)


@pytest.mark.parametrize("name", ENGINES)
def test_requests_sharing_a_prefix_give_the_tokens_of_an_engine_without_prefix_caching(model_dir, name):
    cached, uncached = make_llm(model_dir, ENGINES[name]), make_llm(model_dir, ENGINES[name], enable_prefix_caching=False)
    document = prompt(37)
    first = [document + prompt(3)]
    # One request fills the cache; then a batch: the prefix again with new questions (one a whole number of pages
    # long, whose last token is recomputed), a copy of one of them, a dense request and one with a smaller budget.
    rest = [document + prompt(5), document[:32], document + prompt(9), document + prompt(5)]
    rest[3] = rest[0]
    params = [greedy(12), greedy(10), greedy(12, **({"dense": True} if ENGINES[name] else {})),
              greedy(8, **({"token_budget": 8} if ENGINES[name] else {}))]
    want = tokens(generate(uncached, first, greedy(12)) + generate(uncached, rest, params))
    got_first = generate(cached, first, greedy(12))
    got_rest = generate(cached, rest, params)
    assert tokens(got_first + got_rest) == want
    assert got_first[0].metrics.num_cached_tokens == 0
    # Hits are whole pages, and leave at least one token to compute, the copy's too (on pages of its own step).
    page = cached.config.page_size
    seen = [first[0] + list(got_first[0].token_ids[:-1])]
    hits = [expected_hit(p, seen + rest[:i], page) for i, p in enumerate(rest)]
    assert [out.metrics.num_cached_tokens for out in got_rest] == hits and hits[0] >= 32
    scheduler = cached.engine.scheduler
    assert scheduler.prefix_hit_tokens == sum(hits) and scheduler.prefix_queried_tokens == 40 + 42 + 32 + 46 + 42
    assert uncached.engine.scheduler.prefix_queried_tokens == 0 and uncached.engine.cache.num_cached_pages == 0
    assert_pages_all_back(cached)


def test_prompts_sharing_a_prefix_in_one_step_compute_it_once(model_dir):
    llm = make_llm(model_dir, SMALL)
    document = prompt(40)
    prompts = [document + [first] + prompt(random.randint(0, 5)) for first in distinct(4)]
    computed = []
    hook = llm.engine.runner.model.register_forward_pre_hook(lambda module, args: computed.append(args[0].numel()))
    outputs = generate(llm, prompts, greedy(6))
    hook.remove()
    # The first computes its 40 + k tokens; the others find its pages, written in the same step before they are read.
    assert computed[0] == len(prompts[0]) + sum(len(p) - 40 for p in prompts[1:])
    assert [out.metrics.num_cached_tokens for out in outputs] == [0, 40, 40, 40]
    uncached = make_llm(model_dir, SMALL, enable_prefix_caching=False)
    assert tokens(outputs) == tokens(generate(uncached, prompts, greedy(6)))


@pytest.mark.parametrize("name", ["dense", "quest small budget"])
def test_a_multi_turn_conversation_hits_its_earlier_turns(model_dir, name):
    cached, uncached = make_llm(model_dir, ENGINES[name]), make_llm(model_dir, ENGINES[name], enable_prefix_caching=False)
    conversation, page, cached_before = prompt(23), cached.config.page_size, 0
    for _ in range(3):
        (out,) = generate(cached, [conversation], greedy(9))
        (ref,) = generate(uncached, [conversation], greedy(9))
        assert out.token_ids == ref.token_ids
        # The earlier turns' prompts and, dense, answers (all but the last answer token, never written) are cached;
        # answers that sparse decode steps computed are not (their K/V are not a prefill's).
        assert out.metrics.num_cached_tokens == (cached_before // page) * page
        cached_before = len(conversation) + (len(out.token_ids) - 1 if ENGINES[name] is None else 0)
        conversation = conversation + list(out.token_ids) + prompt(6)
    assert_pages_all_back(cached)


def test_teacher_forced_requests_on_a_cached_prefix_give_the_uncached_log_probabilities(model_dir):
    cached, uncached = make_llm(model_dir, REUSE), make_llm(model_dir, REUSE, enable_prefix_caching=False)
    document = prompt(30)
    prompts = [document + prompt(2), document + prompt(7)]
    params = [greedy(8, forced_token_ids=prompt(4)), greedy(6, forced_token_ids=prompt(6))]
    generate(cached, [document + [3]], greedy(2))
    outs = generate(cached, prompts, params)
    refs = generate(uncached, prompts, params)
    assert tokens(outs) == tokens(refs) and all(out.metrics.num_cached_tokens == 28 for out in outs)
    for out, ref in zip(outs, refs):
        assert out.forced_logprobs == pytest.approx(ref.forced_logprobs, abs=1e-4)


@pytest.mark.parametrize("name", ["dense", "quest full budget"])
def test_preempted_requests_sharing_pages_give_the_tokens_of_an_unconstrained_run(model_dir, name):
    quest = ENGINES[name]
    unconstrained = make_llm(model_dir, quest, max_model_len=64, enable_prefix_caching=False)
    per_seq = math.ceil(64 / unconstrained.config.page_size)
    tiny = make_llm(model_dir, quest, max_model_len=64, kv_cache_memory=pool_memory(unconstrained, per_seq + 2))
    document = prompt(16)  # a whole page of either engine (16 tokens dense, 4 with Quest)
    prompts = [document + [first] + prompt(random.randint(0, 5)) for first in distinct(4)]
    params = [greedy(30), greedy(36), SamplingParams(temperature=0.8, seed=random.randrange(1 << 30), max_tokens=30,
                                                     ignore_eos=True), greedy(25)]
    outputs = generate(tiny, prompts, params)
    assert sum(out.metrics.num_preemptions for out in outputs) > 0
    assert [out.metrics.num_cached_tokens for out in outputs] == [0, 16, 16, 16]
    assert tokens(outputs) == tokens(generate(unconstrained, prompts, params))
    assert_pages_all_back(tiny)


def test_aborted_requests_release_their_shared_pages_and_leave_them_cached(model_dir):
    llm = make_llm(model_dir, SMALL)
    engine, cache = llm.engine, llm.engine.cache
    document = prompt(24)
    ids = [engine.add_request(document + prompt(k), greedy(20)) for k in (1, 2, 3)]
    engine.step()  # one prefill: the later two share the first's six pages
    shared = cache.pages_of(engine.scheduler.running[0].cache_id)[:6]
    assert [cache.refcount(page) for page in shared] == [3] * 6
    engine.step()
    engine.abort_request(ids[1])
    assert [cache.refcount(page) for page in shared] == [2] * 6
    for request_id in ids[::2]:
        engine.abort_request(request_id)
    assert not engine.has_unfinished_requests() and cache.num_cached_pages >= 6
    assert_pages_all_back(llm)
    (out,) = generate(llm, [document + prompt(4)], greedy(3))
    assert out.metrics.num_cached_tokens == 24


def test_a_small_pool_evicts_the_least_recently_used_prefixes_and_stays_correct(model_dir):
    probe = make_llm(model_dir, FULL, max_model_len=64)
    llm = make_llm(model_dir, FULL, max_model_len=64, kv_cache_memory=pool_memory(probe, 20))
    uncached = make_llm(model_dir, FULL, max_model_len=64, enable_prefix_caching=False)
    cache = llm.engine.cache
    documents = [prompt(32) for _ in range(4)]  # 8 pages each, 19 pages for requests: at most two stay cached
    for document in documents:
        generate(llm, [document + [5]], greedy(2))
        assert cache.num_cached_pages <= cache.num_pages
    assert cache.num_free_pages == cache.num_pages - 1
    outs = generate(llm, [documents[3] + [7], documents[0] + [7]], [greedy(4), greedy(4)])
    assert [out.metrics.num_cached_tokens for out in outs] == [32, 0]  # the newest hits, the oldest was evicted
    assert tokens(outs) == tokens(generate(uncached, [documents[3] + [7], documents[0] + [7]], greedy(4)))
    assert_pages_all_back(llm)


def test_the_engine_flags_turn_prefix_caching_on_and_off():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert "enable_prefix_caching" not in engine_kwargs(parser.parse_args([]))
    assert engine_kwargs(parser.parse_args(["--enable-prefix-caching"]))["enable_prefix_caching"] is True
    assert engine_kwargs(parser.parse_args(["--no-enable-prefix-caching"]))["enable_prefix_caching"] is False
    assert engine_kwargs(parser.parse_args(["--no-prefix-caching"]))["enable_prefix_caching"] is False


@pytest.mark.parametrize("name", ["dense", "quest small budget"])
def test_asynchronous_scheduling_with_prefix_hits_gives_the_synchronous_tokens(model_dir, name):
    document = prompt(29)
    prompts = [document + prompt(k) for k in (2, 5, 11)] + [document[:12]]
    params = [greedy(14), greedy(9), SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True),
              greedy(6)]
    runs = []
    for async_scheduling in (False, True):
        llm = make_llm(model_dir, ENGINES[name], async_scheduling=async_scheduling)
        first = generate(llm, prompts[:1], params[:1])
        runs.append(tokens(first + generate(llm, prompts[1:], params[1:])))
        assert_pages_all_back(llm)
    assert runs[0] == runs[1]


def test_a_failed_step_forgets_the_cached_prefixes(model_dir):
    llm = make_llm(model_dir, SMALL)
    engine, cache = llm.engine, llm.engine.cache
    document = prompt(24)
    generate(llm, [document + [3]], greedy(2))
    assert cache.num_cached_pages >= 6
    execute = engine.runner.execute

    def fail(batch):
        raise RuntimeError("device lost")

    engine.runner.execute = fail
    engine.add_request(prompt(30), greedy(2), request_id="x")
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()  # its pages were registered when it was scheduled, but never written
    assert cache.num_cached_pages == 0
    engine.abort_request("x")
    engine.runner.execute = execute
    assert_pages_all_back(llm)
    (out,) = generate(llm, [document + [4]], greedy(2))
    assert out.metrics.num_cached_tokens == 0
