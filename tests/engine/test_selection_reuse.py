"""Selection reuse in the engine (``QuestConfig.selection_interval``) on CPU, fp32: a budget covering the context is
still dense at any interval, a sequence's tokens do not depend on what shares its batch (its phase is its own), a
request may lower the interval, and the estimate and select ops run only for the rows whose step is due. The tiny
random model and prompts of ``test_llm.py``."""

import dataclasses
import math
import random

import pytest

from questkv import QuestConfig
from questkv.engine.sampling_params import SamplingParams
from questkv.ops import reference
from tests.engine.test_llm import (
    FULL, LAYERS, PAGE, SMALL, VOCAB, alone, greedy, make_llm, pool_memory, prompt, run,
)
from tests.helpers import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), VOCAB, seed=random.randrange(1 << 16))


def reusing(quest: QuestConfig, interval: int) -> QuestConfig:
    return dataclasses.replace(quest, selection_interval=interval)


@pytest.mark.parametrize("interval", [2, 3, 7])
def test_a_budget_covering_the_context_gives_the_dense_tokens_at_any_interval(model_dir, interval):
    prompts = [prompt(random.randint(1, 90)) for _ in range(4)]
    params = [greedy(random.randint(10, 30)) for _ in prompts]
    assert run(make_llm(model_dir, reusing(FULL, interval)), prompts, params) == run(make_llm(model_dir), prompts, params)


def test_preemption_with_a_budget_covering_the_context_gives_the_dense_tokens(model_dir):
    quest = dataclasses.replace(FULL, selection_interval=3)
    unconstrained = make_llm(model_dir, FULL, max_model_len=64)
    per_seq = math.ceil(64 / PAGE)
    tiny = make_llm(model_dir, quest, max_model_len=64,
                    kv_cache_memory=pool_memory(unconstrained, per_seq + 2))
    assert tiny.engine.cache.num_pages == per_seq + 2
    prompts = [prompt(random.randint(10, 24)) for _ in range(4)]
    params = [greedy(30), greedy(36), greedy(30), greedy(25)]
    outputs = tiny.generate(prompts, params, use_tqdm=False)
    assert sum(out.metrics.num_preemptions for out in outputs) > 0
    assert [out.token_ids for out in outputs] == run(make_llm(model_dir, max_model_len=64), prompts, params)


@pytest.mark.parametrize("interval", [2, 5])
def test_batched_requests_of_ragged_lengths_give_each_requests_tokens_alone(model_dir, interval):
    llm = make_llm(model_dir, reusing(SMALL, interval))
    lens = [1, random.randint(2, 8), random.randint(9, 40), random.randint(41, 100)]
    random.shuffle(lens)
    prompts = [prompt(n) for n in lens]
    params = [greedy(random.randint(1, 24), token_budget=random.choice([None, 8])) for _ in prompts]
    assert run(llm, prompts, params) == alone(llm, prompts, params)


def test_a_request_lowering_the_interval_to_one_gets_the_tokens_of_an_engine_that_selects_every_step(model_dir):
    prompts = [prompt(random.randint(30, 90)) for _ in range(3)]
    every_step = run(make_llm(model_dir, SMALL), prompts, greedy(20))
    assert run(make_llm(model_dir, reusing(SMALL, 4)), prompts, greedy(20, selection_interval=1)) == every_step


def test_the_estimate_and_select_run_only_for_the_rows_whose_step_is_due_and_not_at_all_when_none_is(
        model_dir, monkeypatch):
    interval, max_tokens = 4, 20
    llm = make_llm(model_dir, reusing(SMALL, interval))
    step_index = 0
    flags: dict[int, list[list[int]]] = {}  # engine step -> the active flags of each sparse layer's estimate
    page_scores_into = reference.page_scores_into

    def spy(*args, active=None, **kwargs):
        flags.setdefault(step_index, []).append(active.tolist())
        return page_scores_into(*args, active=active, **kwargs)

    monkeypatch.setattr(reference, "page_scores_into", spy)
    prompts = [prompt(40), prompt(41)]
    # the second request joins one step later (its phase is its own) and finishes first
    engine = llm.engine
    engine.add_request(prompts[0], greedy(max_tokens))
    engine.step()  # prefill of the first
    engine.add_request(prompts[1], greedy(8, selection_interval=3))
    engine.step()  # the first's decode step 0 and the second's prefill: a mixed step
    decode_steps = []
    while engine.has_unfinished_requests():
        step_index += 1
        decode_steps.append(step_index)
        engine.step()
    sparse_layers = LAYERS - SMALL.dense_layers
    # decode step k of the first request is engine step k (k >= 1), the second's step k - 1
    expected = {}
    for k in decode_steps:
        due = [int(k % interval == 0)] + ([int((k - 1) % 3 == 0)] if k - 1 < 8 - 1 else [])
        if any(due):
            expected[k] = [due] * sparse_layers
    assert flags.pop(0) == [[1]] * sparse_layers  # the mixed step: the first request's first decode step selects
    assert flags == expected
    assert len(decode_steps) == max_tokens - 2
    assert len(expected) < len(decode_steps)  # some steps launched no estimate


def test_mean_tokens_attended_counts_the_pages_begun_since_the_selection(model_dir):
    interval = 6
    p = prompt(random.randint(30, 40))
    (out,) = make_llm(model_dir, reusing(SMALL, interval)).generate([p], greedy(20), use_tqdm=False)
    per_step = []
    for k in range(19):  # decode step k feeds output k
        context = len(p) + 1 + k
        made_at = context - k % interval
        pages = min(math.ceil(made_at / PAGE), SMALL.budget_pages) + math.ceil(context / PAGE) - math.ceil(made_at / PAGE)
        per_step.append((context + 2 * pages * PAGE) / LAYERS)
    assert out.metrics.mean_tokens_attended == pytest.approx(sum(per_step) / len(per_step))


def test_an_interval_the_engine_cannot_serve_is_refused_before_anything_runs(model_dir):
    llm = make_llm(model_dir, reusing(SMALL, 3))
    with pytest.raises(ValueError, match=r"selection_interval must be in \[1, 3\].*got 4"):
        llm.generate([prompt(5)], greedy(4, selection_interval=4), use_tqdm=False)
    with pytest.raises(ValueError, match="selection_interval=2 needs an engine with Quest"):
        make_llm(model_dir).generate([prompt(5)], greedy(4, selection_interval=2), use_tqdm=False)
    with pytest.raises(ValueError, match="dense=True attends every page; it excludes selection_interval=2"):
        SamplingParams(dense=True, selection_interval=2)
    with pytest.raises(ValueError, match="SamplingParams.selection_interval must be >= 1"):
        SamplingParams(selection_interval=0)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("interval", [3, 6])
def test_the_selection_rate_of_a_fixed_interval_is_its_due_steps_share(model_dir, interval):
    prompts = [prompt(random.randint(30, 90)) for _ in range(2)]
    max_tokens = 17  # 16 decode steps: outputs 0, C, 2C, ... select
    outputs = make_llm(model_dir, reusing(SMALL, interval)).generate(prompts, greedy(max_tokens), use_tqdm=False)
    rate = math.ceil((max_tokens - 1) / interval) / (max_tokens - 1)
    assert [out.metrics.selection_rate for out in outputs] == [rate, rate]


def test_a_dense_request_in_the_batch_leaves_a_quest_requests_reuse_as_it_is_alone(model_dir):
    llm = make_llm(model_dir, reusing(SMALL, 4))
    prompts, params = [prompt(40), prompt(30)], [greedy(9), greedy(9, dense=True)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    alone = llm.generate(prompts[:1], params[:1], use_tqdm=False)[0]
    assert outputs[0].token_ids == alone.token_ids
    assert outputs[0].metrics.selection_rate == alone.metrics.selection_rate == 2 / 8  # decode steps 0 and 4 select
    assert outputs[1].metrics.selection_rate is None


class _AlwaysKept(set):
    """A broken mirror of the selection memory: it claims a kept selection for every slot."""

    def issuperset(self, other) -> bool:
        return True


@pytest.mark.parametrize("broken", [False, True], ids=["mirror", "broken mirror"])
def test_a_quest_step_after_steps_routed_dense_selects_and_a_wrong_host_mirror_is_caught(model_dir, broken):
    llm = make_llm(model_dir, reusing(SMALL, 4))  # budget 16 tokens, dense_context_ratio 1
    if broken:
        llm.engine.runner._kept = _AlwaysKept()
    engine = llm.engine
    # A 10-token prompt: decode steps 0-5 (11 to 16 tokens) are routed dense, the budget covering the context;
    # step 6 (17 tokens) is its first Quest step, off its phase (6 % 4): it must select, its memory forgotten.
    engine.add_request(prompt(10), greedy(12))
    if broken:
        with pytest.raises(RuntimeError, match=r"rows \[0\] select in a step launched without selection"):
            while engine.has_unfinished_requests():
                engine.step()
        return
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].metrics.selection_rate == 2 / 11  # steps 6 and 8 select; 11 decode steps in all



def test_a_dense_context_ratio_gives_the_dense_tokens_up_to_its_context_and_each_requests_tokens_alone(model_dir):
    quest = dataclasses.replace(SMALL, dense_context_ratio=4.0, selection_interval=3)  # dense up to 64 tokens
    llm = make_llm(model_dir, quest)
    short = [prompt(random.randint(5, 30)) for _ in range(2)]
    params = greedy(64 - 31)  # every step within 64 tokens: the dense engine's tokens
    assert run(llm, short, params) == run(make_llm(model_dir), short, params)
    mixed = [prompt(10), prompt(90), prompt(50)]  # dense, Quest, dense then Quest rows in one batch
    mixed_params = [greedy(30), greedy(20), greedy(30, token_budget=8)]
    assert run(llm, mixed, mixed_params) == alone(llm, mixed, mixed_params)
