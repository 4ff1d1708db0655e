"""Asynchronous scheduling (``EngineConfig.async_scheduling``) on CPU: the engine launches step N+1 before it
reads step N's tokens, and must give exactly the synchronous loop's outputs.

On CPU each step still runs to its end before ``execute`` returns, but everything that differs from the
synchronous loop runs: inputs read from the previous step's tokens on the device, updates one step late,
sequences finished by length not scheduled again, discarded steps after stops, preemption and aborts with
tokens in flight. The tiny random model and prompts of ``test_llm.py``; fp32, so tokens match exactly.
"""

import dataclasses
import random

import pytest

from questkv import QuestConfig
from questkv.engine.sampling_params import SamplingParams
from tests.engine.test_llm import PAGE, VOCAB, greedy, make_llm, pool_memory, prompt, reference_with_new_token
from tests.helpers import save_tiny_model

QUEST = QuestConfig(token_budget=16, page_size=PAGE, dense_layers=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), VOCAB, seed=random.randrange(1 << 16))


def outcome(out) -> tuple:
    """What must not depend on the scheduling mode."""
    return (out.token_ids, out.text, out.finish_reason, out.stop_reason, out.metrics.mean_tokens_attended,
            out.metrics.selection_rate)


def mixed_requests(quest) -> tuple[list, list]:
    """Ragged prompts with greedy, seeded and EOS-ending requests, stop tokens and stop strings, and on a Quest
    engine per-request budgets and a dense request."""
    prompts, params = [], []
    for i in range(10):
        prompts.append(prompt(random.randint(1, 60)))
        kwargs = {"max_tokens": random.randint(1, 24)}
        if i % 3 == 1:
            kwargs.update(temperature=0.9, seed=random.randrange(1 << 30), top_p=0.9)
        else:
            kwargs.update(temperature=0)
        if i % 4 == 0:
            kwargs["stop_token_ids"] = random.sample(range(2, VOCAB), 8)
        if i % 4 == 2:
            kwargs["stop"] = [f"x{random.randrange(2, VOCAB):02d}" for _ in range(4)]
        kwargs["ignore_eos"] = i % 5 != 0
        if quest is not None and i % 3 == 2:
            kwargs["token_budget"] = random.choice([8, 12])
        if quest is not None and i == 7:
            kwargs["dense"] = True
        params.append(SamplingParams(**kwargs))
    return prompts, params


@pytest.mark.parametrize("quest", [None, QUEST, dataclasses.replace(QUEST, selection_interval=3)],
                         ids=["dense", "quest", "quest reusing selections"])
def test_async_scheduling_gives_the_synchronous_outputs_for_ragged_mixed_requests(model_dir, quest):
    prompts, params = mixed_requests(quest)
    sync = make_llm(model_dir, quest, async_scheduling=False).generate(prompts, params, use_tqdm=False)
    asynchronous = make_llm(model_dir, quest, async_scheduling=True).generate(prompts, params, use_tqdm=False)
    assert [outcome(out) for out in asynchronous] == [outcome(out) for out in sync]


def test_async_scheduling_under_preemption_gives_the_tokens_of_an_unconstrained_run(model_dir):
    unconstrained = make_llm(model_dir, max_model_len=64)
    per_seq = 64 // unconstrained.config.page_size
    tiny = make_llm(model_dir, max_model_len=64, kv_cache_memory=pool_memory(unconstrained, per_seq + 2),
                    async_scheduling=True)
    prompts = [prompt(random.randint(10, 24)) for _ in range(4)]
    params = [greedy(30), greedy(36), SamplingParams(temperature=0.8, seed=random.randrange(1 << 30), max_tokens=30,
                                                     ignore_eos=True), greedy(25)]
    outputs = tiny.generate(prompts, params, use_tqdm=False)
    assert sum(out.metrics.num_preemptions for out in outputs) > 0
    assert [out.token_ids for out in outputs] == [o.token_ids for o in unconstrained.generate(prompts, params,
                                                                                            use_tqdm=False)]
    assert tiny.engine.cache.num_free_pages == per_seq + 1  # everything back but the scratch page


def drive(llm, prompts, params, abort_at: dict[int, int], join_at: dict[int, int]) -> dict[str, object]:
    """Step ``llm``'s engine by hand: request ``i`` joins at step ``join_at.get(i, 0)`` and is aborted at step
    ``abort_at[i]``; returns the last output of every request."""
    engine, last, ids, step = llm.engine, {}, {}, 0
    while step == 0 or engine.has_unfinished_requests() or len(ids) < len(prompts):
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if join_at.get(i, 0) == step:
                ids[i] = engine.add_request(p, sp)
            if abort_at.get(i) == step:
                engine.abort_request(ids[i])
        for out in engine.step():
            last[out.request_id] = out
        step += 1
    return {i: last.get(request_id) for i, request_id in ids.items()}


def test_async_scheduling_with_requests_joining_and_aborted_mid_run_frees_every_page_and_keeps_the_others(
        model_dir):
    prompts = [prompt(random.randint(1, 40)) for _ in range(6)]
    params = [greedy(random.randint(8, 20)) for _ in prompts]
    join_at, abort_at = {3: 2, 4: 5, 5: 6}, {1: 4, 4: 7}
    sync_llm = make_llm(model_dir, QUEST, async_scheduling=False)
    async_llm = make_llm(model_dir, QUEST, async_scheduling=True)
    sync = drive(sync_llm, prompts, params, abort_at, join_at)
    asynchronous = drive(async_llm, prompts, params, abort_at, join_at)
    for i in range(len(prompts)):
        if i in abort_at:  # aborted before it could finish; the async engine reported one step fewer of it
            assert all(run[i] is None or not run[i].finished for run in (sync, asynchronous))
            continue
        assert outcome(asynchronous[i]) == outcome(sync[i])
    for llm in (sync_llm, async_llm):
        cache = llm.engine.cache
        assert cache.sequences == [llm.engine.runner.scratch_seq] and cache.num_free_pages == cache.num_pages - 1


def count_steps(llm) -> list:
    """Wrap ``llm``'s runner so that every launched step is recorded; returns the record."""
    launched, execute = [], llm.engine.runner.execute

    def counting(batch):
        launched.append(batch)
        return execute(batch)

    llm.engine.runner.execute = counting
    return launched


def test_a_request_ending_by_length_costs_no_extra_step_and_one_stopping_on_a_token_at_most_one(model_dir):
    sync_llm, async_llm = make_llm(model_dir, async_scheduling=False), make_llm(model_dir, async_scheduling=True)
    p, ref, k = reference_with_new_token(sync_llm, random.randint(3, 30), 16)  # ref[k] first appears at k
    for params, tokens in ((greedy(16), 16), (greedy(16, stop_token_ids=[ref[k]]), k + 1)):
        steps = {}
        for name, llm in (("sync", sync_llm), ("async", async_llm)):
            launched = count_steps(llm)
            (out,) = llm.generate([p], params, use_tqdm=False)
            assert out.token_ids == ref[:tokens]
            steps[name] = len(launched)
        assert steps["sync"] == tokens  # the prefill samples the first token, each decode step one more
        assert steps["async"] == tokens + (0 if tokens == 16 else 1)


def test_async_scheduling_is_on_by_default_only_with_cuda_graphs(model_dir):
    assert not make_llm(model_dir).config.use_async_scheduling  # CPU: eager
    assert make_llm(model_dir, async_scheduling=True).config.use_async_scheduling
    with pytest.raises(ValueError, match="EngineConfig.async_scheduling"):
        make_llm(model_dir, async_scheduling="yes")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failing_step_aborts_the_calls_requests_and_the_engine_serves_the_next_call(model_dir, async_scheduling):
    llm = make_llm(model_dir, QUEST, async_scheduling=async_scheduling)
    execute, calls = llm.engine.runner.execute, []

    def failing_third(batch):
        calls.append(batch)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return execute(batch)

    llm.engine.runner.execute = failing_third
    prompts = [prompt(random.randint(5, 30)) for _ in range(3)]
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.generate(prompts, greedy(8), use_tqdm=False)
    cache = llm.engine.cache
    assert not llm.engine.has_unfinished_requests() and cache.sequences == [llm.engine.runner.scratch_seq]
    llm.engine.runner.execute = execute
    fresh = make_llm(model_dir, QUEST, async_scheduling=async_scheduling)
    assert [o.token_ids for o in llm.generate(prompts, greedy(8), use_tqdm=False)] == [
        o.token_ids for o in fresh.generate(prompts, greedy(8), use_tqdm=False)]
