"""The lossless engine's draft-count policy (questkv.engine.speculation) on made-up step times: it probes what it
has not measured, keeps refreshing dense and round times, and picks the k with the best predicted speed (0: dense)."""

import random

import pytest

import torch

from questkv.engine.sequence import Sequence
from questkv.engine.speculation import (MAX_PROBE_EVERY, PROBE_EVERY, SpeculationPolicy, StepKind, expected_tokens,
                                       keep_verified, verified_next_inputs)


@pytest.mark.parametrize("p, k, tokens", [(0.0, 4, 1.0), (1.0, 4, 5.0), (0.5, 2, 1.75), (0.9, 1, 1.9)])
def test_expected_tokens_of_a_round(p, k, tokens):
    assert expected_tokens(p, k) == pytest.approx(tokens)


def measured(policy, batch, dense, draft, verify):
    policy.record_step(StepKind.DRAFT, batch, draft)
    policy.record_step(StepKind.VERIFY, batch, verify, policy.max_k)
    policy.record_step(StepKind.DENSE, batch, dense)


def test_a_fixed_policy_always_drafts_its_maximum():
    policy = SpeculationPolicy(5, adaptive=False)
    measured(policy, 4, dense=1e-3, draft=1.0, verify=1.0)  # drafting could not be slower, yet it drafts
    assert policy.draft_tokens(4) == 5


def test_it_times_a_round_then_a_dense_step_before_it_chooses():
    policy = SpeculationPolicy(4)
    assert policy.draft_tokens(8) == 4  # nothing measured: a round
    policy.record_step(StepKind.DRAFT, 8, 0.001)
    policy.record_step(StepKind.VERIFY, 8, 0.003, 4)
    assert policy.draft_tokens(8) == 0  # no dense step measured: one dense step
    policy.record_step(StepKind.DENSE, 8, 0.004)
    assert policy.draft_tokens(8) > 0  # cheap drafts, the prior acceptance: draft
    assert policy.draft_tokens(16) == 4  # another batch size is measured on its own


def test_it_picks_the_k_of_the_best_predicted_speed_and_dense_where_drafting_loses():
    dense, draft, verify = 0.004, 0.001, 0.005
    policy = SpeculationPolicy(8)
    measured(policy, 1, dense, draft, verify)
    for _ in range(50):  # a high acceptance: 9 of 10 drafts kept
        policy.record_round(1, 10, 9)
    p = policy.acceptance(1)
    assert p == pytest.approx(9 / 10, abs=0.02)
    rates = {k: expected_tokens(p, k) / (k * draft + dense + (verify - dense) * k / 8) for k in range(1, 9)}
    assert policy.draft_tokens(1) == max(rates, key=rates.get)
    slow = SpeculationPolicy(8)
    measured(slow, 1, dense=0.001, draft=0.0009, verify=0.0012)  # drafts cost nearly a dense step: never pays
    assert slow.draft_tokens(1) == 0


def test_it_refreshes_dense_and_round_times_every_probe_interval():
    policy = SpeculationPolicy(4)
    measured(policy, 2, dense=0.004, draft=0.001, verify=0.005)
    for _ in range(PROBE_EVERY - 1):
        policy.record_step(StepKind.VERIFY, 2, 0.005, 4)
    assert policy.draft_tokens(2) > 0
    policy.record_step(StepKind.VERIFY, 2, 0.005, 4)
    assert policy.draft_tokens(2) == 0  # PROBE_EVERY rounds since the last dense step
    losing = SpeculationPolicy(4)
    for _ in range(10):  # every draft rejected: cheap drafts lose
        losing.record_round(2, 4, 0)
    measured(losing, 2, dense=0.001, draft=0.0004, verify=0.0015)  # one dense step since the round
    for _ in range(PROBE_EVERY - 2):
        losing.record_step(StepKind.DENSE, 2, 0.001)
        assert losing.draft_tokens(2) == 0
    losing.record_step(StepKind.DENSE, 2, 0.001)
    assert losing.draft_tokens(2) == 4  # PROBE_EVERY dense steps since the last round: a round again


def decode(policy, batch, steps, dense, draft, verify, keep=True):
    """``steps`` scheduling decisions of an engine with these step times (every draft kept, or with ``keep=False``
    none); the dense steps between two rounds, in order."""
    gaps, since = [], 0
    for _ in range(steps):
        k = policy.draft_tokens(batch)
        if k == 0:
            policy.record_step(StepKind.DENSE, batch, dense)
            since += 1
            continue
        for _ in range(k):
            policy.record_step(StepKind.DRAFT, batch, draft)
        policy.record_round(batch, k, k if keep else 0)
        policy.record_step(StepKind.VERIFY, batch, verify, k)
        gaps.append(since)
        since = 0
    return gaps


def test_probe_rounds_that_keep_dense_the_choice_come_ever_later_and_a_winning_one_resets_them():
    policy = SpeculationPolicy(4)
    losing = dict(dense=0.001, draft=0.0004, verify=0.0015, keep=False)  # cheap drafts, all rejected: dense wins
    gaps = decode(policy, 2, 4000, **losing)
    doubling = [PROBE_EVERY * 2 ** i for i in range(MAX_PROBE_EVERY.bit_length() - PROBE_EVERY.bit_length() + 1)]
    assert gaps[0] == 0 and gaps[1:1 + len(doubling)] == doubling  # the first round, then the probes
    assert set(gaps[1 + len(doubling):]) == {MAX_PROBE_EVERY}
    winning = dict(dense=0.001, draft=0.0001, verify=0.0012)  # the batch's drafts got cheap: drafting pays now
    gaps = decode(policy, 2, 3 * MAX_PROBE_EVERY, **winning)
    resumed = next(i for i, gap in enumerate(gaps) if gap <= 1)  # the running means need a probe or two
    assert resumed <= 2 and max(gaps[:resumed]) <= MAX_PROBE_EVERY and max(gaps[resumed:]) <= 1
    assert policy._bucket(2).probe_every == PROBE_EVERY


@pytest.mark.parametrize("draft", [0.001, 0.0012])
def test_where_drafting_could_not_pay_even_keeping_every_draft_it_probes_at_the_longest_interval_at_once(draft):
    """A draft step as dear as a dense one (a 1.5B model at batch 1): after the first round and dense step, a probe
    every MAX_PROBE_EVERY dense steps, however high the acceptance."""
    policy = SpeculationPolicy(4)
    gaps = decode(policy, 1, 3 * MAX_PROBE_EVERY, dense=0.001, draft=draft, verify=0.0011)
    assert gaps[0] == 0 and len(gaps) >= 3 and set(gaps[1:]) == {MAX_PROBE_EVERY}
    payable = SpeculationPolicy(4)  # a little cheaper: all kept, k = 4 would pay, so it drafts
    gaps = decode(payable, 1, 200, dense=0.001, draft=0.0007, verify=0.0011)
    assert max(gaps[1:]) <= 1


def test_acceptance_counts_the_drafts_tested_up_to_the_first_rejection():
    policy = SpeculationPolicy(4)
    policy.record_round(1, 4, 2)  # kept 2, rejected the third: 3 tested
    assert policy.acceptance(1) == pytest.approx(2 / 3)
    policy.record_round(1, 4, 4)  # all kept: 4 tested
    assert 2 / 3 < policy.acceptance(1) < 1
    assert SpeculationPolicy(4).acceptance(random.randint(1, 64)) == pytest.approx(0.8)  # the prior


def test_its_snapshot_reports_the_means_the_choice_and_the_steps_per_batch_size():
    policy, batch = SpeculationPolicy(4), random.randint(1, 32)
    policy.record_step(StepKind.DRAFT, batch, 0.002)
    assert policy.snapshot()[batch]["k"] is None  # not every kind timed yet
    dense, draft, verify = random.uniform(4e-3, 8e-3), random.uniform(5e-4, 1e-3), random.uniform(8e-3, 1e-2)
    for _ in range(3):
        measured(policy, batch, dense=dense, draft=draft, verify=verify)
    policy.record_step(StepKind.VERIFY, batch, verify, 2)
    report = policy.snapshot()
    assert list(report) == [batch]
    seen = report[batch]
    assert seen["dense_ms"] == pytest.approx(1e3 * dense) and seen["verify_ms"] == pytest.approx({2: 1e3 * verify,
                                                                                                   4: 1e3 * verify})
    assert seen["draft_ms"] == pytest.approx(1e3 * (0.8 ** 3 * 0.002 + (1 - 0.8 ** 3) * draft))
    assert seen["k"] == policy.draft_tokens(batch) > 0 and seen["acceptance"] == policy.acceptance(batch)
    assert seen["steps"] == {"draft": 4, "verify-4": 3, "dense": 3, "verify-2": 1}


def test_a_verify_is_timed_per_round_length_and_an_untimed_length_is_predicted_from_the_nearest():
    dense = random.uniform(2e-3, 8e-3)
    policy = SpeculationPolicy(8)
    policy.record_step(StepKind.DENSE, 1, dense)
    policy.record_step(StepKind.VERIFY, 1, 2 * dense, 4)
    assert policy.verify_seconds(1, 4) == pytest.approx(2 * dense)
    assert policy.verify_seconds(1, 2) == pytest.approx(1.5 * dense)  # on the line from the dense step
    assert policy.verify_seconds(1, 8) == pytest.approx(3 * dense)
    policy.record_step(StepKind.VERIFY, 1, 1.2 * dense, 2)  # a round of 2 is timed on its own
    assert policy.verify_seconds(1, 2) == pytest.approx(1.2 * dense)
    assert policy.verify_seconds(1, 4) == pytest.approx(2 * dense)
    assert policy.verify_seconds(1, 3) == pytest.approx(dense + dense * 3 / 4)  # a tie: the longer round's line
    assert policy.verify_seconds(1, 1) == pytest.approx(1.1 * dense)
    with pytest.raises(ValueError, match="drafts=0"):
        policy.record_step(StepKind.VERIFY, 1, dense)


def test_a_verify_that_costs_more_per_draft_makes_shorter_rounds_win():
    """At a modest acceptance the timed round of 4 drafts loses to dense (its verify costs 1.3 dense steps); a
    round of 1, whose verify is predicted on the line from the dense step, wins, and keeps winning once timed. (One
    verify time for every round length would pick 2.)"""
    dense, draft, verify4 = 7.7e-3, 3.8e-3, 10.2e-3
    policy = SpeculationPolicy(4)
    policy.record_step(StepKind.DRAFT, 1, draft)
    policy.record_step(StepKind.VERIFY, 1, verify4, 4)
    policy.record_step(StepKind.DENSE, 1, dense)
    for _ in range(40):  # 10 of every 13 drafts tested are kept
        for kept in (3, 3, 4, 0):
            policy.record_round(1, 4, kept)
    p = policy.acceptance(1)
    assert expected_tokens(p, 4) / (4 * draft + verify4) < 1 / dense  # the timed round loses
    rates = {k: expected_tokens(p, k) / (k * draft + dense + (verify4 - dense) * k / 4) for k in range(1, 5)}
    assert max(rates, key=rates.get) == 1 and rates[1] > 1 / dense
    assert policy.draft_tokens(1) == 1
    policy.record_step(StepKind.VERIFY, 1, 8.3e-3, 1)
    assert policy.draft_tokens(1) == 1


def test_the_devices_kept_drafts_and_next_inputs_are_keep_verifieds():
    """verified_next_inputs over a step of random rows (verify rows of random drafts that often match, other rows of
    one token) equals keep_verified row by row: the drafts kept and the token after them."""
    rng = random.Random()
    rows = [rng.choice([0, *range(1, 9)]) for _ in range(12)]  # per row its drafts (0: a decode row)
    tokens, offsets, width = [], [], max(rows)
    drafts = torch.full((len(rows), width), -1, dtype=torch.int64)
    expected = []
    for row, k in enumerate(rows):
        sampled = [rng.randrange(5) for _ in range(k + 1)]
        guesses = [t if rng.random() < 0.7 else rng.randrange(5) for t in sampled[:k]]
        seq = Sequence(f"r{row}", (1, 2))
        seq.draft_token_ids = guesses
        kept = keep_verified(seq, sampled, None, len(rows))
        expected.append((kept[-1], len(kept) - 1))
        offsets.append(len(tokens))
        tokens += sampled
        drafts[row, :k] = torch.tensor(guesses, dtype=torch.int64)
    next_inputs, kept = verified_next_inputs(torch.tensor(tokens), torch.tensor(offsets), drafts)
    assert list(zip(next_inputs.tolist(), kept.tolist())) == expected


def test_keep_verified_counts_each_round_by_draft_position():
    """Rounds of random lengths and random agreement on one sequence: per position, the rounds that drafted it and
    those that kept it (a kept draft follows kept ones), which sum to the totals and give the metrics' rates."""
    rng = random.Random()
    seq = Sequence("r", (1, 2))
    drafted, kept_at = [0] * 8, [0] * 8
    for _ in range(rng.randint(5, 20)):
        k = rng.randint(1, 8)
        sampled = [rng.randrange(4) for _ in range(k + 1)]
        seq.draft_token_ids = [t if rng.random() < 0.8 else rng.randrange(4) for t in sampled[:k]]
        kept = len(keep_verified(seq, sampled, None, 1)) - 1
        for i in range(k):
            drafted[i] += 1
            kept_at[i] += i < kept
    longest = max(i + 1 for i in range(8) if drafted[i])
    assert seq.draft_tokens_by_position == drafted[:longest]
    assert seq.accepted_tokens_by_position == kept_at[:longest]
    assert sum(kept_at) == seq.num_accepted_tokens and sum(drafted) == seq.num_draft_tokens
    for counts in (seq.draft_tokens_by_position, seq.accepted_tokens_by_position):
        assert all(a >= b for a, b in zip(counts, counts[1:]))
    metrics = seq.metrics()
    assert metrics.acceptance_by_position == pytest.approx([kept_at[i] / drafted[i] for i in range(longest)])
    assert metrics.acceptance_rate == pytest.approx(sum(kept_at) / sum(drafted))
