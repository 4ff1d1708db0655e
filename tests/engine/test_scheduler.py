"""Scheduler: a hypothesis state machine over add / step / abort on a tiny pool, and direct policy tests."""

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from questkv.cache.paged import PagedKVCache
from questkv.engine.sampling_params import SamplingParams
from questkv.engine.step_data import ScheduledBatch
from questkv.engine.scheduler import Scheduler
from questkv.engine.sequence import RequestOutput, Sequence, SequenceStatus

PAGE, EOS = 4, 0


def make_scheduler(num_pages=10, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64, max_seqs=8,
                   max_pages_per_seq=None, chunked_prefill=False, quest=None, speculation=None):
    cache = PagedKVCache(1, 1, 1, num_pages, PAGE, max_seqs=max_seqs, max_pages_per_seq=max_pages_per_seq)
    return Scheduler(cache, max_num_seqs, max_num_batched_tokens, frozenset({EOS}), max_model_len,
                     chunked_prefill=chunked_prefill, quest=quest, speculation=speculation)


def request(request_id, prompt_len, **params):
    return Sequence(str(request_id), [random.randint(1, 99) for _ in range(prompt_len)], SamplingParams(**params))


def step(scheduler, token=7):
    """One schedule + update with ``token`` for every sequence; returns the batch and the finished."""
    batch = scheduler.schedule()
    return batch, scheduler.update(batch, [token] * batch.num_sampled)


def run_to_completion(scheduler, tokens=lambda: 7, max_steps=10_000):
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return
        batch = scheduler.schedule()
        scheduler.update(batch, [tokens() for _ in range(batch.num_sampled)])
    raise AssertionError("the scheduler did not finish its requests")


class SchedulerMachine(RuleBasedStateMachine):
    """Random requests on a 10-page pool (preemption is frequent); a shadow of every request's tokens."""

    POOL, MAX_NUM_SEQS, MAX_MODEL_LEN = 10, 3, 30

    def __init__(self):
        super().__init__()
        self.scheduler = make_scheduler(self.POOL, self.MAX_NUM_SEQS, max_num_batched_tokens=12,
                                        max_model_len=self.MAX_MODEL_LEN, max_seqs=4)
        self.cache = self.scheduler.cache
        self.seqs = {}     # request id -> Sequence, finished ones included
        self.tokens = {}   # request id -> the tokens the test fed it
        self.next_id = 0
        self.steps = {"decode": 0, "prefill": 0, "mixed": 0}  # the steps scheduled, and their tokens by row kind
        self.step_tokens = {"decode": 0, "verify": 0, "prefill": 0}

    @rule(prompt_len=st.integers(1, 32), max_tokens=st.integers(1, 20), ignore_eos=st.booleans(),
          stop_token=st.sampled_from([None, 3]))
    def add(self, prompt_len, max_tokens, ignore_eos, stop_token):
        self.admit(request(self.next_id, prompt_len, max_tokens=max_tokens, ignore_eos=ignore_eos,
                           stop_token_ids=[] if stop_token is None else [stop_token]))

    def admit(self, seq: Sequence) -> None:
        """Add ``seq`` (the next id), expecting a refusal exactly when it cannot fit."""
        self.next_id += 1
        prompt_len, max_tokens = seq.num_prompt_tokens, seq.sampling_params.max_tokens
        cached = prompt_len + max_tokens - 1
        fits = prompt_len + max_tokens <= self.MAX_MODEL_LEN and -(-cached // PAGE) <= self.POOL
        if not fits:
            with pytest.raises(ValueError):
                self.scheduler.add(seq)
            return
        self.scheduler.add(seq)
        self.seqs[seq.request_id], self.tokens[seq.request_id] = seq, []

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(data=st.data())
    def step(self, data):
        batch = self.scheduler.schedule()
        assert batch is not None and len(batch.seqs) == len(batch.num_new_tokens) >= 1
        for seq, count in zip(batch.seqs, batch.num_new_tokens):
            assert seq.status is SequenceStatus.RUNNING
            assert self.cache.seq_len(seq.cache_id) == seq.num_tokens  # inputs allocated, K/V to be written
            assert count == (seq.num_tokens if batch.num_prefills else 1)
        if not batch.num_prefills:
            assert list(batch.seqs) == self.scheduler.running
        token_ids = data.draw(st.lists(st.integers(0, 5), min_size=len(batch.seqs), max_size=len(batch.seqs)))
        finished = self.update(batch, token_ids)
        for seq, token in zip(batch.seqs, token_ids):
            params = seq.sampling_params
            if (token == EOS and not params.ignore_eos) or token in params.stop_token_ids:
                assert seq.status is SequenceStatus.FINISHED_STOPPED and seq in finished
            elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.MAX_MODEL_LEN:
                assert seq.status is SequenceStatus.FINISHED_LENGTH and seq in finished
            else:
                assert not seq.is_finished and seq not in finished

    def update(self, batch: ScheduledBatch, token_ids: list[int]) -> list[Sequence]:
        """``scheduler.update`` with the step's sampled ``token_ids`` (one per sampling sequence), checking that each
        sampling sequence's outputs grew by its token; returns the finished sequences."""
        self.steps["mixed" if batch.num_decodes and batch.num_prefills else
                   "decode" if batch.num_decodes else "prefill"] += 1
        self.step_tokens["decode"] += sum(batch.num_new_tokens[:batch.num_decodes])
        self.step_tokens["prefill"] += sum(batch.num_new_tokens[batch.num_decodes:])
        finished = self.scheduler.update(batch, token_ids)
        for seq, token in zip(batch.seqs[:batch.num_sampled], token_ids):
            self.tokens[seq.request_id].append(token)
            assert seq.output_token_ids == self.tokens[seq.request_id]
        return finished

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs[request_id]
        was_live = not seq.is_finished
        assert self.scheduler.abort(request_id) == was_live
        assert seq.is_finished and seq.cache_id is None
        if was_live:
            assert seq.finish_reason == "abort"

    @invariant()
    def the_scheduler_counts_its_steps_and_their_tokens_by_kind(self):
        assert self.scheduler.step_counts == self.steps and self.scheduler.step_tokens == self.step_tokens

    @invariant()
    def every_page_is_free_or_owned_by_exactly_one_running_sequence(self):
        running = self.scheduler.running
        owned = [page for seq in running for page in self.cache.pages_of(seq.cache_id)]
        assert len(owned) == len(set(owned))
        assert len(owned) + self.cache.num_free_pages == self.POOL
        assert sorted(self.cache.sequences) == sorted(seq.cache_id for seq in running)

    @invariant()
    def running_sequences_cache_all_but_their_last_token(self):
        scheduler = self.scheduler
        assert scheduler.num_running <= self.MAX_NUM_SEQS
        for seq in scheduler.running:
            cached = self.cache.seq_len(seq.cache_id)
            assert seq.status is SequenceStatus.RUNNING
            if seq is scheduler.prefilling:  # with chunks: the newest, part of its tokens cached
                assert seq is scheduler.running[-1] and 0 < cached < seq.num_tokens
            else:
                assert cached == seq.num_tokens - 1

    @invariant()
    def waiting_and_finished_sequences_own_no_pages(self):
        for seq in self.scheduler.waiting:
            assert seq.status is SequenceStatus.WAITING and seq.cache_id is None
        for seq in self.seqs.values():
            if seq.is_finished:
                assert seq.cache_id is None and seq not in self.scheduler.running
                assert seq not in self.scheduler.waiting
        live = self.scheduler.num_running + self.scheduler.num_waiting
        assert live == sum(not seq.is_finished for seq in self.seqs.values())


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


class ChunkedSchedulerMachine(SchedulerMachine):
    """The same with chunked prefill: steps of at most 4 tokens mix every decodable sequence's token with prefill
    chunks, so that prompts take several steps beside decodes; preemption and aborts reach sequences mid-prefill."""

    BUDGET = 4

    def __init__(self):
        super().__init__()
        self.scheduler = make_scheduler(self.POOL, self.MAX_NUM_SEQS, max_num_batched_tokens=self.BUDGET,
                                        max_model_len=self.MAX_MODEL_LEN, max_seqs=4, chunked_prefill=True)
        self.cache = self.scheduler.cache
        self.mixed_steps = 0

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(data=st.data())
    def step(self, data):
        self.run_step(lambda n: data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)))

    def run_step(self, draw_tokens):
        """One schedule and update, the tokens from ``draw_tokens(number of sampling sequences)``."""
        scheduler = self.scheduler
        decodable = [seq for seq in scheduler.running if seq is not scheduler.prefilling]
        preemptions = {seq.request_id: seq.num_preemptions for seq in decodable}
        batch = scheduler.schedule()
        assert batch is not None and batch.num_tokens <= self.BUDGET
        # Every decodable sequence decodes, unless this step preempted it (the newest first) for room.
        kept = [seq for seq in decodable if seq.num_preemptions == preemptions[seq.request_id]]
        assert list(batch.seqs[:batch.num_decodes]) == kept == decodable[:len(kept)]
        self.mixed_steps += bool(batch.num_decodes and batch.num_prefills)
        for i, (seq, count) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            assert seq.status is SequenceStatus.RUNNING and self.cache.seq_len(seq.cache_id) == batch.seq_lens[i]
            if i < batch.num_decodes:
                assert count == 1 and batch.seq_lens[i] == seq.num_tokens
            else:
                assert 1 <= count <= batch.seq_lens[i] <= seq.num_tokens
        assert (scheduler.prefilling is batch.seqs[-1]) == batch.partial
        self.update(batch, draw_tokens(batch.num_sampled))


TestChunkedSchedulerMachine = ChunkedSchedulerMachine.TestCase
TestChunkedSchedulerMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def test_the_chunked_state_machine_mixes_decodes_and_chunks_in_a_step():
    machine = ChunkedSchedulerMachine()
    machine.add(prompt_len=3, max_tokens=10, ignore_eos=True, stop_token=None)
    machine.run_step(lambda n: [7] * n)
    machine.add(prompt_len=9, max_tokens=3, ignore_eos=True, stop_token=None)
    for _ in range(3):  # 3 decodes of the first request beside the second's chunks of 3 tokens
        machine.run_step(lambda n: [7] * n)
        machine.every_page_is_free_or_owned_by_exactly_one_running_sequence()
        machine.running_sequences_cache_all_but_their_last_token()
    assert machine.mixed_steps == 3


def test_waiting_requests_are_admitted_first_in_first_out_within_max_num_seqs():
    scheduler = make_scheduler(num_pages=20, max_num_seqs=2)
    seqs = [request(i, 3, max_tokens=2) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert not batch.num_decodes and batch.seqs == (seqs[0], seqs[1]) and batch.num_new_tokens == (3, 3)
    assert batch.seq_ids == (seqs[0].cache_id, seqs[1].cache_id) and batch.num_tokens == 6
    assert list(scheduler.waiting) == [seqs[2]]
    scheduler.update(batch, [7, 7])
    batch, finished = step(scheduler)  # decode: both reach max_tokens=2
    assert not batch.num_prefills and finished == [seqs[0], seqs[1]]
    batch = scheduler.schedule()
    assert not batch.num_decodes and batch.seqs == (seqs[2],)


def test_prefill_respects_max_num_batched_tokens_but_always_admits_one():
    scheduler = make_scheduler(num_pages=40, max_num_seqs=4, max_num_batched_tokens=10)
    long, short_a, short_b = request("long", 20), request("a", 6), request("b", 4)
    for seq in (long, short_a, short_b):
        scheduler.add(seq)
    assert scheduler.schedule().seqs == (long,)  # longer than the budget, alone
    assert scheduler.schedule().seqs == (short_a, short_b)  # 6 + 4 <= 10


def test_a_chunked_prompt_fills_the_token_budget_left_by_the_decodes_of_every_step():
    scheduler = make_scheduler(num_pages=40, max_num_seqs=4, max_num_batched_tokens=4, chunked_prefill=True)
    a, b, c = request("a", 3, max_tokens=20, ignore_eos=True), request("b", 10), request("c", 2)
    for seq in (a, b, c):
        scheduler.add(seq)
    steps = []
    for _ in range(6):
        batch = scheduler.schedule()
        steps.append(([seq.request_id for seq in batch.seqs], batch.num_new_tokens, batch.num_decodes, batch.partial))
        assert batch.num_tokens <= 4 and scheduler.prefilling is (batch.seqs[-1] if batch.partial else None)
        scheduler.update(batch, [7] * batch.num_sampled)
    assert steps == [
        (["a", "b"], (3, 1), 0, True),          # a, then b's first chunk: the 1 token left of the budget
        (["a", "b"], (1, 3), 1, True),          # a decodes, b's next chunk takes the rest: a mixed step
        (["a", "b"], (1, 3), 1, True),
        (["a", "b"], (1, 3), 1, False),         # b's last chunk (its first token comes from it); no room for c
        (["a", "b", "c"], (1, 1, 2), 2, False),  # two decodes, then c whole
        (["a", "b", "c"], (1, 1, 1), 3, False),  # a decode-only step
    ]
    assert a.num_output_tokens == 6 and b.num_output_tokens == 3 and c.num_output_tokens == 2


def test_a_partial_prefill_samples_nothing_and_decodes_run_in_every_step_of_a_long_prompt():
    scheduler = make_scheduler(num_pages=40, max_num_seqs=3, max_num_batched_tokens=5, max_model_len=80,
                               max_pages_per_seq=20, chunked_prefill=True)
    short = [request(f"s{i}", 2, max_tokens=30, ignore_eos=True) for i in range(2)]
    for seq in short:
        scheduler.add(seq)
    step(scheduler)
    long = request("long", 39, max_tokens=2, ignore_eos=True)
    scheduler.add(long)
    chunks = 0
    while long.num_output_tokens == 0:
        batch = scheduler.schedule()
        assert batch.seqs[:batch.num_decodes] == tuple(short) and batch.num_tokens <= 5
        assert batch.seqs[batch.num_decodes:] == (long,) and batch.num_new_tokens[-1] == 3
        chunks += 1
        if batch.partial:  # the chunk samples nothing: only the decode rows get tokens
            assert batch.num_sampled == 2 and long.num_in_flight == 0
        scheduler.update(batch, [7] * batch.num_sampled)
        assert long.num_output_tokens == (0 if batch.partial else 1)
    assert chunks == 39 // 3 and all(seq.num_output_tokens == 1 + chunks for seq in short)


def test_chunked_prefill_needs_a_token_budget_for_every_decode():
    with pytest.raises(ValueError, match="max_num_batched_tokens=2 must be >= max_num_seqs=3 with chunked prefill"):
        make_scheduler(max_num_seqs=3, max_num_batched_tokens=2, chunked_prefill=True)
    make_scheduler(max_num_seqs=3, max_num_batched_tokens=2)  # without chunking it bounds prefill steps only


def test_a_chunked_prefill_that_loses_its_pages_to_decodes_restarts_and_an_abort_mid_prefill_frees_them():
    scheduler = make_scheduler(num_pages=6, max_num_seqs=2, max_num_batched_tokens=2, chunked_prefill=True)
    cache = scheduler.cache
    a, b = request("a", 4, max_tokens=16, ignore_eos=True), request("b", 12, max_tokens=1)
    scheduler.add(a)
    scheduler.add(b)
    mixed = 0
    while b.num_preemptions == 0:  # one-token chunks of b ride along a's decodes, which take the last pages
        batch = scheduler.schedule()
        mixed += batch.num_decodes == 1 and batch.num_prefills == 1
        scheduler.update(batch, [7] * batch.num_sampled)
    assert mixed and scheduler.prefilling is None and b.cache_id is None and list(scheduler.waiting) == [b]
    assert b.status is SequenceStatus.WAITING and b.num_output_tokens == 0 and b.num_in_flight == 0
    assert len(cache.pages_of(a.cache_id)) + cache.num_free_pages == 6
    run_to_completion(scheduler)
    assert b.num_output_tokens == 1 and cache.num_free_pages == 6
    c = request("c", 12, max_tokens=1)
    scheduler.add(c)
    for _ in range(3):
        scheduler.update(scheduler.schedule(), [])
    assert scheduler.prefilling is c and cache.seq_len(c.cache_id) == 6
    assert scheduler.abort("c") and scheduler.prefilling is None and cache.num_free_pages == 6
    assert scheduler.schedule() is None


def test_preemption_takes_the_newest_sequence_and_puts_it_first_in_the_queue():
    scheduler = make_scheduler(num_pages=4, max_num_seqs=3)
    old, new = request("old", 4, max_tokens=8, ignore_eos=True), request("new", 4, max_tokens=8, ignore_eos=True)
    scheduler.add(old)
    scheduler.add(new)
    batch, _ = step(scheduler)
    assert batch.seqs == (old, new)  # 1 page each, room kept for one decode step each
    late = request("late", 2, max_tokens=2)
    scheduler.add(late)
    for _ in range(4):  # cache tokens 5 to 8 of each: their second pages, then no page is left
        batch, _ = step(scheduler)
        assert batch.seqs == (old, new) and not batch.num_prefills
    assert scheduler.cache.num_free_pages == 0 and new.num_tokens == 9
    batch, _ = step(scheduler)  # both need a third page: the newest goes
    assert batch.seqs == (old,)
    assert new.status is SequenceStatus.WAITING and new.cache_id is None and new.num_preemptions == 1
    assert list(scheduler.waiting) == [new, late] and old.num_preemptions == 0
    while old in scheduler.running:
        step(scheduler)
    batch = scheduler.schedule()  # recompute: prompt and generated tokens in one prefill
    assert not batch.num_decodes and batch.seqs[0] is new and batch.num_new_tokens[0] == 9
    assert scheduler.cache.seq_len(new.cache_id) == 9
    scheduler.update(batch, [7] * len(batch.seqs))
    assert new.output_token_ids == [7] * 6 and scheduler.cache.seq_len(new.cache_id) == new.num_tokens - 1


@pytest.mark.parametrize(
    "params, tokens, status, reason, num_output",
    [
        ({}, [5, EOS, 5], SequenceStatus.FINISHED_STOPPED, None, 2),
        ({"ignore_eos": True, "max_tokens": 3}, [5, EOS, 5], SequenceStatus.FINISHED_LENGTH, None, 3),
        ({"stop_token_ids": [9]}, [5, 9, 5], SequenceStatus.FINISHED_STOPPED, 9, 2),
        ({"stop_token_ids": [9], "ignore_eos": True}, [EOS, 9, 5], SequenceStatus.FINISHED_STOPPED, 9, 2),
        ({"max_tokens": 2}, [5, 6, 7], SequenceStatus.FINISHED_LENGTH, None, 2),
        ({"max_tokens": 4}, [5] * 10, SequenceStatus.FINISHED_LENGTH, None, 4),  # max_model_len = 10 too
        ({"max_tokens": 2}, [5, EOS], SequenceStatus.FINISHED_STOPPED, None, 2),  # a stop wins over length
    ],
)
def test_token_stops_finish_with_their_reason_and_free_the_pages(params, tokens, status, reason, num_output):
    scheduler = make_scheduler(num_pages=10, max_model_len=10)
    seq = request("r", 6, **{"max_tokens": 4, **params})
    scheduler.add(seq)
    for token in tokens:
        batch = scheduler.schedule()
        if batch is None:
            break
        scheduler.update(batch, [token])
    assert seq.status is status and seq.stop_reason == reason and seq.num_output_tokens == num_output
    assert seq.finish_reason == status.value and seq.cache_id is None
    assert scheduler.cache.num_free_pages == 10 and not scheduler.has_unfinished()
    assert scheduler.schedule() is None


def test_abort_frees_pages_at_once_for_running_and_waiting_requests():
    scheduler = make_scheduler(num_pages=10, max_num_seqs=1)
    running, waiting = request("run", 9), request("wait", 3)
    scheduler.add(running)
    scheduler.add(waiting)
    step(scheduler)
    assert scheduler.cache.num_free_pages == 7
    assert scheduler.abort("run")
    assert scheduler.cache.num_free_pages == 10 and running.finish_reason == "abort" and running.cache_id is None
    assert running.finished_time is not None and scheduler.num_running == 0
    assert scheduler.abort("wait") and scheduler.num_waiting == 0 and waiting.status is SequenceStatus.FINISHED_ABORTED
    assert not scheduler.abort("wait") and not scheduler.abort("never")
    assert scheduler.schedule() is None


def test_a_sequence_aborted_between_schedule_and_update_is_skipped():
    scheduler = make_scheduler()
    a, b = request("a", 3), request("b", 3)
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()
    scheduler.abort("a")
    assert scheduler.update(batch, [7, EOS]) == [b]
    assert a.output_token_ids == [] and a.finish_reason == "abort" and b.finish_reason == "stop"


def test_free_pages_return_to_their_start_after_many_requests():
    scheduler = make_scheduler(num_pages=12, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=40)
    for i in range(60):
        scheduler.add(request(i, random.randint(1, 20), max_tokens=random.randint(1, 19),
                              ignore_eos=random.random() < 0.5))
    run_to_completion(scheduler, tokens=lambda: random.choice([EOS, 5, 6, 7, 8, 9, 10, 11]))
    assert scheduler.cache.num_free_pages == 12 and scheduler.cache.sequences == []


@pytest.mark.parametrize(
    "prompt, max_tokens, message",
    [
        (20, 1, r"the prompt has 20 tokens but max_model_len=20 allows at most 19"),
        (25, 1, r"the prompt has 25 tokens but max_model_len=20"),
        (10, 2, r"caches up to 11 tokens, 3 pages of 4, but the KV cache has 2 pages for requests"),
    ],
)
def test_check_fits_refuses_requests_that_cannot_run_alone(prompt, max_tokens, message):
    scheduler = make_scheduler(num_pages=2, max_model_len=20)
    with pytest.raises(ValueError, match=message):
        scheduler.check_fits(prompt, max_tokens)
    with pytest.raises(ValueError, match=message):
        scheduler.add(request("r", prompt, max_tokens=max_tokens))
    assert not scheduler.has_unfinished()
    scheduler.check_fits(8, 1)  # 8 tokens cached at most: exactly 2 pages
    make_scheduler(num_pages=2, max_model_len=9).check_fits(5, 4)  # 8 cached tokens: max_model_len's last
    with pytest.raises(ValueError, match="max_tokens=5 with the prompt's 5 tokens exceeds max_model_len=9"):
        make_scheduler(num_pages=2, max_model_len=9).check_fits(5, 5)  # refused, never clamped


def test_check_fits_names_the_per_sequence_page_limit_and_bad_arguments():
    scheduler = make_scheduler(num_pages=10, max_pages_per_seq=2, max_model_len=100)
    scheduler.check_fits(5, 4)
    with pytest.raises(ValueError, match="one sequence may hold at most max_pages_per_seq=2"):
        scheduler.check_fits(5, 5)
    with pytest.raises(ValueError, match="num_prompt_tokens must be >= 1"):
        scheduler.check_fits(0, 5)
    with pytest.raises(ValueError, match="SamplingParams.max_tokens must be >= 1"):
        scheduler.check_fits(3, 0)


def test_add_refuses_duplicates_and_sequences_that_are_not_new():
    scheduler = make_scheduler()
    scheduler.add(request("r", 3))
    with pytest.raises(ValueError, match="request id 'r' is already waiting or running"):
        scheduler.add(request("r", 3))
    done = request("d", 3)
    done.status = SequenceStatus.FINISHED_STOPPED
    with pytest.raises(ValueError, match="takes a new waiting sequence; request 'd' has status FINISHED_STOPPED"):
        scheduler.add(done)
    assert scheduler.num_waiting == 1


def test_update_with_the_wrong_token_count_changes_nothing():
    scheduler = make_scheduler()
    seq = request("r", 3)
    scheduler.add(seq)
    batch = scheduler.schedule()
    with pytest.raises(ValueError, match="update got 2 token ids for a batch of 1 sampling sequences"):
        scheduler.update(batch, [1, 2])
    with pytest.raises(ValueError, match=r"token_ids\[0\] must be >= 0, got -3"):
        scheduler.update(batch, [-3])
    assert seq.output_token_ids == [] and scheduler.cache.seq_len(seq.cache_id) == 3
    scheduler.update(batch, [5])
    assert seq.output_token_ids == [5]


def test_a_lone_sequence_without_room_is_a_runtime_error_stating_the_state():
    scheduler = make_scheduler(num_pages=3)
    seq = request("r", 4, max_tokens=5)
    scheduler.add(seq)
    step(scheduler)
    cache = scheduler.cache
    thief = cache.add_sequence()  # pages taken behind the scheduler's back
    cache.allocate([thief], [cache.num_free_pages * PAGE])
    with pytest.raises(RuntimeError, match="request 'r' runs alone but cannot get room for its next token: it "
                                           "caches 4 tokens in 1 pages, 0 pages free of 3"):
        scheduler.schedule()


def test_a_stop_string_on_the_last_token_relabels_a_finished_request_but_not_an_aborted_one():
    scheduler = make_scheduler()
    seq = request("r", 3, max_tokens=1)
    scheduler.add(seq)
    _, finished = step(scheduler)
    assert finished == [seq] and seq.finish_reason == "length"
    scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED, "###")
    assert seq.finish_reason == "stop" and seq.stop_reason == "###"
    scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED, "\n")  # a stop token that also ends a stop string
    assert seq.stop_reason == "\n" and scheduler.cache.num_free_pages == 10
    with pytest.raises(ValueError, match="already finished"):
        scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
    aborted = request("a", 2)
    scheduler.add(aborted)
    scheduler.abort("a")
    with pytest.raises(ValueError, match=r"request 'a' already finished \(FINISHED_ABORTED\)"):
        scheduler.finish(aborted, SequenceStatus.FINISHED_STOPPED, "x")
    with pytest.raises(ValueError, match="needs a finished status"):
        scheduler.finish(request("x", 2), SequenceStatus.RUNNING)
    with pytest.raises(ValueError, match="request 'x' is not waiting or running"):
        scheduler.finish(request("x", 2), SequenceStatus.FINISHED_STOPPED)


def test_metrics_and_request_output_describe_the_finished_request():
    scheduler = make_scheduler()
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=3), prompt="abc")
    assert seq.metrics().time_to_first_token is None
    scheduler.add(seq)
    for _ in range(3):
        step(scheduler)
    seq.tokens_attended_sum, seq.decode_steps = 9.0, 2
    output = RequestOutput.from_sequence(seq, text="xyz")
    assert output.token_ids == (7, 7, 7) and output.prompt_token_ids == (1, 2, 3) and output.prompt == "abc"
    assert output.finish_reason == "length" and output.finished and output.text == "xyz"
    metrics = output.metrics
    assert metrics.time_to_first_token >= 0 and metrics.mean_tokens_attended == 4.5
    assert metrics.num_preemptions == 0
    assert metrics.decode_tokens_per_s is None or metrics.decode_tokens_per_s > 0
    assert seq.first_token_time <= seq.finished_time


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"request_id": ""}, "Sequence.request_id must be a non-empty str"),
        ({"prompt_token_ids": []}, "Sequence.prompt_token_ids must be a non-empty list"),
        ({"prompt_token_ids": [1, -2]}, r"Sequence.prompt_token_ids\[1\] must be an int >= 0, got -2"),
        ({"sampling_params": {"max_tokens": 3}}, "Sequence.sampling_params must be a SamplingParams"),
    ],
)
def test_sequence_validates_its_request(kwargs, message):
    args = {"request_id": "r", "prompt_token_ids": [1, 2]}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        Sequence(**args)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_num_seqs": 0}, "Scheduler.max_num_seqs must be >= 1"),
        ({"max_num_seqs": 9}, "Scheduler.max_num_seqs must be <= 8"),
        ({"max_num_batched_tokens": 0}, "Scheduler.max_num_batched_tokens must be >= 1"),
        ({"max_model_len": 1}, "Scheduler.max_model_len must be >= 2"),
        ({"eos_token_ids": [-1]}, "Scheduler.eos_token_ids must be >= 0"),
    ],
)
def test_scheduler_arguments_are_validated(kwargs, message):
    args = {"cache": PagedKVCache(1, 1, 1, 4, PAGE, max_seqs=8), "max_num_seqs": 2, "max_num_batched_tokens": 8,
            "eos_token_ids": [EOS], "max_model_len": 16}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        Scheduler(**args)


def test_scheduled_batch_is_plain_data():
    batch = ScheduledBatch((), (), ())
    assert batch.seq_ids == () and batch.num_tokens == 0 and batch.num_decodes == batch.num_prefills == 0
