"""The scheduler with lossless requests: a hypothesis state machine over add / step / abort where requests draft
(Quest rounds), verify with random dense tokens, stop inside kept runs and are preempted mid-round, on a tiny pool,
synchronously and asynchronously (each step scheduled before the one in flight is updated, as ``LLMEngine.step``
does: a round's first draft launched before its verify's update). A shadow model computes what every verify must
keep."""

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from questkv import QuestConfig
from questkv.config import RequestQuest
from questkv.engine.sampling_params import SamplingParams
from questkv.engine.sequence import Sequence, SequenceStatus
from questkv.engine.speculation import SpeculationPolicy
from tests.engine.test_scheduler import EOS, PAGE, SchedulerMachine, make_scheduler

# Quest from a context of 8 tokens on (two pages): shorter sequences decode densely and draft nothing.
QUEST = QuestConfig(token_budget=8, page_size=PAGE, dense_layers=0, sink_pages=0, recent_pages=0,
                    dense_context_ratio=1.0)


class LosslessSchedulerMachine(SchedulerMachine):
    """Requests with 0 to 5 draft tokens per round (0: lossy, the plain decode path) and chunked prefill or not;
    tokens are drawn from 0..5 so that drafts are often kept, often not, and EOS (0) or the stop token (3) often
    lands inside a kept run."""

    def __init__(self):
        super().__init__()
        self.chunked = random.random() < 0.5
        self.scheduler = make_scheduler(self.POOL, self.MAX_NUM_SEQS, max_num_batched_tokens=12,
                                        max_model_len=self.MAX_MODEL_LEN, max_seqs=4, chunked_prefill=self.chunked,
                                        quest=QUEST)
        self.cache = self.scheduler.cache
        self.verifies = 0

    @rule(prompt_len=st.integers(1, 24), max_tokens=st.integers(1, 20), ignore_eos=st.booleans(),
          stop_token=st.sampled_from([None, 3]), drafts=st.integers(0, 5))
    def add(self, prompt_len, max_tokens, ignore_eos, stop_token, drafts):
        self.admit(Sequence(str(self.next_id), [random.randint(1, 99) for _ in range(prompt_len)],
                            SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos,
                                           stop_token_ids=[] if stop_token is None else [stop_token]),
                            quest=RequestQuest(8, 1, drafts)))

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(data=st.data())
    def step(self, data):
        self.run_step(lambda low, high: data.draw(st.integers(low, high)))

    def run_step(self, draw):
        """One schedule and update; ``draw(low, high)`` picks every random integer (tokens, agreement points)."""
        batch = self.scheduler.schedule()
        assert batch is not None
        verifying = range(batch.num_decodes, batch.num_decodes + batch.num_verifies)
        expected = {}
        rows = []
        for i, seq in enumerate(batch.seqs[:batch.num_sampled]):
            assert self.cache.seq_len(seq.cache_id) == batch.seq_lens[i]
            if i in verifying:
                drafts = list(seq.draft_token_ids)
                assert seq.quest.speculative_tokens and batch.num_new_tokens[i] == len(drafts) + 1
                assert len(drafts) <= self.scheduler.rounds.draft_limit(seq) or not drafts
                expected[seq.request_id], tokens = self.verify_tokens(drafts, draw)
                rows.append(tokens)
            else:
                assert batch.num_new_tokens[i] == 1 or i >= batch.num_decodes
                if i in batch.drafts:
                    assert seq.quest.speculative_tokens and i < batch.num_decodes
                rows.append(draw(0, 5))
        before = {seq.request_id: (seq.num_output_tokens, len(seq.draft_token_ids)) for seq in batch.seqs}
        self.count(batch)
        finished = self.update(batch, rows)
        for i, (seq, row) in enumerate(zip(batch.seqs[:batch.num_sampled], rows)):
            outputs, drafts = before[seq.request_id]
            if i in batch.drafts and not seq.is_finished:
                assert seq.num_output_tokens == outputs and len(seq.draft_token_ids) == drafts + 1
                continue
            self.check_appended(seq, expected.get(seq.request_id, row), outputs, finished)
        self.verifies += batch.num_verifies

    @staticmethod
    def verify_tokens(drafts, draw):
        """A verify row's tokens for ``drafts`` (dense attention's: agreeing with the drafts up to a random point,
        then anything) and those the verify must keep: ``(kept, tokens)``."""
        agree = draw(0, len(drafts))
        tokens = drafts[:agree] + [draw(0, 5) for _ in range(len(drafts) + 1 - agree)]
        kept = 0
        while kept < len(drafts) and tokens[kept] == drafts[kept]:
            kept += 1
        return tokens[:kept + 1], tokens

    def check_appended(self, seq, want, outputs, finished):
        """After an update: ``seq`` (``outputs`` outputs before it) appended a prefix of ``want`` (its token, or what
        its verify keeps), cut only by a stop, and its status follows its last token."""
        want = want if isinstance(want, list) else [want]
        added = seq.output_token_ids[outputs:]
        assert added == want[:len(added)] and added, (added, want)
        params = seq.sampling_params
        if len(added) < len(want):  # the run was cut by a stop: the last kept token stopped it
            assert seq in finished
        last = added[-1]
        if (last == EOS and not params.ignore_eos) or last in params.stop_token_ids:
            assert seq.status is SequenceStatus.FINISHED_STOPPED and seq in finished
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.MAX_MODEL_LEN:
            assert seq.status is SequenceStatus.FINISHED_LENGTH and seq in finished
        else:
            assert not seq.is_finished and not seq.draft_token_ids

    def count(self, batch):
        """The shadow of the scheduler's step counts, for a scheduled ``batch``."""
        verified = batch.num_decodes + batch.num_verifies
        prefills = len(batch.seqs) - verified
        self.steps["mixed" if verified and prefills else "decode" if verified else "prefill"] += 1
        self.step_tokens["decode"] += batch.num_decodes
        self.step_tokens["verify"] += sum(batch.num_new_tokens[batch.num_decodes:verified])
        self.step_tokens["prefill"] += sum(batch.num_new_tokens[verified:])

    def update(self, batch, token_ids):
        finished = self.scheduler.update(batch, token_ids)  # (the step counted at its scheduling)
        for seq in batch.seqs[:batch.num_sampled]:
            self.tokens[seq.request_id] = list(seq.output_token_ids)
        return finished

    @invariant()
    def running_sequences_cache_all_but_their_last_token(self):
        scheduler = self.scheduler
        for seq in scheduler.running:
            cached = self.cache.seq_len(seq.cache_id)
            if seq is scheduler.prefilling:
                assert 0 < cached < seq.num_tokens and not seq.draft_token_ids
            else:  # (asynchronously the inputs in flight too: a first draft ahead after the longest kept run)
                assert cached == seq.num_tokens + len(seq.draft_token_ids) + seq.num_in_flight - 1
                assert len(seq.draft_token_ids) <= seq.quest.speculative_tokens

    @invariant()
    def waiting_sequences_hold_no_drafts(self):
        assert all(not seq.draft_token_ids for seq in self.scheduler.waiting)


class AsyncLosslessSchedulerMachine(LosslessSchedulerMachine):
    """The same requests under asynchronous scheduling, as ``LLMEngine.step`` runs them: each step is scheduled before
    the step in flight is updated, unless ``Scheduler.waits_for`` needs that step's tokens first; so a round's drafts,
    its verify and the next round's first draft (``ScheduledBatch.ahead``, before its verify's update) are launched
    ahead. Each step's tokens are drawn at its launch, as the device samples them (a verify's last draft may still
    be in flight then); what a verify must keep is computed then too."""

    def __init__(self):
        super().__init__()
        self.in_flight = None  # (batch, rows, expected): launched, not yet updated
        self.flying = {}       # request id -> its draft tokens launched and not yet updated
        self.ahead = 0

    @precondition(lambda self: self.scheduler.has_unfinished() or self.in_flight is not None)
    @rule(data=st.data())
    def step(self, data):
        self.run_step(lambda low, high: data.draw(st.integers(low, high)))

    def run_step(self, draw):
        scheduler = self.scheduler
        if scheduler.waits_for(None if self.in_flight is None else self.in_flight[0]):
            self.finish(*self.in_flight)
            self.in_flight = None
        batch = scheduler.schedule()
        launched = None if batch is None else self.launch(batch, draw)
        launched, self.in_flight = self.in_flight, launched
        if launched is not None:
            self.finish(*launched)

    def launch(self, batch, draw):
        """Count the scheduled ``batch`` and draw its tokens; a verify row's drafts are those updated and in flight."""
        self.count(batch)
        self.ahead += sum(map(bool, batch.ahead))
        verifying = range(batch.num_decodes, batch.num_decodes + batch.num_verifies)
        rows, expected = [], {}
        for i, seq in enumerate(batch.seqs[:batch.num_sampled]):
            assert self.cache.seq_len(seq.cache_id) == batch.seq_lens[i]
            if i in verifying:
                drafts = list(seq.draft_token_ids) + self.flying.get(seq.request_id, [])
                assert seq.quest.speculative_tokens and batch.num_new_tokens[i] == len(drafts) + 1
                expected[seq.request_id], tokens = self.verify_tokens(drafts, draw)
                rows.append(tokens)
            else:
                rows.append(draw(0, 5))
                if i in batch.drafts:
                    self.flying.setdefault(seq.request_id, []).append(rows[-1])
        if batch.ahead:  # such a row starts a round: its verify, in flight, is its sequence's latest step
            for i in (i for i, drafts in enumerate(batch.ahead) if drafts):
                assert i in batch.drafts and batch.seqs[i].verify_in_flight == batch.ahead[i]
        return batch, rows, expected

    def finish(self, batch, rows, expected):
        """Update the launched ``batch`` with its drawn tokens and check what each live row appended."""
        sampled = batch.seqs[:batch.num_sampled]
        before = {seq.request_id: (seq.num_output_tokens, len(seq.draft_token_ids), seq.is_finished)
                  for seq in sampled}
        verifying = range(batch.num_decodes, batch.num_decodes + batch.num_verifies)
        for i in verifying:  # a verify in flight is never preempted (the step after it preempts only once updated)
            assert sampled[i].status is SequenceStatus.RUNNING or sampled[i].is_finished
        finished = self.update(batch, rows)
        for i, (seq, row) in enumerate(zip(sampled, rows)):
            outputs, drafts, was_finished = before[seq.request_id]
            if i in batch.drafts:
                self.flying[seq.request_id].pop(0)
            if was_finished:  # stopped or aborted while this step was in flight: its tokens are discarded
                assert seq.num_output_tokens == outputs
                continue
            if i in batch.drafts and not seq.is_finished:
                grown = 0 if seq.status is SequenceStatus.WAITING else 1  # (preempted since: its round is dropped)
                assert seq.num_output_tokens == outputs and len(seq.draft_token_ids) == drafts * grown + grown
                continue
            self.check_appended(seq, expected.get(seq.request_id, row), outputs, finished)
        self.verifies += batch.num_verifies



TestLosslessSchedulerMachine = LosslessSchedulerMachine.TestCase
TestLosslessSchedulerMachine.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)


def test_the_machine_drafts_verifies_and_preempts():
    """The machine's rules reach the states they are for: rounds that draft and verify, under preemption."""
    machine = LosslessSchedulerMachine()
    for i in range(3):
        machine.add(prompt_len=9, max_tokens=18, ignore_eos=True, stop_token=None, drafts=3)
    rng = random.Random(0)
    for _ in range(200):
        if not machine.scheduler.has_unfinished():
            break
        machine.run_step(rng.randint)
        machine.running_sequences_cache_all_but_their_last_token()
        machine.every_page_is_free_or_owned_by_exactly_one_running_sequence()
    assert machine.verifies > 0
    assert sum(seq.num_preemptions for seq in machine.seqs.values()) > 0
    assert all(seq.is_finished for seq in machine.seqs.values())

TestAsyncLosslessSchedulerMachine = AsyncLosslessSchedulerMachine.TestCase
TestAsyncLosslessSchedulerMachine.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)


def test_the_asynchronous_machine_launches_first_drafts_ahead_and_preempts():
    """The asynchronous machine's rules reach the states they are for: first drafts launched before their verify's
    update, verifies, preemption."""
    machine = AsyncLosslessSchedulerMachine()
    for i in range(3):
        machine.add(prompt_len=9, max_tokens=18, ignore_eos=True, stop_token=None, drafts=3)
    rng = random.Random(0)
    for _ in range(200):
        if not machine.scheduler.has_unfinished() and machine.in_flight is None:
            break
        machine.run_step(rng.randint)
        machine.running_sequences_cache_all_but_their_last_token()
        machine.every_page_is_free_or_owned_by_exactly_one_running_sequence()
        machine.the_scheduler_counts_its_steps_and_their_tokens_by_kind()
    assert machine.verifies > 0 and machine.ahead > 0
    assert sum(seq.num_preemptions for seq in machine.seqs.values()) > 0
    assert all(seq.is_finished for seq in machine.seqs.values())


class PolicyOfTheDay(SpeculationPolicy):
    """A policy whose choice of drafts per round is drawn afresh at every step (as noise in its step times flips
    the real one's between neighbouring lengths); :attr:`chosen` holds its answers."""

    def __init__(self, rng):
        super().__init__(max_k=5)
        self.rng, self.chosen = rng, []

    def draft_tokens(self, batch):
        self.chosen.append(self.rng.randint(1, 5))
        return self.chosen[-1]


def test_a_round_drafts_what_the_policy_chose_at_its_start_whatever_it_chooses_later():
    rng = random.Random(random.randrange(2**32))
    policy = PolicyOfTheDay(rng)
    scheduler = make_scheduler(64, max_num_seqs=3, max_model_len=200, quest=QUEST, speculation=policy)
    for i in range(3):
        scheduler.add(Sequence(str(i), [rng.randint(1, 99) for _ in range(9)],
                               SamplingParams(max_tokens=100, ignore_eos=True), quest=RequestQuest(8, 1, 5)))
    started = {}  # request id -> the policy's choice in the step of its round's first draft
    rounds = []
    for _ in range(60):
        batch = scheduler.schedule()
        tokens = []
        for i, seq in enumerate(batch.seqs[:batch.num_sampled]):
            if i in batch.drafts and len(seq.draft_token_ids) == 0:
                started[seq.request_id] = policy.chosen[-1]
            if batch.num_decodes <= i < batch.num_decodes + batch.num_verifies:
                rounds.append((len(seq.draft_token_ids), started.pop(seq.request_id)))
                tokens.append(list(seq.draft_token_ids) + [rng.randint(1, 99)])  # every draft kept
            else:
                tokens.append(rng.randint(1, 99))
        scheduler.update(batch, tokens)
    assert len(rounds) > 10 and len(set(policy.chosen)) >= 3
    assert all(drafts == chosen for drafts, chosen in rounds), rounds
