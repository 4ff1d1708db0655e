"""StepTokens: after a step with lossless verify rows, each row's next input token and kept drafts on the device are
the scheduler's choice on the host (keep_verified), a verify row's last draft in flight included; after any other
step the sampled tokens are kept as they are. Random tokens, drafts that often match."""

import random

import torch

from questkv.engine.sampling_params import SamplingParams
from questkv.engine.sequence import Sequence
from questkv.engine.speculation import keep_verified
from questkv.engine.step_data import ScheduledBatch
from questkv.engine.step_tokens import StepTokens

VOCAB = 50


def logits_for(tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), VOCAB]`` float32 random logits whose argmax is each of ``tokens``."""
    logits = torch.randn(len(tokens), VOCAB)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 100.0
    return logits


def test_a_verify_steps_next_inputs_and_kept_drafts_are_the_schedulers():
    rng = random.Random()
    state = StepTokens(8, torch.device("cpu"), seed=0)
    decode = Sequence("decode", tuple(rng.randrange(VOCAB) for _ in range(rng.randint(2, 9))))
    verifies = []
    for i, k in enumerate((rng.randint(1, 6), rng.randint(1, 6), rng.randint(2, 6))):
        seq = Sequence(f"verify{i}", tuple(rng.randrange(VOCAB) for _ in range(rng.randint(2, 9))))
        seq.output_token_ids = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))]
        seq.draft_token_ids = [rng.randrange(VOCAB) for _ in range(k)]
        verifies.append(seq)
    # The last verify row's last draft is in flight: the step before sampled it.
    flying = verifies[-1]
    last_draft = flying.draft_token_ids.pop()
    before = ScheduledBatch((flying,), (1,), (flying.num_tokens + len(flying.draft_token_ids),), num_decodes=1)
    state.sample(logits_for([last_draft]), before)

    drafts = [seq.draft_token_ids + ([last_draft] if seq is flying else []) for seq in verifies]
    sampled = [[d if rng.random() < 0.7 else rng.randrange(VOCAB) for d in row] + [rng.randrange(VOCAB)]
               for row in drafts]  # each verify row's k + 1 tokens, its drafts often kept
    first = rng.randrange(VOCAB)
    batch = ScheduledBatch((decode, *verifies), (1, *(len(row) + 1 for row in drafts)),
                           (decode.num_tokens, *(seq.num_tokens + len(row) for seq, row in zip(verifies, drafts))),
                           num_decodes=1, num_verifies=len(verifies))
    host = state.sample(logits_for([first] + [t for row in sampled for t in row]), batch)

    kept = []
    for seq, row, tokens in zip(verifies, drafts, sampled):
        seq.draft_token_ids = row  # as the update finds them, the last draft appended
        kept.append(keep_verified(seq, tokens, None, len(verifies)))
    assert state.sampled[:4].tolist() == [first] + [run[-1] for run in kept]
    assert state.kept_drafts[:4].tolist() == [0] + [len(run) - 1 for run in kept]
    assert host.token_ids() == [first] + [t for row in sampled for t in row]
    assert state.row_of(verifies[1]) == 2


def test_another_steps_tokens_are_kept_as_sampled():
    state = StepTokens(4, torch.device("cpu"), seed=0)
    seqs = tuple(Sequence(f"r{i}", tuple(random.randrange(VOCAB) for _ in range(3))) for i in range(3))
    tokens = [random.randrange(VOCAB) for _ in seqs]
    state.sample(logits_for(tokens), ScheduledBatch(seqs, (1, 1, 1), (3, 3, 3), num_decodes=3))
    assert state.sampled[:3].tolist() == tokens and [state.row_of(seq) for seq in seqs] == [0, 1, 2]


def test_tokens_drawn_in_the_step_are_the_samplers_own():
    # draw_greedy in the step's body, then sample(drawn=True): what the sampler draws after the step (a verify-only
    # step: tokens, next inputs, kept drafts; a decode step); a row that samples makes the sampler draw itself.
    rng = random.Random()
    k = rng.randint(1, 6)
    seqs = []
    for i in range(3):
        seq = Sequence(f"v{i}", tuple(rng.randrange(VOCAB) for _ in range(rng.randint(2, 9))))
        seq.draft_token_ids = [rng.randrange(VOCAB) for _ in range(k)]
        seqs.append(seq)
    inputs = torch.tensor([[seq.last_token, *seq.draft_token_ids] for seq in seqs])
    sampled = [[d if rng.random() < 0.7 else rng.randrange(VOCAB) for d in seq.draft_token_ids] + [rng.randrange(VOCAB)]
               for seq in seqs]
    verify = (logits_for([t for row in sampled for t in row]),
              ScheduledBatch(tuple(seqs), (k + 1,) * 3, tuple(seq.num_tokens + k for seq in seqs), num_verifies=3),
              inputs)
    decode = (logits_for([rng.randrange(VOCAB) for _ in seqs]), ScheduledBatch(tuple(seqs), (1,) * 3, (9,) * 3,
                                                                                num_decodes=3), None)
    for logits, batch, verify_inputs in (verify, decode):
        seen = []
        for drawn in (False, True):
            state = StepTokens(4, torch.device("cpu"), seed=0, max_queries=k + 1)
            if drawn:
                state.draw_greedy(logits, verify_inputs)
            host = state.sample(logits, batch, verify_inputs, drawn=drawn)
            seen.append((host.token_ids(), state.sampled[:3].tolist(), state.kept_drafts[:3].tolist()))
        assert seen[0] == seen[1]
        assert seen[1][0] == logits.argmax(-1).tolist()

    hot = Sequence("hot", (1, 2, 3), SamplingParams(temperature=1.0, seed=rng.randrange(1 << 30)))
    batch = ScheduledBatch((seqs[0], hot), (1, 1), (9, 4), num_decodes=2)
    logits = torch.randn(2, VOCAB)
    logits[:, 0] = -1e4  # never drawn
    state = StepTokens(4, torch.device("cpu"), seed=0)
    state.draw_greedy(logits + 2e4 * torch.nn.functional.one_hot(torch.tensor([0, 0]), VOCAB))  # argmax 0 twice
    drawn = state.sample(logits, batch, drawn=True).token_ids()
    assert drawn == StepTokens(4, torch.device("cpu"), seed=0).sample(logits, batch).token_ids()
    assert state.sampled[:2].tolist() == drawn
