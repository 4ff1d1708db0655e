"""The engine end to end on CPU: batching, requests joining and leaving, preemption, page accounting, per-request
budgets, stops, seeded sampling, and the default model against transformers.

Most tests run a tiny random transformers Llama (3 layers, GQA 4 q / 2 KV heads, llama3 rope) saved with
``save_pretrained`` once per module, with a word tokenizer whose token ``i >= 2`` is the word ``x{i:02d}`` (so
stop strings can be read off token ids). Prompts are fresh random token ids in every test; float64, so that greedy
tokens must match exactly: a batch, a chunk or a cache hit rounds the same sums in another order, and in fp32 that
flipped near-tied page scores of a small Quest budget now and then (float64's rounding is 2**29 times finer).
"""

import dataclasses
import json
import math
import random
import shutil

import pytest
import torch

from questkv import QuestConfig
from questkv.engine.llm import LLM
from questkv.engine.sampling_params import SamplingParams
from tests.helpers import greedy_params, save_tiny_model

VOCAB, PAGE, MAX_LEN, LAYERS = 96, 4, 128, 3
FULL = QuestConfig(token_budget=MAX_LEN, page_size=PAGE, dense_layers=1)  # covers every context
# Quest's selection from the smallest contexts: dense_context_ratio=1 routes dense only where the budget covers the
# context (the default's cost model would send these tiny contexts dense; tests/decode/test_route.py and the
# dense_context_ratio tests of test_selection_reuse.py cover it).
SMALL = QuestConfig(token_budget=16, page_size=PAGE, dense_layers=1, dense_context_ratio=1.0)
ENGINES = {"dense": None, "quest full budget": FULL, "quest small budget": SMALL}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), VOCAB, seed=random.randrange(1 << 16))


def make_llm(model_dir, quest=None, **kwargs) -> LLM:
    kwargs = {"device": "cpu", "dtype": "float64", "max_model_len": MAX_LEN, "kv_cache_memory": 1 << 21, **kwargs}
    return LLM(str(model_dir), quest=quest, **kwargs)


def prompt(n: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,)).tolist()


greedy = greedy_params


def run(llm, prompts, params) -> list[tuple[int, ...]]:
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def alone(llm, prompts, params) -> list[tuple[int, ...]]:
    """Each request run by itself (``params``: one for all or one per prompt)."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    return [run(llm, [p], sp)[0] for p, sp in zip(prompts, params)]


def pool_memory(llm, pages: int) -> int:
    """``kv_cache_memory`` for ``pages`` pages of ``llm``'s model (K, V and the min/max keys per layer, in its pool's
    dtype)."""
    spec, element = llm.engine.spec, llm.engine.cache.layer(0).k_pages.element_size()
    return pages * spec.num_layers * (2 * llm.config.page_size + 2) * spec.num_kv_heads * spec.head_dim * element


def first_new(tokens, start: int = 1):
    """The first index ``k >= start`` whose token is not special (0, 1) and not among the earlier tokens."""
    for k in range(start, len(tokens)):
        if tokens[k] >= 2 and tokens[k] not in tokens[:k] and tokens[k - 1] >= 2:
            return k
    return None


def reference_with_new_token(llm, length: int, max_tokens: int):
    """A fresh prompt and its greedy tokens, holding a token that appears first after the start (redrawn until
    the random model generates one)."""
    for _ in range(50):
        p = prompt(length)
        ref = run(llm, [p], greedy(max_tokens))[0]
        k = first_new(ref)
        if k is not None:
            return p, ref, k
    raise AssertionError("the tiny model kept repeating one token")


# ---------------------------------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------------------------------


def test_quest_with_a_budget_covering_the_context_gives_the_dense_tokens(model_dir):
    prompts = [prompt(random.randint(1, 90)) for _ in range(4)]
    dense = run(make_llm(model_dir), prompts, greedy(20))
    assert run(make_llm(model_dir, FULL), prompts, greedy(20)) == dense
    assert run(make_llm(model_dir, QuestConfig(page_size=PAGE)), prompts, greedy(20)) == dense


BATCHING = {
    "dense": (None, {}),
    "quest full budget": (FULL, {}),
    "quest small budget": (SMALL, {}),
    "quest with sink and recent pages": (
        QuestConfig(token_budget=16, page_size=PAGE, sink_pages=1, recent_pages=1), {}),
    "dense, two sequences at a time": (None, dict(max_num_seqs=2)),
    "quest, prefill chunks of 32 tokens": (SMALL, dict(max_num_batched_tokens=32)),
}


@pytest.mark.parametrize("name", BATCHING)
def test_batched_requests_of_ragged_lengths_give_each_requests_tokens_alone(model_dir, name):
    quest, kwargs = BATCHING[name]
    llm = make_llm(model_dir, quest, **kwargs)
    lens = [1, random.randint(2, 8), random.randint(9, 40), random.randint(41, 100)]
    random.shuffle(lens)
    prompts = [prompt(n) for n in lens]
    params = [greedy(random.randint(1, 24)) for _ in prompts]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [out.token_ids for out in outputs] == alone(llm, prompts, params)
    for out, p, sp in zip(outputs, prompts, params):  # in the prompts' order, each finished by its max_tokens
        assert out.prompt_token_ids == tuple(p) and out.prompt is None
        assert out.finished and out.finish_reason == "length" and len(out.token_ids) == sp.max_tokens


def test_the_progress_bar_counts_requests_and_the_tokens_prefilled_and_decoded_on_stderr(model_dir, capsys):
    import io

    from tqdm import tqdm

    llm = make_llm(model_dir, enable_prefix_caching=False)
    lens, outs = [random.randint(5, 40), random.randint(41, 90)], [random.randint(2, 9), random.randint(2, 9)]
    prompts = [prompt(n) for n in lens]
    outputs = llm.generate(prompts, [greedy(k) for k in outs])
    captured = capsys.readouterr()
    assert captured.out == ""  # stdout stays the caller's
    last = captured.err.split("\r")[-1]
    assert "generate: 100%" in last and "2/2" in last
    assert f"prefill {sum(lens)} tok, decode {sum(outs) - 2} tok" in last  # each request's first token: its prefill
    quiet = llm.generate(prompts, [greedy(k) for k in outs], use_tqdm=False)
    assert [o.token_ids for o in quiet] == [o.token_ids for o in outputs] and capsys.readouterr().err == ""
    made, sink = [], io.StringIO()

    def make_bar(**kwargs):  # what vLLM's use_tqdm takes too: a callable making the bar
        made.append(kwargs)
        return tqdm(file=sink, **kwargs)

    assert [o.token_ids for o in llm.generate(prompts, [greedy(k) for k in outs], use_tqdm=make_bar)] == [
        o.token_ids for o in outputs]
    assert made == [{"total": 2, "desc": "generate", "unit": "req"}] and "2/2" in sink.getvalue()
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="LLM.generate use_tqdm must be a bool or a callable making a tqdm bar, "
                                         "got 'yes'"):
        llm.generate(prompts, greedy(2), use_tqdm="yes")
    assert not llm.engine.has_unfinished_requests()  # refused before any request was queued


def test_a_single_prompt_may_be_given_as_token_ids_or_text(model_dir):
    llm = make_llm(model_dir)
    p = prompt(7)
    text = " ".join(f"x{t:02d}" for t in p)
    (by_ids,) = llm.generate(p, greedy(6), use_tqdm=False)
    (by_text,) = llm.generate(text, greedy(6), use_tqdm=False)
    assert llm.generate([], greedy(6), use_tqdm=False) == []
    assert by_ids.token_ids == by_text.token_ids and by_text.prompt == text
    assert by_text.prompt_token_ids == tuple(p)
    assert by_text.text == llm.tokenizer.decode(list(by_text.token_ids), skip_special_tokens=True)


def prefill_tokens(llm, prompts, params):
    """Generate ``prompts`` and count the prompt tokens each step with prefill rows computes (its model inputs past
    the decode rows)."""
    launched, execute = [], llm.engine.runner.execute
    llm.engine.runner.execute = lambda batch: launched.append(batch) or execute(batch)
    computed = []
    hook = llm.engine.runner.model.register_forward_pre_hook(lambda module, args: computed.append(args[0].numel()))
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        hook.remove()
        llm.engine.runner.execute = execute
    return outputs, launched, [n - batch.num_decodes for batch, n in zip(launched, computed) if batch.num_prefills]


@pytest.mark.parametrize("quest", [None, dataclasses.replace(SMALL, selection_interval=3)], ids=["dense", "quest"])
def test_identical_prompts_admitted_together_are_computed_once_and_give_each_requests_outputs(model_dir, quest):
    llm = make_llm(model_dir, quest, max_num_batched_tokens=60)
    uncached = make_llm(model_dir, quest, max_num_batched_tokens=60, enable_prefix_caching=False)
    p, q = prompt(50), prompt(30)
    seeded = SamplingParams(temperature=0.9, seed=random.randrange(1 << 30), max_tokens=12, ignore_eos=True)
    forced = greedy(12, forced_token_ids=prompt(5))
    sparse = {} if quest is None else {"token_budget": 8}
    prompts = [p, p, p, q, p]
    params = [greedy(12), seeded, forced, greedy(12), greedy(10, **sparse)]
    outputs, launched, computed = prefill_tokens(llm, prompts, params)
    # The first step computes p; its copies hit its 12 full pages, written earlier in the same step, and compute
    # the 2 tokens past them; q gets the first chunk of its prefill, the 6 tokens max_num_batched_tokens leaves. The
    # last copy of p comes after q, so it waits for a later prefill step, and hits too: p is computed once.
    assert not launched[0].num_decodes and launched[0].num_new_tokens == (50, 2, 2, 6) and launched[0].partial
    assert sum(computed) == 50 + 30 + 3 * 2
    assert [out.metrics.num_cached_tokens for out in outputs] == [0, 48, 48, 0, 48]
    assert [(out.token_ids, out.forced_choices) for out in outputs] == [
        (o.token_ids, o.forced_choices) for o in (uncached.generate([x], sp, use_tqdm=False)[0]
                                                  for x, sp in zip(prompts, params))]
    # Without prefix caching each copy computes its own prefill, to the same tokens.
    alike, _, separate = prefill_tokens(uncached, prompts, params)
    assert sum(separate) == 4 * 50 + 30
    assert [out.token_ids for out in alike] == [out.token_ids for out in outputs]
    for engine in (llm, uncached):
        cache = engine.engine.cache
        assert cache.sequences == [engine.engine.runner.scratch_seq] and cache.num_free_pages == cache.num_pages - 1


@pytest.mark.parametrize("name", ["dense", "quest small budget"])
def test_requests_joining_and_leaving_mid_run_change_no_other_requests_tokens(model_dir, name):
    llm = make_llm(model_dir, ENGINES[name])
    engine = llm.engine
    pa, pb, pc = (prompt(random.randint(5, 50)) for _ in range(3))
    latest, finished = {}, {}

    def steps(n):
        touched = []
        for _ in range(n):
            for out in engine.step():
                latest[out.request_id] = out
                touched.append(out.request_id)
                if out.finished:
                    finished[out.request_id] = out
        return touched

    a, b = engine.add_request(pa, greedy(24)), engine.add_request(pb, greedy(24))
    steps(5)  # one prefill of a and b, four decode steps
    c = engine.add_request(pc, greedy(16))
    assert steps(1) == [a, b, c]  # c joins with its prefill in a step where a and b decode (a mixed step) ...
    assert steps(1) == [a, b, c]  # ... then decodes beside them
    steps(3)
    free = engine.cache.num_free_pages
    assert engine.abort_request(b) and not engine.abort_request(b) and not engine.abort_request("unknown")
    assert engine.cache.num_free_pages > free  # b's pages are freed at once
    steps(1)
    while engine.has_unfinished_requests():
        steps(1)
    assert b not in finished
    want_a, want_b, want_c = alone(llm, [pa, pb, pc], [greedy(24), greedy(24), greedy(16)])
    assert finished[a].token_ids == want_a and finished[c].token_ids == want_c
    partial = latest[b].token_ids
    assert len(partial) == 10 and partial == want_b[:10]  # prefill + 9 decode steps before the abort


# ---------------------------------------------------------------------------------------------------------------
# Preemption and pages
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dense", "quest full budget"])
def test_preemption_under_a_tiny_pool_gives_the_tokens_of_an_unconstrained_run(model_dir, name):
    quest = ENGINES[name]
    unconstrained = make_llm(model_dir, quest, max_model_len=64)
    per_seq = math.ceil(64 / unconstrained.config.page_size)
    tiny = make_llm(model_dir, quest, max_model_len=64, kv_cache_memory=pool_memory(unconstrained, per_seq + 2))
    assert tiny.engine.cache.num_pages == per_seq + 2
    prompts = [prompt(random.randint(10, 24)) for _ in range(4)]
    params = [greedy(30), greedy(36), SamplingParams(temperature=0.8, seed=random.randrange(1 << 30), max_tokens=30,
                                                     ignore_eos=True), greedy(25)]
    outputs = tiny.generate(prompts, params, use_tqdm=False)
    assert sum(out.metrics.num_preemptions for out in outputs) > 0
    assert [out.token_ids for out in outputs] == run(unconstrained, prompts, params)
    assert tiny.engine.cache.num_free_pages == per_seq + 1  # everything back but the scratch page


def test_no_page_leaks_after_many_requests_with_preemptions_stops_and_aborts(model_dir):
    probe = make_llm(model_dir, SMALL, max_model_len=64)
    llm = make_llm(model_dir, SMALL, max_model_len=64, max_num_seqs=4, kv_cache_memory=pool_memory(probe, 24))
    engine, cache = llm.engine, llm.engine.cache
    start = cache.num_free_pages
    assert start == cache.num_pages - 1  # the runner's scratch page
    # Four short prompts first, run together and grown past the pool (8+ pages each of 23): preemption is certain;
    # then a dozen random requests that may stop early on a token.
    prompts = [prompt(random.randint(1, 8)) for _ in range(4)] + [prompt(random.randint(1, 40)) for _ in range(12)]
    params = [greedy(random.randint(30, 40), token_budget=random.choice([None, 8])) for _ in range(4)] + [
        SamplingParams(temperature=random.choice([0, 1.0]), max_tokens=random.randint(1, min(30, 64 - len(p))),
                       ignore_eos=random.random() < 0.5, stop_token_ids=random.sample(range(VOCAB), 2),
                       token_budget=random.choice([None, 8, 12]))
        for p in prompts[4:]
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(out.finished for out in outputs)
    assert sum(out.metrics.num_preemptions for out in outputs) > 0
    assert cache.num_free_pages == start and cache.sequences == [engine.runner.scratch_seq]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts[:6], params[:6])]
    for _ in range(4):
        engine.step()
    for request_id in ids[::2]:
        engine.abort_request(request_id)  # waiting or running
    while engine.has_unfinished_requests():
        engine.step()
    assert cache.num_free_pages == start and cache.sequences == [engine.runner.scratch_seq]


# ---------------------------------------------------------------------------------------------------------------
# Per-request token budgets and the attention metric
# ---------------------------------------------------------------------------------------------------------------


def test_per_request_token_budgets_in_one_batch_give_each_requests_tokens_alone_at_its_budget(model_dir):
    quest = QuestConfig(token_budget=32, page_size=PAGE, dense_layers=1, dense_context_ratio=1.0)
    llm = make_llm(model_dir, quest)
    budgets = [8, 16, None, 24, 4, 32]
    prompts = [prompt(random.randint(40, 90)) for _ in budgets]
    params = [greedy(12, token_budget=b) for b in budgets]
    batched = llm.generate(prompts, params, use_tqdm=False)
    assert [out.token_ids for out in batched] == alone(llm, prompts, params)
    assert batched[2].token_ids == run(llm, [prompts[2]], greedy(12, token_budget=32))[0]  # None: the engine's
    for out, b in zip(batched, budgets):  # 1 dense layer attends the context, 2 sparse layers the budget
        context = len(out.prompt_token_ids) + 6  # the mean context of the 11 decode steps
        assert out.metrics.mean_tokens_attended == pytest.approx((context + 2 * (b or 32)) / LAYERS)


def test_a_dense_request_in_a_quest_batch_gives_the_dense_engines_tokens_and_leaves_the_others_unchanged(model_dir):
    quest = QuestConfig(token_budget=16, page_size=PAGE, dense_layers=1)
    llm, dense_llm = make_llm(model_dir, quest), make_llm(model_dir)
    prompts = [prompt(random.randint(40, 90)) for _ in range(4)]
    params = [greedy(12), greedy(12, dense=True), greedy(12, token_budget=8), greedy(12, dense=True)]
    batched = llm.generate(prompts, params, use_tqdm=False)
    assert batched[1].token_ids == run(dense_llm, [prompts[1]], greedy(12))[0]
    assert batched[3].token_ids == run(dense_llm, [prompts[3]], greedy(12))[0]
    assert [batched[0].token_ids, batched[2].token_ids] == alone(llm, [prompts[0], prompts[2]], [params[0], params[2]])
    context = len(batched[1].prompt_token_ids) + 6  # the mean context of the 11 decode steps
    assert batched[1].metrics.mean_tokens_attended == pytest.approx(context)
    with pytest.raises(ValueError, match="SamplingParams.dense=True attends every page"):
        SamplingParams(dense=True, token_budget=16)


def test_mean_tokens_attended_is_the_mean_context_when_dense_and_the_budget_once_the_context_exceeds_it(model_dir):
    p = prompt(random.randint(1, 20))
    (dense,) = make_llm(model_dir).generate([p], greedy(20), use_tqdm=False)
    assert dense.metrics.mean_tokens_attended == pytest.approx(len(p) + 10)  # contexts len(p) + 1 ... len(p) + 19
    (sparse,) = make_llm(model_dir, SMALL).generate([p], greedy(20), use_tqdm=False)
    contexts = range(len(p) + 1, len(p) + 20)
    per_layer = [min(math.ceil(c / PAGE) * PAGE, SMALL.token_budget) for c in contexts]  # whole pages, Quest's way
    expected = sum((c + 2 * s) / LAYERS for c, s in zip(contexts, per_layer)) / len(contexts)
    assert sparse.metrics.mean_tokens_attended == pytest.approx(expected)
    assert sparse.metrics.num_preemptions == 0 and sparse.metrics.time_to_first_token > 0
    assert sparse.metrics.decode_tokens_per_s > 0


# ---------------------------------------------------------------------------------------------------------------
# Stops
# ---------------------------------------------------------------------------------------------------------------


def test_stop_token_ids_and_max_tokens_finish_with_their_reasons(model_dir):
    llm = make_llm(model_dir)
    p, ref, k = reference_with_new_token(llm, random.randint(3, 30), 16)
    other = prompt(random.randint(3, 30))
    stopped, bystander = llm.generate([p, other], [greedy(16, stop_token_ids=[ref[k]]), greedy(16)], use_tqdm=False)
    assert stopped.token_ids == ref[: k + 1] and stopped.finish_reason == "stop" and stopped.stop_reason == ref[k]
    assert bystander.token_ids == run(llm, [other], greedy(16))[0]
    (short,) = llm.generate([p], greedy(k), use_tqdm=False)
    assert short.token_ids == ref[:k] and short.finish_reason == "length" and short.stop_reason is None


def test_a_request_reaching_max_model_len_finishes_with_length_and_one_past_it_is_refused(model_dir):
    llm = make_llm(model_dir, max_model_len=40)
    p = prompt(random.randint(10, 30))
    with pytest.raises(ValueError, match=f"max_tokens may be at most {40 - len(p)}"):
        llm.generate([p], greedy(41 - len(p)), use_tqdm=False)
    (out,) = llm.generate([p], greedy(40 - len(p)), use_tqdm=False)
    assert len(out.token_ids) == 40 - len(p) and out.finish_reason == "length"
    assert out.token_ids == run(make_llm(model_dir), [p], greedy(40 - len(p)))[0]


def test_the_models_eos_finishes_a_request_unless_it_ignores_eos(model_dir, tmp_path):
    p, ref, k = reference_with_new_token(make_llm(model_dir), random.randint(3, 30), 16)
    eos_dir = tmp_path / "eos"
    shutil.copytree(model_dir, eos_dir)
    generation = json.loads((eos_dir / "generation_config.json").read_text())
    generation["eos_token_id"] = ref[k]
    (eos_dir / "generation_config.json").write_text(json.dumps(generation))
    llm = make_llm(eos_dir)
    assert llm.engine.eos_token_ids == {ref[k]}
    (out,) = llm.generate([p], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert out.token_ids == ref[: k + 1] and out.finish_reason == "stop" and out.stop_reason is None
    (ignored,) = llm.generate([p], greedy(16), use_tqdm=False)
    assert ignored.token_ids == ref and ignored.finish_reason == "length"


def test_stop_strings_cut_the_text_and_finish_the_request_on_the_token_that_completes_them(model_dir):
    llm = make_llm(model_dir)
    tokenizer = llm.tokenizer
    p, ref, k = reference_with_new_token(llm, random.randint(3, 30), 16)
    word, pair = f"x{ref[k]:02d}", f"x{ref[k - 1]:02d} x{ref[k]:02d}"  # ref[k] first appears at k
    full = tokenizer.decode(list(ref[: k + 1]), skip_special_tokens=True)
    other = prompt(random.randint(3, 30))
    params = [greedy(16, stop=["zzz", word]), greedy(16, stop=pair), greedy(16, stop="never"), greedy(16),
              greedy(16, stop=word, stop_token_ids=[ref[k]])]
    one, two, never, bystander, both = llm.generate([p, p, p, other, p], params, use_tqdm=False)
    # both: a stop string and a stop token complete on the same token; the string is the reported stop reason
    for out, stop in ((one, word), (two, pair), (both, word)):
        assert out.token_ids == ref[: k + 1] and out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == full[: full.index(stop)]
    assert never.token_ids == ref and never.finish_reason == "length" and never.stop_reason is None
    assert never.text == tokenizer.decode(list(ref), skip_special_tokens=True)
    assert bystander.token_ids == run(llm, [other], greedy(16))[0]


# ---------------------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------------------


def test_seeded_sampling_reproduces_across_engines_and_whatever_shares_the_batch(model_dir):
    llm = make_llm(model_dir)
    p = prompt(random.randint(3, 40))
    seed = random.randrange(1 << 40)
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=seed, max_tokens=16, ignore_eos=True)
    (solo,) = run(llm, [p], params)
    others = [prompt(random.randint(1, 60)) for _ in range(3)]
    mixed = run(llm, [others[0], p, others[1], others[2]],
                [SamplingParams(temperature=0.7, seed=seed + 1, max_tokens=20, ignore_eos=True), params,
                 greedy(9), SamplingParams(temperature=1.3, top_k=5, max_tokens=3, ignore_eos=True)])
    assert mixed[1] == solo
    assert mixed[2] == run(llm, [others[1]], greedy(9))[0]  # a greedy row in a sampled batch stays greedy
    assert run(make_llm(model_dir, SMALL), [p], params)[0][:1] == solo[:1]  # prefill is dense either way
    assert run(make_llm(model_dir), [p], params)[0] == solo
    reseeded = [run(llm, [p], dataclasses.replace(params, seed=seed + i))[0] for i in range(1, 5)]
    assert any(tokens != solo for tokens in reseeded)


def test_requests_without_a_seed_reproduce_from_the_engine_seed(model_dir):
    prompts = [prompt(random.randint(1, 30)) for _ in range(3)]
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    first = run(make_llm(model_dir, seed=11), prompts, params)
    assert run(make_llm(model_dir, seed=11), prompts, params) == first
    assert run(make_llm(model_dir, seed=12), prompts, params) != first


# ---------------------------------------------------------------------------------------------------------------
# The default model
# ---------------------------------------------------------------------------------------------------------------

PROMPTS = [
    "The history of the Roman Empire begins with",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def smollm():
    return LLM("smollm2-135m", device="cpu", dtype="float32")


def test_the_default_model_generates_transformers_greedy_tokens_and_text(smollm):
    import questkv

    model, tokenizer = questkv.load_model("smollm2-135m", dtype="float32")
    prompt_text = random.choice(PROMPTS)
    ids = tokenizer(prompt_text, return_tensors="pt").input_ids
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                              pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
    (out,) = smollm.generate([prompt_text], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert list(out.token_ids) == want  # both stop at the generation config's end-of-sequence id
    assert out.prompt == prompt_text and out.prompt_token_ids == tuple(ids[0].tolist())
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_stop_strings_and_stop_token_ids_on_the_default_model(smollm):
    prompt_text = PROMPTS[0]
    ref = smollm.generate([prompt_text], greedy(16), use_tqdm=False)[0]
    words = ref.text.split()
    stop = next(w for w in words[1:] if len(w) >= 3)  # a word past the first: the text up to it is kept
    k = next(i for i in range(1, 16) if ref.token_ids[i] not in ref.token_ids[:i])
    by_string, by_token = smollm.generate([prompt_text, prompt_text], [
        greedy(16, stop=stop), greedy(16, stop_token_ids=[ref.token_ids[k]]),
    ], use_tqdm=False)
    assert by_string.finish_reason == "stop" and by_string.stop_reason == stop
    assert by_string.text == ref.text[: ref.text.index(stop)]
    assert by_string.token_ids == ref.token_ids[: len(by_string.token_ids)]
    assert by_token.token_ids == ref.token_ids[: k + 1] and by_token.stop_reason == ref.token_ids[k]
    with pytest.raises(ValueError, match="prompt is empty"):
        smollm.generate([""], greedy(4), use_tqdm=False)


# ---------------------------------------------------------------------------------------------------------------
# Closing and several engines in one process
# ---------------------------------------------------------------------------------------------------------------


def test_close_frees_the_pool_and_weights_at_once_is_idempotent_and_later_use_is_a_clear_error(model_dir):
    llm = make_llm(model_dir, SMALL)
    llm.generate([prompt(20)], greedy(4), use_tqdm=False)
    pool, weight = llm.engine.cache.k_pages, next(llm.engine.runner.model.parameters())
    assert pool.untyped_storage().nbytes() > 0 and weight.untyped_storage().nbytes() > 0
    llm.close()
    assert pool.untyped_storage().nbytes() == 0 and weight.untyped_storage().nbytes() == 0
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([prompt(5)], greedy(2), use_tqdm=False)


def test_a_with_block_closes_the_llm_and_dropping_the_last_reference_frees_it_without_the_garbage_collector(
        model_dir):
    with make_llm(model_dir) as llm:
        out = llm.generate([prompt(10)], greedy(3), use_tqdm=False)[0]
        pool = llm.engine.cache.k_pages
    assert len(out.token_ids) == 3 and pool.untyped_storage().nbytes() == 0
    import gc
    gc.disable()  # only reference counting: a cycle would keep the pool alive
    try:
        llm = make_llm(model_dir, SMALL)
        llm.generate([prompt(10)], greedy(3), use_tqdm=False)
        pool = llm.engine.cache.k_pages
        del llm
        assert pool.untyped_storage().nbytes() == 0
    finally:
        gc.enable()


def test_engines_built_one_after_another_each_give_the_tokens_of_an_engine_built_alone(model_dir):
    prompts = [prompt(random.randint(5, 40)) for _ in range(3)]
    alone = {name: run(make_llm(model_dir, quest), prompts, greedy(8)) for name, quest in ENGINES.items()}
    for name, quest in list(ENGINES.items()) * 2:
        llm = make_llm(model_dir, quest)
        assert run(llm, prompts, greedy(8)) == alone[name]
        del llm
