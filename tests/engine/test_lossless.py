"""Lossless Quest (``speculative_config``: Quest drafts, dense attention verifies) in the engine on CPU, fp32: greedy
output equals the dense engine's token for token whatever the batch, budget, draft count, selection reuse,
preemption, prefix hits, chunking and stops; the page bounds after every step equal a recomputation from the
keys the pages hold; seeded sampling gives the dense engine's samples; bad settings are refused. Rounds of a fixed
draft count unless a test says otherwise (the adaptive policy mostly picks dense steps on a CPU).
The tiny random model and prompts of ``test_llm.py``."""

import dataclasses
import math
import random

import pytest
import torch

from questkv import QuestConfig
from questkv.config import MAX_SPECULATIVE_TOKENS
from questkv.decode.route import StepRoute
from questkv.engine.sampling_params import SamplingParams
from questkv.engine.speculation import StepKind
from tests.engine.test_llm import MAX_LEN, PAGE, SMALL, VOCAB, first_new, greedy, make_llm, pool_memory, prompt, run
from tests.engine.test_prefix_caching import assert_pages_all_back
from tests.helpers import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), VOCAB, seed=random.randrange(1 << 16))


@pytest.fixture(scope="module")
def dense(model_dir):
    return make_llm(model_dir)


def lossless(model_dir, k: int = 4, quest: QuestConfig = SMALL, adaptive: bool = False, **kwargs):
    """A lossless engine; fixed rounds of ``k`` drafts unless ``adaptive`` (then the measured step times pick, and
    on a CPU they mostly pick dense steps)."""
    config = {"method": "quest", "num_speculative_tokens": k, "adaptive": adaptive}
    return make_llm(model_dir, quest, speculative_config=config, **kwargs)


# Synchronous steps, or asynchronous scheduling: a round's drafts launched one step ahead of their update.
ASYNC = pytest.mark.parametrize("asynchronous", [False, True])


def ragged(count: int = 4):
    """``count`` prompts of 1-90 tokens and greedy params of 1-30 tokens; the first request surely has a round to
    verify (a context past SMALL's budget, and room for a draft and its verify's token after the first token)."""
    prompts = [prompt(random.randint(20 if i == 0 else 1, 90)) for i in range(count)]
    return prompts, [greedy(random.randint(3 if i == 0 else 1, 30)) for i in range(count)]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@ASYNC
def test_greedy_output_is_the_dense_engines_for_ragged_batches(model_dir, dense, k, asynchronous):
    prompts, params = ragged()
    llm = lossless(model_dir, k, async_scheduling=asynchronous)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [out.token_ids for out in outputs] == run(dense, prompts, params)
    verified = [out.metrics for out in outputs if out.metrics.mean_tokens_per_verify is not None]
    assert verified and all(1 <= m.mean_tokens_per_verify <= k + 1 and 0 <= m.acceptance_rate <= 1 for m in verified)
    assert all(1 <= len(m.acceptance_by_position) <= k for m in verified)


def test_a_lossy_quest_engine_differs_from_dense_where_lossless_does_not(model_dir, dense):
    """The equality above can fail: Quest alone, at this budget, changes the greedy output."""
    prompts = [prompt(random.randint(60, 90)) for _ in range(6)]
    params = greedy(30)
    want = run(dense, prompts, params)
    assert run(make_llm(model_dir, SMALL), prompts, params) != want
    assert run(lossless(model_dir), prompts, params) == want


@pytest.mark.parametrize("budget", [8, 12, 16])
def test_every_request_budget_and_draft_count_with_selection_reuse_gives_the_dense_tokens(model_dir, dense,
                                                                                          budget):
    quest = dataclasses.replace(SMALL, selection_interval=3)
    prompts, _ = ragged(5)
    params = [greedy(random.randint(5, 30), token_budget=budget, speculative_tokens=random.randint(1, 16))
              for _ in prompts]
    want = run(dense, prompts, [greedy(p.max_tokens) for p in params])
    assert run(lossless(model_dir, 16, quest), prompts, params) == want


@ASYNC
def test_dense_and_lossy_requests_share_a_batch_with_lossless_ones(model_dir, dense, asynchronous):
    prompts, _ = ragged(6)
    kinds = ["lossless", "dense", "lossy", "lossless", "lossy", "dense"]
    extra = {"lossless": {}, "dense": {"dense": True}, "lossy": {"speculative_tokens": 0}}
    params = [greedy(random.randint(5, 30), **extra[kind]) for kind in kinds]
    llm = lossless(model_dir, 3, async_scheduling=asynchronous)
    outputs = run(llm, prompts, params)
    want_dense = run(dense, prompts, [greedy(p.max_tokens) for p in params])
    want_lossy = run(make_llm(model_dir, SMALL), prompts, [greedy(p.max_tokens) for p in params])
    for kind, out, exact, lossy in zip(kinds, outputs, want_dense, want_lossy):
        assert out == (lossy if kind == "lossy" else exact), kind


@ASYNC
def test_preemption_mid_round_gives_the_dense_tokens_and_leaks_no_page(model_dir, asynchronous):
    unconstrained = make_llm(model_dir, max_model_len=64)
    per_seq = math.ceil(64 / PAGE)
    scratch = math.ceil((MAX_SPECULATIVE_TOKENS + 1) / PAGE)  # a lossless engine's padding rows' pages
    pages = per_seq + 1 + scratch
    tiny = lossless(model_dir, 5, max_model_len=64, async_scheduling=asynchronous,
                    kv_cache_memory=pool_memory(make_llm(model_dir, SMALL, max_model_len=64), pages))
    assert tiny.engine.cache.num_pages == pages
    prompts = [prompt(random.randint(20, 30)) for _ in range(4)]
    params = [greedy(30), greedy(34), greedy(28), greedy(25)]
    outputs = tiny.generate(prompts, params, use_tqdm=False)
    assert sum(out.metrics.num_preemptions for out in outputs) > 0
    assert [out.token_ids for out in outputs] == run(unconstrained, prompts, params)
    assert_pages_all_back(tiny)


@pytest.mark.parametrize("chunked", [True, False])
@ASYNC
def test_chunked_prefill_on_or_off_gives_the_dense_tokens(model_dir, dense, chunked, asynchronous):
    llm = lossless(model_dir, 4, enable_chunked_prefill=chunked, async_scheduling=asynchronous,
                   max_num_batched_tokens=40 if chunked else None)
    prompts, params = ragged(6)
    assert run(llm, prompts, params) == run(dense, prompts, params)


@ASYNC
def test_lossless_answers_are_cached_for_the_next_turn(model_dir, dense, asynchronous):
    """Verified K/V are dense attention's, so a conversation's next turn hits the earlier answers too (a lossy Quest
    answer is recomputed); asynchronously too, where a round's first draft writes the newest token's K/V before the
    update that appends it (that token's page is offered only once a verify rewrote it)."""
    llm = lossless(model_dir, 4, async_scheduling=asynchronous)
    conversation, cached_before = prompt(60), 0
    for _ in range(3):
        (out,) = llm.generate([conversation], greedy(12), use_tqdm=False)
        assert out.token_ids == run(dense, [conversation], greedy(12))[0]
        assert out.metrics.num_cached_tokens == (cached_before // PAGE) * PAGE
        cached_before = len(conversation) + len(out.token_ids) - 1
        conversation = conversation + list(out.token_ids) + prompt(6)
    assert_pages_all_back(llm)


@ASYNC
def test_stops_and_max_tokens_inside_an_accepted_run_end_the_output_there(model_dir, dense, asynchronous):
    llm = lossless(model_dir, 8, async_scheduling=asynchronous)
    k = None
    while k is None:  # a prompt whose greedy output has a new, non-special token past the first rounds
        p = prompt(random.randint(60, 90))
        (ref,) = run(dense, [p], greedy(24))
        k = first_new(ref, 3)  # ref[k] first appears at k
    word = f"x{ref[k]:02d}"
    stops = [greedy(24, stop_token_ids=[ref[k]]), greedy(24, stop=word), greedy(k + 1), greedy(24)]
    by_token, by_string, by_length, free = llm.generate([p] * 4, stops, use_tqdm=False)
    assert by_token.token_ids == ref[:k + 1] and by_token.stop_reason == ref[k]
    assert by_string.token_ids == ref[:k + 1] and by_string.stop_reason == word and word not in by_string.text
    assert by_length.token_ids == ref[:k + 1] and by_length.finish_reason == "length"
    assert free.token_ids == ref
    assert_pages_all_back(llm)


@ASYNC
def test_page_bounds_after_every_step_equal_a_recomputation_from_the_kept_keys(model_dir, asynchronous):
    """The draft steps widen the bounds with keys that the verify overwrites or drops; the verify's update recomputes
    them (before any later step is launched: a verify launched ahead is checked after its update)."""
    llm = lossless(model_dir, 6, async_scheduling=asynchronous)
    engine = llm.engine
    cache = engine.cache
    for p in [prompt(random.randint(30, 80)) for _ in range(3)]:
        engine.add_request(p, greedy(40))
    rounds = 0
    while engine.has_unfinished_requests():
        engine.step()
        if engine._in_flight is not None and engine._in_flight[0].num_verifies:
            continue
        for seq in engine.scheduler.running:
            length = cache.seq_len(seq.cache_id)
            for logical, page in enumerate(cache.pages_of(seq.cache_id)):
                keys = cache.k_pages[:, page, :min(PAGE, length - logical * PAGE)]
                assert torch.equal(cache.kmin[:, page], keys.amin(dim=1))
                assert torch.equal(cache.kmax[:, page], keys.amax(dim=1))
            rounds += seq.num_verify_steps
    assert rounds > 0


@ASYNC
def test_seeded_sampling_gives_the_dense_engines_samples(model_dir, dense, asynchronous):
    """Draft and verify draw each position with the request's seeded noise, so a sampled lossless output is the
    dense engine's sample token for token (hence its distribution, exactly), whatever was drafted and kept."""
    prompts = [prompt(random.randint(40, 90)) for _ in range(6)]
    params = [SamplingParams(temperature=random.choice([0.7, 1.0, 1.5]), top_k=random.choice([0, 5]),
                             top_p=random.choice([1.0, 0.9]), seed=random.randrange(1 << 30), max_tokens=20,
                             ignore_eos=True) for _ in prompts]
    want = run(dense, prompts, params)
    outputs = lossless(model_dir, 3, async_scheduling=asynchronous).generate(
        prompts, params, use_tqdm=False)
    assert [out.token_ids for out in outputs] == want
    assert sum(out.metrics.num_preemptions == 0 and (out.metrics.acceptance_rate or 0) > 0 for out in outputs) > 0
    assert run(make_llm(model_dir, SMALL), prompts, params) != want  # Quest alone samples other tokens


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_adaptive_policy_gives_the_dense_tokens(model_dir, dense, asynchronous):
    """With the engine picking the drafts per round from measured step times (whatever it picks), greedy and
    seeded outputs stay the dense engine's; with asynchronous scheduling the step in flight is finished before a
    round starts."""
    prompts, params = ragged(4)
    params[0] = SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    llm = lossless(model_dir, 4, adaptive=True, async_scheduling=asynchronous)
    assert run(llm, prompts, params) == run(dense, prompts, params)


def test_the_engine_times_each_verify_by_its_rounds_drafts(model_dir):
    """The policy learns a verify step's time per round length: full rounds of 3 drafts, and the shorter last
    round that ``max_tokens`` cuts."""
    llm = lossless(model_dir, 3)
    llm.generate([prompt(70)], greedy(10), use_tqdm=False)  # rounds yield 1..4 tokens: the last one may be cut
    timed = llm.engine.speculation._bucket(1).verify_by_drafts
    assert 3 in timed and set(timed) <= {1, 2, 3} and all(seconds > 0 for seconds in timed.values())


def test_a_step_whose_time_includes_a_graph_capture_teaches_the_policy_nothing(model_dir):
    """A CUDA graph's capture (here stood in for: an entry added to the runner's graphs as each verify step runs)
    makes its step's wall time no measure of the step: the policy records the drafts, no verify."""
    llm = lossless(model_dir, 3)
    runner = llm.engine.runner
    run_step = runner._run_step

    def capturing(key, body):
        if key[2] is StepRoute.VERIFY:
            runner.graphs._graphs[("captured", len(runner.graphs))] = None
        return run_step(key, body)

    runner._run_step = capturing
    llm.generate([prompt(70)], greedy(10), use_tqdm=False)
    runner.graphs._graphs.clear()
    bucket = llm.engine.speculation._bucket(1)
    assert bucket.seconds[StepKind.DRAFT] > 0 and not bucket.verify_by_drafts


def test_asynchronous_dense_steps_and_rounds_alternate_with_the_dense_tokens(model_dir, dense):
    """A policy that alternates between dense steps and rounds every few steps: the engine finishes the step in
    flight before each round; the tokens stay the dense engine's."""
    llm = lossless(model_dir, 3, adaptive=True, async_scheduling=True)
    calls = iter(range(1 << 20))
    llm.engine.speculation.draft_tokens = lambda batch: 3 if next(calls) % 7 < 4 else 0
    prompts, params = ragged(5)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [out.token_ids for out in outputs] == run(dense, prompts, params)
    assert any(out.metrics.mean_tokens_per_verify for out in outputs)


def test_asynchronous_rounds_launch_each_step_ahead_of_the_last_ones_update(model_dir, dense):
    """Under asynchronous scheduling a round's second and later drafts and its verify are launched while the draft
    before is in flight (its token read on the device), through the verify step's graph and through the prefill
    path (ragged rounds, a newcomer's prefill beside them), with the dense engine's tokens."""
    # Two rows at a time, chunked: a newcomer's prefill and its first draft land beside the others' rounds.
    llm = lossless(model_dir, 4, async_scheduling=True, max_num_seqs=2,
                   enable_chunked_prefill=True, max_num_batched_tokens=32)
    launches = []
    execute = llm.engine.runner.execute

    def record(batch):  # drafts in flight (this step's counted) on its decode rows and on its verify rows
        decodes, verifies = batch.seqs[:batch.num_decodes], batch.seqs[batch.num_decodes:][:batch.num_verifies]
        uniform = batch.num_verifies == len(batch.seqs) and len(set(batch.num_new_tokens)) == 1  # the verify graph
        launches.append((*(max((seq.num_drafts_in_flight for seq in rows), default=0) for rows in (decodes, verifies)),
                         uniform))
        return execute(batch)

    llm.engine.runner.execute = record
    prompts = [prompt(n) for n in (40, 70, 55, 20)]
    params = [greedy(30), greedy(17), greedy(23), greedy(26)]
    assert run(llm, prompts, params) == run(dense, prompts, params)
    assert any(decoding == 2 for decoding, _, _ in launches)  # a draft launched before the one ahead was updated
    assert {uniform for _, verifying, uniform in launches if verifying == 1} == {True, False}  # both verify paths
    assert all(verifying <= 1 for _, verifying, _ in launches)


def test_a_first_draft_launched_ahead_beside_a_prefill_chunk_gives_the_dense_tokens(model_dir, dense):
    """A long prompt prefilled in chunks while another request runs its rounds: a first draft launched before its
    verify's update shares a step with a prefill chunk (the mixed path's decode rows), with the dense engine's
    tokens."""
    llm = lossless(model_dir, 4, async_scheduling=True, max_num_seqs=2, enable_chunked_prefill=True,
                   max_num_batched_tokens=16)
    paths = set()
    execute = llm.engine.runner.execute

    def record(batch):
        if batch.ahead:
            paths.add(bool(batch.num_prefills))
        return execute(batch)

    llm.engine.runner.execute = record
    prompts, params = [prompt(40), prompt(90)], [greedy(30), greedy(20)]
    assert run(llm, prompts, params) == run(dense, prompts, params)
    assert True in paths


def test_a_rounds_first_draft_is_launched_before_its_verifys_update(model_dir, dense):
    """Asynchronous rounds of one request: every draft and verify is launched ahead of the update of the step
    before, the next round's first draft too, before the verify's update (its input token, position and KV length
    follow on the device from the drafts the verify keeps), wherever the longest kept run still leaves room for a
    draft and its verify before ``max_tokens``."""
    k, max_tokens = 4, 40
    llm = lossless(model_dir, k, async_scheduling=True)
    launches, drafts, due_ahead = [], [], 0
    execute = llm.engine.runner.execute

    def record(batch):
        nonlocal due_ahead
        launches.append(batch)
        drafts.extend(batch.seqs[i].num_drafts_in_flight for i in batch.drafts)  # (this step's counted)
        for seq in batch.seqs[batch.num_decodes:batch.num_decodes + batch.num_verifies]:
            due_ahead += seq.num_output_tokens + seq.verify_in_flight + 2 < max_tokens
        return execute(batch)

    llm.engine.runner.execute = record
    prompts, params = [prompt(70)], [greedy(max_tokens)]
    assert run(llm, prompts, params) == run(dense, prompts, params)
    ahead = [batch for batch in launches if batch.ahead]
    assert due_ahead >= 3 and len(ahead) == due_ahead
    assert all(batch.ahead == (k,) and batch.drafts == (0,) for batch in ahead)
    assert set(drafts) == {1, 2}  # a later draft launched before the one before it was updated


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_first_drafts_launched_ahead_in_ragged_batches_give_the_dense_engines_tokens(model_dir, dense, temperature):
    """Ragged rounds launched ahead of their verify's update, greedy or seeded: the drafts' positions, lengths and
    sampling indices follow on the device from each row's kept drafts; the outputs are the dense engine's, and each
    seeded draft draws with the index of the output it drafts (the dense step's noise there)."""
    llm = lossless(model_dir, 3, async_scheduling=True)
    runner, scheduler = llm.engine.runner, llm.engine.scheduler
    launched, indices, pending = [], {}, []
    execute, sampler, update = runner.execute, runner.tokens.sampler, scheduler.update

    def record(batch):
        launched.append(bool(batch.ahead))
        pending.append(batch)
        return execute(batch)

    def sample(logits, *args, **kwargs):  # args: temperature, top_k, top_p, seed, output index
        indices[id(pending[-1])] = args[4].tolist()
        return sampler(logits, *args, **kwargs)

    def check(batch, tokens, *args):  # a draft's index: the output its token would be once kept
        for i in batch.drafts:
            seq = batch.seqs[i]
            if id(batch) in indices and not seq.is_finished and seq.cache_id is not None:
                assert indices[id(batch)][i] == seq.num_output_tokens + len(seq.draft_token_ids)
        return update(batch, tokens, *args)

    runner.execute, runner.tokens.sampler, scheduler.update = record, sample, check
    prompts, params = ragged(6)
    params = [SamplingParams(temperature=temperature, seed=i, ignore_eos=True,
                             max_tokens=min(p.max_tokens + 10, MAX_LEN - len(prompts[i])))  # within max_model_len
              for i, p in enumerate(params)]
    assert run(llm, prompts, params) == run(dense, prompts, params)
    assert any(launched) and (temperature == 0 or indices)


@ASYNC
def test_a_step_captured_on_first_use_gives_the_dense_tokens(model_dir, dense, asynchronous):
    """On a GPU a graph captured on first use runs its step once eagerly before the capture, then replays it: that
    warm-up must leave what the replay reads again as it was (the step tokens a step reads its in-flight inputs from
    and then overwrites, the selection counters). Emulated here: every decode and verify step runs its body twice,
    :meth:`DecodeGraphs.warm_up` first."""
    prompts, params = ragged()
    plain = lossless(model_dir, 4, async_scheduling=asynchronous)
    plain.generate(prompts, params, use_tqdm=False)
    llm = lossless(model_dir, 4, async_scheduling=asynchronous)
    runner = llm.engine.runner

    def warmed_up_then_run(key, body):
        runner.graphs.warm_up(key, body)
        return body(*key)

    runner._run_step = warmed_up_then_run
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [out.token_ids for out in outputs] == run(dense, prompts, params)
    counted = [[counter.tolist() for counter in engine.engine.runner.memory.counters] for engine in (plain, llm)]
    assert counted[0] == counted[1]



@pytest.mark.parametrize("config, message", [
    ({"method": "quest", "num_speculative_tokens": 0}, r"num_speculative_tokens must be .* got 0"),
    ({"method": "quest", "num_speculative_tokens": 17}, r"num_speculative_tokens must be .* got 17"),
    ({"method": "ngram", "num_speculative_tokens": 2}, r"method must be one of .*'quest'.* got 'ngram'"),
    ({"method": "quest", "k": 2}, r"unknown keys \['k'\]"),
    ({"method": "quest", "adaptive": 1}, r"adaptive must be a bool"),
    ("quest", "must be a dict"),
])
def test_bad_speculative_configs_are_refused(model_dir, config, message):
    with pytest.raises(ValueError, match=message):
        lossless(model_dir).engine.config.__class__(model=str(model_dir), quest=SMALL, speculative_config=config)


def test_lossless_needs_quest(model_dir):
    with pytest.raises(ValueError, match="needs quest=QuestConfig"):
        make_llm(model_dir, speculative_config={"method": "quest", "num_speculative_tokens": 2})


@ASYNC
def test_two_tensor_parallel_ranks_give_the_dense_tokens(model_dir, dense, asynchronous):
    """Rank 0 sends the verify steps and the rewinds' recomputed bounds, and broadcasts each verify row's next
    input and kept drafts (a first draft launched ahead reads them); the other rank follows (gloo, CPU)."""
    prompts, params = ragged(5)
    params[1] = SamplingParams(temperature=1.0, seed=11, max_tokens=20, ignore_eos=True)
    with lossless(model_dir, 4, tensor_parallel_size=2, enable_chunked_prefill=True,
                  max_num_batched_tokens=48, async_scheduling=asynchronous) as sharded:
        assert run(sharded, prompts, params) == run(dense, prompts, params)


@pytest.mark.parametrize("fields, message", [
    ({"speculative_tokens": 17}, r"SamplingParams.speculative_tokens must be .* got 17"),
    ({"speculative_tokens": -1}, r"SamplingParams.speculative_tokens must be .* got -1"),
    ({"speculative_tokens": "2"}, r"SamplingParams.speculative_tokens must be an int"),
    ({"speculative_tokens": True}, r"SamplingParams.speculative_tokens must be an int"),
    ({"speculative_tokens": 2, "dense": True}, "dense=True attends every page; it excludes speculative_tokens=2"),
    ({"speculative_tokens": 2, "forced_token_ids": [3]}, "forced_token_ids replaces"),
])
def test_bad_request_fields_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_draft_tokens_on_an_engine_without_a_speculative_config_are_refused(model_dir):
    llm = make_llm(model_dir, SMALL)
    with pytest.raises(ValueError, match=r"speculative_tokens=2 needs an engine with lossless Quest"):
        llm.generate([prompt(5)], greedy(4, speculative_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_a_budget_covering_the_context_decodes_densely_without_drafting(model_dir, dense):
    """Where the route decodes densely (here: the budget covers every context), a lossless request drafts nothing:
    its steps are dense decode steps (the dense engine's: no books in the selection memory, whose rate counts draft
    steps), no verify runs."""
    full = QuestConfig(token_budget=MAX_LEN, page_size=PAGE, dense_layers=1)
    prompts, params = ragged(3)
    llm = lossless(model_dir, 4, full)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [out.token_ids for out in outputs] == run(dense, prompts, params)
    assert all(out.metrics.mean_tokens_per_verify is None and out.metrics.selection_rate is None for out in outputs)
    assert int(llm.engine.runner.memory.steps.sum()) == 0


def test_a_round_selects_pages_once_and_its_later_drafts_reuse_them(model_dir, dense):
    """With Quest's draft pages, the engine's buffers and selection memory are sized for reuse over a round: a round of 4 drafts estimates and
    selects at its first draft only (a quarter of the draft steps select), and the tokens stay dense's."""
    p = prompt(80)
    params = greedy(41)
    (out,) = lossless(model_dir, 4).generate([p], params, use_tqdm=False)
    assert out.token_ids == run(dense, [p], params)[0]
    assert 0.2 <= out.metrics.selection_rate <= 0.35
    # rounds of one draft: every draft selects
    (one,) = lossless(model_dir, 1).generate([p], params, use_tqdm=False)
    assert one.metrics.selection_rate == 1.0


def test_the_removed_draft_selection_is_refused_as_an_unknown_key(model_dir):
    with pytest.raises(ValueError, match=r"speculative_config has unknown keys \['draft_selection'\]"):
        make_llm(model_dir, SMALL, speculative_config={"method": "quest", "draft_selection": "verify"})


@pytest.mark.parametrize("adaptive", [False, True])
@ASYNC
def test_every_graph_step_of_requests_joining_mid_round_is_one_the_startup_capture_takes(
        model_dir, monkeypatch, adaptive, asynchronous):
    """What a lossless server meets when requests arrive while others draft: every decode-only and verify step
    runs a key (mapped to the CUDA runner's padded batch size and width) of :meth:`DecodeGraphs.missing`, so no step
    of it waits for a capture on a GPU."""
    from questkv.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes

    llm = lossless(model_dir, 4, adaptive=adaptive, async_scheduling=asynchronous, max_num_seqs=6)
    engine, runner = llm.engine, llm.engine.runner
    used = set()
    run_step = runner._run_step

    def recording(key, body):
        used.add(key)
        return run_step(key, body)

    monkeypatch.setattr(runner, "_run_step", recording)
    for _ in range(6):  # each request's prefill lands while the earlier ones draft or verify
        engine.add_request(prompt(random.randint(20, 90)), greedy(random.randint(8, 30)))
        for _ in range(random.randint(1, 4)):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)  # the keys only: no pool on a CPU machine
    sizes, pages = graph_batch_sizes(6), runner.cache.max_pages_per_seq
    cuda = DecodeGraphs(sizes, pages, torch.device("cpu"), reusing_steps=runner.graphs.reusing_steps,
                        sparse=runner.graphs.sparse, dense_pages=runner.graphs.dense_pages,
                        verify_lengths=runner.graphs.verify_lengths)
    on_cuda = {(cuda.padded(batch), cuda.width(width), route, flag) for batch, width, route, flag in used}
    if not adaptive:  # fixed rounds surely draft and verify (the adaptive policy may keep to dense steps on a CPU)
        assert {key[2] for key in on_cuda} >= {StepRoute.SPARSE, StepRoute.VERIFY}
    assert on_cuda <= set(cuda.missing()), on_cuda - set(cuda.missing())
