"""Chunked prefill end to end on CPU: steps that mix decode tokens and prefill chunks give the tokens of unchunked
prefills (dense, Quest with a budget covering the context, a small Quest budget when the prompts are not cut, mixed
requests with their own budgets, dense rows and reused selections), chunks that end inside pages write the key
bounds an unchunked prefill writes, decodes run in every step of a long prompt's chunks, preemption and aborts
mid-prefill leak no page, prefix hits and asynchronous scheduling compose with it. The tiny random model of
``test_llm`` (page size 4 with Quest, 16 dense), fp32. Requests arrive at fixed steps while others decode
(:func:`staggered`), so that steps really mix; the launched batches show it.
"""

import dataclasses
import math
import random

import pytest
import torch

from questkv.cli_args import add_engine_args, engine_kwargs
from questkv.engine.sampling_params import SamplingParams
from tests.engine.test_llm import FULL, SMALL, VOCAB, greedy, make_llm, pool_memory, prompt
from tests.engine.test_prefix_caching import assert_pages_all_back, tokens
from tests.helpers import save_tiny_model

REUSE = dataclasses.replace(FULL, selection_interval=3)
ENGINES = {"dense": None, "quest full budget": FULL}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), VOCAB, seed=random.randrange(1 << 16))


def generate(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def recording(llm) -> list:
    """The batches ``llm``'s runner executes from now on, in order (``del llm.engine.runner.execute`` stops)."""
    launched, execute = [], llm.engine.runner.execute
    llm.engine.runner.execute = lambda batch: launched.append(batch) or execute(batch)
    return launched


def staggered(llm, requests, every: int = 3) -> tuple[list[tuple[int, ...]], list]:
    """Step ``llm``'s engine, adding ``requests[i]`` (``(prompt, params)``) before step ``i * every``, so that later
    requests arrive while earlier ones decode. Returns each request's tokens, in order, and the launched batches."""
    engine = llm.engine
    launched = recording(llm)
    ids, outputs, pending, steps = [], {}, list(requests), 0
    try:
        while pending or engine.has_unfinished_requests():
            if pending and steps % every == 0:
                ids.append(engine.add_request(*pending.pop(0)))
            outputs.update((out.request_id, out) for out in engine.step())
            steps += 1
    finally:
        del engine.runner.execute
    return [outputs[i].token_ids for i in ids], launched


def mixed_steps(launched) -> int:
    """The launched batches with decode rows and prefill rows."""
    return sum(bool(batch.num_decodes and batch.num_prefills) for batch in launched)


def arrivals(lens, max_tokens, **params):
    """Fixed (seeded) prompts of ``lens`` tokens, each with its greedy ``max_tokens``."""
    torch.manual_seed(sum(lens))
    return [(prompt(n), greedy(m, **params)) for n, m in zip(lens, max_tokens)]


# Prompts cut in chunks of at most 8 tokens (the decodes' tokens take part of each step), or never cut (8192): the
# small Quest budget's page choices could flip with the float rounding of a cut prompt's chunks, never with the
# decode rows, whose maths are the decode-only step's.
@pytest.mark.parametrize("name, budget", [("dense", 8), ("quest full budget", 8), ("quest full budget", None),
                                          ("quest small budget", None)])
def test_steps_mixing_decodes_and_prefill_chunks_give_the_tokens_of_unchunked_prefills(model_dir, name, budget):
    quest = {"dense": None, "quest full budget": FULL, "quest small budget": SMALL}[name]
    requests = arrivals([5, 37, 23, 50, 9], [30, 12, 10, 8, 15])
    chunked = make_llm(model_dir, quest, max_num_batched_tokens=budget, max_num_seqs=4, enable_prefix_caching=False)
    got, launched = staggered(chunked, requests)
    assert mixed_steps(launched) >= 3 and all(batch.num_tokens <= (budget or 8192) for batch in launched)
    assert any(batch.partial for batch in launched) == (budget is not None)
    unchunked = make_llm(model_dir, quest, enable_chunked_prefill=False, enable_prefix_caching=False)
    assert got == [out.token_ids for out in generate(unchunked, *map(list, zip(*requests)))]
    assert_pages_all_back(chunked)


def test_per_request_budgets_and_dense_rows_decode_beside_chunks_as_without_chunking(model_dir):
    quest = dataclasses.replace(SMALL, token_budget=32)
    extras = ({"dense": True}, {"token_budget": 8}, {}, {"dense": True})  # dense rows and a budget of 2 pages
    requests = [(p, dataclasses.replace(params, **extra))
                for (p, params), extra in zip(arrivals([6, 41, 29, 17], [24, 10, 12, 9]), extras)]
    chunked = make_llm(model_dir, quest, max_num_seqs=4)
    got, launched = staggered(chunked, requests, every=2)
    assert mixed_steps(launched) >= 2
    unchunked = make_llm(model_dir, quest, enable_chunked_prefill=False)
    assert got == [out.token_ids for out in generate(unchunked, *map(list, zip(*requests)))]
    assert_pages_all_back(chunked)


# Chunks of one Quest page (4 tokens), of one and a half pages, and ending anywhere (13); dense pages are 16 tokens.
@pytest.mark.parametrize("chunk", [4, 6, 13])
@pytest.mark.parametrize("name", ENGINES)
def test_chunked_prefill_gives_the_tokens_of_an_unchunked_prefill(model_dir, name, chunk):
    quest = ENGINES[name]
    unchunked = make_llm(model_dir, quest, enable_chunked_prefill=False, enable_prefix_caching=False)
    chunked = make_llm(model_dir, quest, max_num_batched_tokens=chunk, max_num_seqs=4, enable_prefix_caching=False)
    # A prompt of exactly one chunk, one of a whole number of chunks, and ragged ones; a forced and a seeded request.
    prompts = [prompt(chunk), prompt(3 * chunk), prompt(random.randint(40, 90)), prompt(random.randint(1, 30))]
    params = [greedy(10), greedy(12, forced_token_ids=prompt(4)),
              SamplingParams(temperature=0.8, seed=random.randrange(1 << 30), max_tokens=9, ignore_eos=True), greedy(7)]
    launched = recording(chunked)
    outs = generate(chunked, prompts, params)
    refs = generate(unchunked, prompts, params)
    assert tokens(outs) == tokens(refs)
    for out, ref in zip(outs, refs):
        assert out.forced_logprobs == pytest.approx(ref.forced_logprobs, abs=1e-4)
    assert all(batch.num_tokens <= chunk for batch in launched) and any(batch.partial for batch in launched)
    assert mixed_steps(launched)
    assert_pages_all_back(chunked)


def test_quest_requests_with_their_own_budgets_and_reused_selections_are_unchanged_by_chunking(model_dir):
    unchunked = make_llm(model_dir, REUSE, enable_chunked_prefill=False)
    chunked = make_llm(model_dir, REUSE, max_num_batched_tokens=6, max_num_seqs=3)
    prompts = [prompt(random.randint(20, 60)) for _ in range(3)]
    params = [greedy(12), greedy(12, token_budget=8), greedy(11, selection_interval=2)]
    launched = recording(chunked)
    assert tokens(generate(chunked, prompts, params)) == tokens(generate(unchunked, prompts, params))
    assert mixed_steps(launched)  # reused selections of decode rows beside chunks (the prefill rows' restart)
    del chunked.engine.runner.execute
    # Requests arriving while the others decode with reused selections: the prefill restarts only its own slot's.
    requests = arrivals([9, 44, 21], [20, 9, 10])
    requests = [(p, dataclasses.replace(sp, **extra)) for (p, sp), extra in
                zip(requests, ({}, {"selection_interval": 2}, {"token_budget": 8}))]
    got, launched = staggered(chunked, requests, every=4)
    assert mixed_steps(launched) and got == [out.token_ids for out in generate(unchunked, *map(list, zip(*requests)))]
    # A dense request alone: in a batch, its steps make every Quest row select afresh (reuse off), whenever it runs.
    dense = [prompt(45)]
    assert tokens(generate(chunked, dense, greedy(10, dense=True))) == tokens(
        generate(unchunked, dense, greedy(10, dense=True)))


@pytest.mark.parametrize("chunk", [4, 6])
def test_a_chunked_prefill_writes_the_key_bounds_of_an_unchunked_one(model_dir, chunk):
    pools = []
    p = prompt(31)  # 7 full pages and a partial one; chunks of 6 end inside pages
    for kwargs in ({"enable_chunked_prefill": False}, {"max_num_batched_tokens": chunk, "max_num_seqs": 1}):
        llm = make_llm(model_dir, SMALL, enable_prefix_caching=False, **kwargs)
        engine = llm.engine
        engine.add_request(p, greedy(4))
        while not engine.scheduler.running or engine.scheduler.prefilling is not None:
            engine.step()
        (seq,) = engine.scheduler.running
        cache = engine.cache
        assert seq.num_output_tokens == 1 and cache.seq_len(seq.cache_id) == 31
        pages = torch.tensor(cache.pages_of(seq.cache_id))
        keys = cache.k_pages[:, pages].clone()  # [layers, 8, page, Hkv, D]
        keys[:, -1, 31 % 4:] = float("nan")  # the last page's unwritten slots
        kmin, kmax = cache.kmin[:, pages], cache.kmax[:, pages]
        # Each page's bounds are exactly the min and max of the keys written in it, however the chunks split it.
        assert torch.equal(kmin, torch.fmin(keys, keys.nan_to_num(float("inf"))).amin(2))
        assert torch.equal(kmax, keys.nan_to_num(float("-inf")).amax(2))
        pools.append((keys.nan_to_num(0.0), kmin, kmax))
    for chunked, unchunked in zip(pools[1], pools[0]):  # the same K up to float rounding of the chunks' attention
        torch.testing.assert_close(chunked, unchunked, rtol=1e-5, atol=1e-5)


def test_running_decodes_advance_in_every_step_of_the_chunks_of_a_long_prompt(model_dir):
    llm = make_llm(model_dir, SMALL, max_num_batched_tokens=8, max_num_seqs=4)
    engine = llm.engine
    launched = recording(llm)
    short = engine.add_request(prompt(5), greedy(30))
    engine.step()  # the short prompt's prefill
    long = engine.add_request(prompt(70), greedy(5))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    chunks = [i for i, batch in enumerate(launched) if long in {s.request_id for s in batch.seqs[batch.num_decodes:]}]
    assert len(chunks) == math.ceil(70 / 7) and chunks == list(range(chunks[0], chunks[-1] + 1))
    for i in chunks:  # the short request decodes in the step of every chunk: 7 prompt tokens and its 1
        batch = launched[i]
        assert [s.request_id for s in batch.seqs] == [short, long] and batch.num_new_tokens == (1, 7)
        assert batch.num_decodes == 1 and batch.partial == (i != chunks[-1])
    reference = make_llm(model_dir, SMALL, enable_chunked_prefill=False)
    (ref_short,), (ref_long,) = (generate(reference, [p], sp) for p, sp in
                                 ((outputs[short].prompt_token_ids, greedy(30)),
                                  (outputs[long].prompt_token_ids, greedy(5))))
    assert outputs[short].token_ids == ref_short.token_ids and outputs[long].token_ids == ref_long.token_ids


@pytest.mark.parametrize("name", ENGINES)
def test_preempted_requests_with_chunked_prefill_give_the_tokens_of_an_unconstrained_run(model_dir, name):
    quest = ENGINES[name]
    unconstrained = make_llm(model_dir, quest, max_model_len=64, enable_chunked_prefill=False)
    per_seq = math.ceil(64 / unconstrained.config.page_size)
    tiny = make_llm(model_dir, quest, max_model_len=64, kv_cache_memory=pool_memory(unconstrained, per_seq + 2),
                    max_num_batched_tokens=5, max_num_seqs=4, enable_prefix_caching=False)
    prompts = [prompt(random.randint(3, 8)) for _ in range(2)] + [prompt(random.randint(20, 30)) for _ in range(2)]
    params = [greedy(50), greedy(40), greedy(30), greedy(25)]
    launched = recording(tiny)
    outputs = generate(tiny, prompts, params)
    assert sum(out.metrics.num_preemptions for out in outputs) > 0 and mixed_steps(launched)
    assert tokens(outputs) == tokens(generate(unconstrained, prompts, params))
    assert_pages_all_back(tiny)


def test_a_request_preempted_mid_prefill_restarts_and_gives_the_tokens_of_an_unconstrained_run(model_dir):
    unconstrained = make_llm(model_dir, FULL, max_model_len=64, enable_chunked_prefill=False)
    tiny = make_llm(model_dir, FULL, max_model_len=64, kv_cache_memory=pool_memory(unconstrained, 18),
                    max_num_batched_tokens=2, max_num_seqs=2, enable_prefix_caching=False)
    engine = tiny.engine
    # 17 pages for requests: the long prompt's 12 pages fit when it is admitted, but the short request's decodes,
    # one in each step of its one-token chunks, take pages as fast as its chunks do, until a chunk finds none.
    prompts, params = [prompt(4), prompt(48)], [greedy(59), greedy(2)]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outputs, preempted_mid_prefill = {}, False
    while engine.has_unfinished_requests():
        before = engine.scheduler.prefilling
        for out in engine.step():
            outputs[out.request_id] = out
        preempted_mid_prefill |= before is not None and before.cache_id is None and not before.is_finished
    assert preempted_mid_prefill and outputs[ids[1]].metrics.num_preemptions >= 1
    assert [outputs[i].token_ids for i in ids] == [out.token_ids for out in generate(unconstrained, prompts, params)]
    assert_pages_all_back(tiny)


def test_an_aborted_request_mid_prefill_frees_its_pages_and_the_others_are_unchanged(model_dir):
    llm = make_llm(model_dir, SMALL, max_num_batched_tokens=8, max_num_seqs=4)
    engine = llm.engine
    first = engine.add_request(prompt(6), greedy(12))
    engine.step()
    engine.add_request(prompt(40), greedy(5), request_id="long")
    while engine.scheduler.prefilling is None or engine.cache.seq_len(engine.scheduler.prefilling.cache_id) <= 8:
        engine.step()
    assert engine.scheduler.prefilling is not None and engine.cache.seq_len(engine.scheduler.prefilling.cache_id) > 8
    assert engine.abort_request("long") and engine.scheduler.prefilling is None
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((out.request_id, out) for out in engine.step())
    assert set(outs) == {first}
    assert_pages_all_back(llm)


def test_chunks_start_on_a_prefix_hit_and_a_concurrent_request_hits_the_chunks_pages(model_dir):
    chunked = make_llm(model_dir, SMALL, max_num_batched_tokens=8, max_num_seqs=4)
    reference = make_llm(model_dir, SMALL, enable_chunked_prefill=False, enable_prefix_caching=False)
    document = prompt(40)
    first = [document + prompt(3), document + prompt(5)]  # the second waits for the first's chunks, then hits them
    launched = recording(chunked)
    outs = generate(chunked, first, greedy(6))
    assert [out.metrics.num_cached_tokens for out in outs] == [0, 40]
    later = [document + prompt(30)]  # a hit of 40 tokens, then 30 more in chunks of 8
    outs += generate(chunked, later, greedy(6))
    assert outs[-1].metrics.num_cached_tokens == 40
    last = [batch for batch in launched if batch.num_prefills][-4:]
    assert [batch.seq_lens[-1] - batch.num_new_tokens[-1] for batch in last] == [40, 48, 56, 64]
    assert tokens(outs) == tokens(generate(reference, first + later, greedy(6)))
    assert_pages_all_back(chunked)


@pytest.mark.parametrize("name", ["dense", "quest small budget"])
def test_asynchronous_scheduling_with_chunked_prefill_gives_the_synchronous_tokens(model_dir, name):
    quest = None if name == "dense" else SMALL
    prompts = [prompt(random.randint(2, 10)), prompt(random.randint(30, 60)), prompt(random.randint(30, 60))]
    params = [greedy(20), greedy(9), SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)]
    runs = []
    for async_scheduling in (False, True):
        llm = make_llm(model_dir, quest, async_scheduling=async_scheduling, max_num_batched_tokens=7, max_num_seqs=3)
        launched = recording(llm)
        runs.append(tokens(generate(llm, prompts, params)))
        assert mixed_steps(launched)  # decode rows reading the tokens in flight beside chunks
        assert_pages_all_back(llm)
    assert runs[0] == runs[1]
    assert runs[0] == tokens(generate(make_llm(model_dir, quest, enable_chunked_prefill=False), prompts, params))


def test_the_engine_flags_turn_chunked_prefill_on_and_off_and_size_the_chunks():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser, serving=True)
    assert "enable_chunked_prefill" not in engine_kwargs(parser.parse_args([]))
    assert engine_kwargs(parser.parse_args(["--enable-chunked-prefill"]))["enable_chunked_prefill"] is True
    assert engine_kwargs(parser.parse_args(["--no-enable-chunked-prefill"]))["enable_chunked_prefill"] is False
    assert engine_kwargs(parser.parse_args(["--max-num-batched-tokens", "2048"]))["max_num_batched_tokens"] == 2048
    assert "--no-enable-chunked-prefill" in parser.format_help()
