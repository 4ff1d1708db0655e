"""Teacher forcing (``SamplingParams.forced_token_ids``) on CPU: forced outputs, the sampler's choices and the
forced tokens' log-probabilities, stops after the forced tokens, asynchronous scheduling, preemption, aborts
and mixed batches. The tiny random model and prompts of ``test_llm.py``; fp32, so tokens match exactly.
"""

import dataclasses
import random

import pytest
import torch

from questkv import QuestConfig
from questkv.engine.sampling_params import SamplingParams
from tests.engine.test_llm import FULL, MAX_LEN, PAGE, SMALL, VOCAB, greedy, make_llm, pool_memory, prompt, run
from tests.helpers import save_tiny_model

REUSE = dataclasses.replace(SMALL, selection_interval=3)
ENGINES = {"dense": None, "quest full budget": FULL, "quest small budget": SMALL, "quest reusing selections": REUSE}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), VOCAB, seed=random.randrange(1 << 16))


def forced(n: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,)).tolist()


@pytest.mark.parametrize("name", ["dense", "quest full budget"])
def test_forced_outputs_are_the_given_tokens_and_the_rest_continues_the_prompt_plus_the_forced_tokens(model_dir, name):
    llm = make_llm(model_dir, ENGINES[name])
    prompts = [prompt(random.randint(1, 40)) for _ in range(3)]
    tails = [forced(random.randint(1, 12)) for _ in prompts]
    outputs = llm.generate(prompts, [greedy(len(t) + 10, forced_token_ids=t) for t in tails], use_tqdm=False)
    plain = run(llm, [p + t for p, t in zip(prompts, tails)], greedy(10))
    for out, tail, rest in zip(outputs, tails, plain):
        assert out.token_ids == tuple(tail) + rest and out.finish_reason == "length"
        assert len(out.forced_choices) == len(out.forced_logprobs) == len(tail)


@pytest.mark.parametrize("name", list(ENGINES))
def test_forcing_the_greedy_tokens_gives_them_back_as_choices_with_the_same_attention(model_dir, name):
    """Sparse steps too: forced tokens go through page selection (and its reuse) exactly as generated ones."""
    llm = make_llm(model_dir, ENGINES[name])
    prompts = [prompt(random.randint(1, 90)) for _ in range(4)]
    plain = llm.generate(prompts, greedy(24), use_tqdm=False)
    params = [greedy(24, forced_token_ids=out.token_ids[:n]) for out, n in zip(plain, (1, 7, 23, 24))]
    teacher = llm.generate(prompts, params, use_tqdm=False)
    for out, ref, sp in zip(teacher, plain, params):
        n = len(sp.forced_token_ids)
        assert out.token_ids == ref.token_ids and out.forced_choices == ref.token_ids[:n]
        assert out.metrics.mean_tokens_attended == pytest.approx(ref.metrics.mean_tokens_attended)
        assert out.metrics.mean_sparse_tokens_attended == ref.metrics.mean_sparse_tokens_attended
    assert all(not out.forced_choices and not out.forced_logprobs for out in plain)


@pytest.mark.parametrize("name", ["dense", "quest full budget"])
def test_forced_logprobs_are_the_log_softmax_of_a_reference_forward(model_dir, name):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = make_llm(model_dir, ENGINES[name])
    prompts = [prompt(random.randint(1, 40)) for _ in range(3)]
    tails = [forced(random.randint(1, 30)) for _ in prompts]
    outputs = llm.generate(prompts, [greedy(len(t), forced_token_ids=t) for t in tails], use_tqdm=False)
    for p, tail, out in zip(prompts, tails, outputs):
        with torch.no_grad():
            logits = reference(torch.tensor([p + tail])).logits[0, len(p) - 1 : -1].float()  # [len(tail), vocab]
        log_probs = torch.log_softmax(logits, dim=-1)
        expected = log_probs.gather(1, torch.tensor(tail)[:, None])[:, 0]
        assert out.forced_logprobs == pytest.approx(expected.tolist(), abs=1e-4)
        assert list(out.forced_choices) == logits.argmax(-1).tolist()
        assert out.token_ids == tuple(tail)


def test_stops_apply_only_after_the_forced_tokens(model_dir):
    llm = make_llm(model_dir)  # the word tokenizer: token i >= 2 is the word x{i:02d}, 1 is <eos>
    p = prompt(random.randint(3, 30))
    (ref,) = run(llm, [p], greedy(12))
    tail = [1, ref[0], *forced(3)]  # EOS and a stop token among the forced tokens
    stop_word = f"x{tail[2]:02d}"
    params = SamplingParams(temperature=0, max_tokens=30, forced_token_ids=tail, stop_token_ids=[ref[0]],
                            stop=[stop_word])
    (out,) = llm.generate([p], params, use_tqdm=False)
    assert out.token_ids[: len(tail)] == tuple(tail)
    rest = out.token_ids[len(tail):]
    assert out.finish_reason in ("stop", "length") and len(rest) >= 1
    if out.finish_reason == "stop":  # the first stop after the forced tokens ended it, not one among them
        text_of_tail = llm.tokenizer.decode(tail, skip_special_tokens=True)
        assert out.text.startswith(text_of_tail) and stop_word not in out.text[len(text_of_tail):]
    (plain,) = run(llm, [p + tail], SamplingParams(temperature=0, max_tokens=30 - len(tail), stop_token_ids=[ref[0]],
                                                   stop=[stop_word]))
    assert rest == plain


def test_max_tokens_equal_to_the_forced_tokens_finishes_by_length_after_them(model_dir):
    llm = make_llm(model_dir, SMALL)
    tail = [1, *forced(4)]
    (out,) = llm.generate([prompt(20)], SamplingParams(temperature=0, max_tokens=5, forced_token_ids=tail),
                          use_tqdm=False)
    assert out.token_ids == tuple(tail) and out.finish_reason == "length" and len(out.forced_logprobs) == 5


def test_sampled_requests_choose_as_their_unforced_draw_would(model_dir):
    llm = make_llm(model_dir)
    p, seed = prompt(10), random.randrange(1 << 30)
    sampled = SamplingParams(temperature=0.9, seed=seed, max_tokens=12, ignore_eos=True)
    (plain,) = run(llm, [p], sampled)
    (out,) = llm.generate([p], dataclasses.replace(sampled, forced_token_ids=plain[:6]), use_tqdm=False)
    assert out.token_ids == plain and out.forced_choices == plain[:6]


def mixed(quest) -> tuple[list, list]:
    """Ragged prompts: forced requests (greedy, with stops), plain greedy and seeded requests, on a Quest engine
    per-request budgets."""
    prompts, params = [], []
    for i in range(8):
        prompts.append(prompt(random.randint(1, 50)))
        kwargs = {"max_tokens": random.randint(4, 24), "ignore_eos": i % 3 != 0}
        if i % 2 == 0:
            kwargs.update(temperature=0, forced_token_ids=forced(random.randint(1, kwargs["max_tokens"])))
        elif i % 4 == 1:
            kwargs.update(temperature=0.9, seed=random.randrange(1 << 30))
        else:
            kwargs.update(temperature=0)
        if i % 4 == 0:
            kwargs["stop_token_ids"] = random.sample(range(2, VOCAB), 8)
            kwargs["stop"] = [f"x{random.randrange(2, VOCAB):02d}" for _ in range(3)]
        if quest is not None and i % 3 == 2:
            kwargs["token_budget"] = random.choice([8, 12])
        params.append(SamplingParams(**kwargs))
    return prompts, params


def outcome(out) -> tuple:
    return (out.token_ids, out.text, out.finish_reason, out.stop_reason, out.forced_choices,
            out.metrics.mean_tokens_attended)


@pytest.mark.parametrize("name", ["dense", "quest small budget", "quest reusing selections"])
def test_async_scheduling_gives_the_synchronous_outputs_with_forced_and_plain_requests_mixed(model_dir, name):
    prompts, params = mixed(ENGINES[name])
    sync = make_llm(model_dir, ENGINES[name], async_scheduling=False).generate(prompts, params, use_tqdm=False)
    asynchronous = make_llm(model_dir, ENGINES[name], async_scheduling=True).generate(prompts, params, use_tqdm=False)
    assert [outcome(out) for out in asynchronous] == [outcome(out) for out in sync]
    for out, p in zip(sync, params):  # each forced request's outputs begin with its tokens
        assert out.token_ids[: len(p.forced_token_ids)] == p.forced_token_ids[: len(out.token_ids)]
        # fp32 tolerance: the two modes batch a row with different neighbours (1.9e-6 apart at -5.2 was seen).
        assert out.forced_logprobs == pytest.approx(
            [o.forced_logprobs for o in asynchronous if o.request_id == out.request_id][0], abs=1e-5)
    alone = [make_llm(model_dir, ENGINES[name]).generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    assert [outcome(out)[:5] for out in sync] == [outcome(out)[:5] for out in alone]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempted_forced_requests_give_the_outputs_of_an_unconstrained_run(model_dir, async_scheduling):
    unconstrained = make_llm(model_dir, max_model_len=64)
    per_seq = 64 // unconstrained.config.page_size
    tiny = make_llm(model_dir, max_model_len=64, kv_cache_memory=pool_memory(unconstrained, per_seq + 2),
                    async_scheduling=async_scheduling)
    prompts = [prompt(random.randint(10, 24)) for _ in range(4)]
    params = [greedy(30, forced_token_ids=forced(25)), greedy(36, forced_token_ids=forced(3)), greedy(30),
              greedy(25, forced_token_ids=forced(25))]
    outputs = tiny.generate(prompts, params, use_tqdm=False)
    assert sum(out.metrics.num_preemptions for out in outputs) > 0
    expected = unconstrained.generate(prompts, params, use_tqdm=False)
    assert [(o.token_ids, o.forced_choices) for o in outputs] == [(o.token_ids, o.forced_choices) for o in expected]
    for out, ref in zip(outputs, expected):
        assert out.forced_logprobs == pytest.approx(ref.forced_logprobs, abs=1e-4)
    assert tiny.engine.cache.num_free_pages == per_seq + 1


def test_an_aborted_forced_request_frees_its_pages_and_leaves_the_others(model_dir):
    llm = make_llm(model_dir, SMALL, async_scheduling=True)
    engine = llm.engine
    p, q = prompt(30), prompt(12)
    kept = greedy(12, forced_token_ids=forced(4))
    victim = engine.add_request(p, greedy(20, forced_token_ids=forced(15)))
    keeper = engine.add_request(q, kept)
    last = {}
    for step in range(40):
        if step == 5:
            assert engine.abort_request(victim)
        for out in engine.step():
            last[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert last[victim].finish_reason == "abort" or not last[victim].finished
    (alone,) = llm.generate([q], kept, use_tqdm=False)
    assert last[keeper].token_ids == alone.token_ids and last[keeper].forced_choices == alone.forced_choices
    cache = engine.cache
    assert cache.sequences == [engine.runner.scratch_seq] and cache.num_free_pages == cache.num_pages - 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"forced_token_ids": [3, -1]}, r"SamplingParams.forced_token_ids\[1\] must be >= 0, got -1"),
        ({"forced_token_ids": ["3"]}, r"SamplingParams.forced_token_ids\[0\] must be an int"),
        ({"forced_token_ids": 5}, "SamplingParams.forced_token_ids must be a list of token ids, got 5"),
        ({"forced_token_ids": [2, 3, 4], "max_tokens": 2},
         r"SamplingParams.max_tokens must be >= len\(forced_token_ids\)=3 \(it counts the forced tokens too\), got 2"),
    ],
)
def test_bad_forced_token_ids_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_forced_token_ids_outside_the_vocabulary_are_refused_before_anything_is_queued(model_dir):
    llm = make_llm(model_dir)
    good = greedy(4, forced_token_ids=[2, 3])
    bad = greedy(4, forced_token_ids=[2, VOCAB])
    with pytest.raises(ValueError, match=rf"SamplingParams.forced_token_ids must be in \[0, {VOCAB}\), got \[{VOCAB}\]"):
        llm.generate([prompt(5), prompt(5)], [good, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="max_tokens"):  # the forced tokens count against max_model_len too
        llm.generate([prompt(MAX_LEN - 2)], greedy(3, forced_token_ids=[2, 3, 4]), use_tqdm=False)
    assert SamplingParams().forced_token_ids == () and greedy(2, forced_token_ids=[5]).forced_token_ids == (5,)


def test_a_request_without_detokenization_gets_its_tokens_and_no_text(model_dir):
    llm = make_llm(model_dir)
    p = prompt(12)
    # Two forced words first: the random model may otherwise emit only special tokens, whose text is empty.
    words = [random.randrange(2, VOCAB), random.randrange(2, VOCAB)]
    plain, quiet = llm.generate([p, p], [greedy(8, forced_token_ids=words),
                                         greedy(8, forced_token_ids=words, detokenize=False)], use_tqdm=False)
    assert quiet.token_ids == plain.token_ids and quiet.text == "" and plain.text.startswith(f"x{words[0]:02d}")
    with pytest.raises(ValueError, match=r"SamplingParams.stop=\['x'\] is matched in the output text; it needs "
                                         "detokenize=True"):
        SamplingParams(stop="x", detokenize=False)
    with pytest.raises(ValueError, match="SamplingParams.detokenize must be a bool"):
        SamplingParams(detokenize=0)


def test_the_sparse_metric_is_the_budget_once_the_context_exceeds_it_and_none_when_dense(model_dir):
    quest = QuestConfig(token_budget=16, page_size=PAGE, dense_layers=1, dense_context_ratio=1.0)
    llm = make_llm(model_dir, quest)
    sparse, dense = llm.generate([prompt(60), prompt(60)], [greedy(8), greedy(8, dense=True)], use_tqdm=False)
    assert sparse.metrics.mean_sparse_tokens_attended == 16 and dense.metrics.mean_sparse_tokens_attended is None
    (plain,) = make_llm(model_dir).generate([prompt(60)], greedy(8), use_tqdm=False)
    assert plain.metrics.mean_sparse_tokens_attended is None
