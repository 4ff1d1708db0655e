"""Scheduler with prefix caching: the state machine of ``test_scheduler`` on prompts that share prefixes, with the
pages counted by reference (a shared page once) and the hits checked; the same with chunked prefill (chunks that end
inside pages, preempted and aborted mid-prefill); a waiting prompt's pages are hashed once."""

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

import questkv.cache.paged
from questkv.cache.paged import PagedKVCache
from questkv.engine.sampling_params import SamplingParams
from questkv.engine.scheduler import Scheduler
from questkv.engine.sequence import Sequence, SequenceStatus
from tests.engine.test_scheduler import EOS, PAGE, SchedulerMachine

BASE = [random.randint(1, 99) for _ in range(32)]  # every prompt starts with a piece of it


class PrefixSchedulerMachine(SchedulerMachine):
    """Prompts are a prefix of ``BASE`` plus a short tail over two tokens, so prefix hits are frequent; running
    sequences share pages, finished ones leave cached pages that admission counts as free."""

    def __init__(self):
        super().__init__()
        cache = PagedKVCache(1, 1, 1, self.POOL, PAGE, max_seqs=4, prefix_caching=True)
        self.scheduler = Scheduler(cache, self.MAX_NUM_SEQS, 12, frozenset({EOS}), self.MAX_MODEL_LEN)
        self.cache = cache

    @rule(shared=st.integers(0, 28), tail=st.lists(st.integers(1, 2), max_size=6), max_tokens=st.integers(1, 20),
          ignore_eos=st.booleans())
    def add_sharing(self, shared, tail, max_tokens, ignore_eos):
        prompt = BASE[:shared] + tail or [1]
        seq = Sequence(str(self.next_id), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))
        self.next_id += 1
        if len(prompt) + max_tokens > self.MAX_MODEL_LEN or -(-(len(prompt) + max_tokens - 1) // PAGE) > self.POOL:
            with pytest.raises(ValueError):
                self.scheduler.add(seq)
            return
        self.scheduler.add(seq)
        self.seqs[seq.request_id], self.tokens[seq.request_id] = seq, []

    @rule(data=st.data())
    def step(self, data):
        if not self.scheduler.has_unfinished():
            return
        held_before = {page for seq in self.scheduler.running for page in self.cache.pages_of(seq.cache_id)}
        batch = self.scheduler.schedule()  # never stuck: cached pages are taken back when needed
        assert batch is not None and len(batch.seqs) == len(batch.num_new_tokens) >= 1
        shared_in_step = {}  # page -> batch indices that start on it
        for i, (seq, count) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            assert seq.status is SequenceStatus.RUNNING
            assert self.cache.seq_len(seq.cache_id) == seq.num_tokens == batch.seq_lens[i]
            if batch.num_prefills:
                hit = seq.num_tokens - count
                assert hit % PAGE == 0 and 1 <= count <= seq.num_tokens
                for page in self.cache.pages_of(seq.cache_id)[:hit // PAGE]:
                    shared_in_step.setdefault(page, []).append(i)
            else:
                assert count == 1
        if batch.num_prefills:
            # A page a sequence writes was held by no one before the step; only later sequences of the same step
            # share it (each layer writes the step's K/V before it attends), never an earlier or running one.
            for i, (seq, count) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
                for page in self.cache.pages_of(seq.cache_id)[(seq.num_tokens - count) // PAGE:]:
                    readers = shared_in_step.get(page, [])
                    assert page not in held_before and all(j > i for j in readers)
                    assert self.cache.refcount(page) == 1 + len(readers)
        self.update(batch, data.draw(st.lists(st.integers(0, 5), min_size=len(batch.seqs), max_size=len(batch.seqs))))

    @invariant()
    def every_page_is_free_or_held_by_its_reference_count_of_running_sequences(self):
        running = self.scheduler.running
        held = {}
        for seq in running:
            pages = self.cache.pages_of(seq.cache_id)
            assert len(pages) == len(set(pages))
            for page in pages:
                held[page] = held.get(page, 0) + 1
        assert len(held) + self.cache.num_free_pages == self.POOL
        assert all(self.cache.refcount(page) == count for page, count in held.items())
        assert sorted(self.cache.sequences) == sorted(seq.cache_id for seq in running)
        for seq in running:  # a shared page is a full page of each holder
            for j, page in enumerate(self.cache.pages_of(seq.cache_id)):
                if held[page] > 1:
                    assert (j + 1) * PAGE <= self.cache.seq_len(seq.cache_id)

    def every_page_is_free_or_owned_by_exactly_one_running_sequence(self):
        """Replaced by the reference-counted invariant above (pages are shared here)."""


TestPrefixSchedulerMachine = PrefixSchedulerMachine.TestCase
TestPrefixSchedulerMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


class ChunkedPrefixSchedulerMachine(PrefixSchedulerMachine):
    """The same with chunked prefill: a step carries at most 6 tokens, one of each decoding sequence and prefill
    chunks in the rest (chunks end inside and on page boundaries), so that most prompts take several steps, mixed
    with decodes; preemption and aborts reach sequences mid-prefill."""

    CHUNK = 6

    def __init__(self):
        super().__init__()
        self.scheduler = Scheduler(self.cache, self.MAX_NUM_SEQS, self.CHUNK, frozenset({EOS}), self.MAX_MODEL_LEN,
                                   chunked_prefill=True)

    @rule(data=st.data())
    def step(self, data):
        if not self.scheduler.has_unfinished():
            return
        scheduler, cache = self.scheduler, self.cache
        decodable = [seq for seq in scheduler.running if seq is not scheduler.prefilling]
        preemptions = {seq.request_id: seq.num_preemptions for seq in decodable}
        batch = scheduler.schedule()
        assert batch is not None and len(batch.seqs) == len(batch.num_new_tokens) >= 1
        assert batch.num_tokens <= self.CHUNK
        # Every decodable sequence decodes in every step, unless the step preempted it (newest first).
        kept = [seq for seq in decodable if seq.num_preemptions == preemptions[seq.request_id]]
        assert list(batch.seqs[:batch.num_decodes]) == kept and kept == decodable[:len(kept)]
        for i, (seq, count) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            assert seq.status is SequenceStatus.RUNNING and cache.seq_len(seq.cache_id) == batch.seq_lens[i]
            if i < batch.num_sampled:
                assert batch.seq_lens[i] == seq.num_tokens and seq.num_in_flight == 1
            else:  # the partial one: the batch's last, its full pages shareable already, nothing in flight
                assert batch.num_prefills and batch.seq_lens[i] < seq.num_tokens and scheduler.prefilling is seq
                assert seq.num_in_flight == 0 and cache.num_registered_pages(seq.cache_id) == batch.seq_lens[i] // PAGE
            assert 1 <= count <= batch.seq_lens[i] and (i >= batch.num_decodes or count == 1)
        assert scheduler.prefilling not in batch.seqs[:batch.num_decodes]
        if batch.partial:
            assert scheduler.prefilling is batch.seqs[-1]
        elif scheduler.prefilling is not None:  # its chunk found no room in the step: decodes filled it
            assert scheduler.prefilling not in batch.seqs and batch.num_decodes == self.CHUNK
        self.update(batch, data.draw(st.lists(st.integers(0, 5), min_size=batch.num_sampled,
                                              max_size=batch.num_sampled)))


TestChunkedPrefixSchedulerMachine = ChunkedPrefixSchedulerMachine.TestCase
TestChunkedPrefixSchedulerMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def test_a_waiting_prompt_that_cannot_be_admitted_is_hashed_once(monkeypatch):
    cache = PagedKVCache(1, 1, 1, 12, PAGE, max_seqs=4, prefix_caching=True)
    scheduler = Scheduler(cache, 4, 64, frozenset({EOS}), 64)
    hashed = []
    page_hashes = questkv.cache.paged.page_hashes
    monkeypatch.setattr(questkv.cache.paged, "page_hashes",
                        lambda *args: (lambda chain: hashed.extend(chain) or chain)(page_hashes(*args)))
    hog = Sequence("hog", BASE[:20], SamplingParams(max_tokens=20, ignore_eos=True))
    scheduler.add(hog)
    scheduler.update(scheduler.schedule(), [7])  # 6 pages held, 6 free
    hashed.clear()
    # 28 tokens need 8 pages: it could fit with a hit of 2 pages or more (so it is looked up) but hits 1 page only.
    head = Sequence("head", BASE[:4] + [BASE[4] % 99 + 1] + BASE[5:28], SamplingParams(max_tokens=2))
    scheduler.add(head)
    counts = []
    for _ in range(3):  # the hog caches 21 to 23 tokens: no page of its own fills (and is hashed) meanwhile
        batch = scheduler.schedule()
        assert not batch.num_prefills and list(scheduler.waiting) == [head]
        scheduler.update(batch, [7])
        counts.append(len(hashed))
    assert counts == [7, 7, 7] and len(head.page_hashes) == 7  # its full pages, once
