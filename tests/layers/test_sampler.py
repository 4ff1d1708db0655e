"""Sampler: greedy, seeded reproducibility, batch independence, top-k / top-p sets and the distribution."""

import pytest
import torch

from questkv.layers.sampler import Sampler, uniform_noise

SAMPLER = Sampler()


def sample(logits, temperature=1.0, top_k=0, top_p=1.0, seeds=None, steps=None, **kwargs):
    """Sample every row of ``logits`` with scalar or per-row parameters."""
    batch = logits.shape[0]

    def per_row(value, dtype):
        return value.to(dtype) if isinstance(value, torch.Tensor) else torch.full((batch,), value, dtype=dtype)

    seeds = torch.arange(batch) if seeds is None else seeds
    steps = torch.zeros(batch, dtype=torch.long) if steps is None else steps
    return SAMPLER(logits, per_row(temperature, torch.float32), per_row(top_k, torch.int32),
                   per_row(top_p, torch.float32), per_row(seeds, torch.long), per_row(steps, torch.long), **kwargs)


def hand_made_logits(probs, rows):
    """``rows`` copies of log(probs) with the vocabulary shuffled, and the permutation (token of rank r)."""
    order = torch.randperm(len(probs))
    logits = torch.empty(len(probs))
    logits[order] = torch.tensor(probs).log()
    return logits.expand(rows, -1).clone(), order


def chi_square(tokens, probs):
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_rows_take_the_argmax_whatever_the_other_parameters():
    logits = torch.randn(16, 50)
    tokens = sample(logits, temperature=0.0, top_k=torch.randint(0, 5, (16,)), top_p=torch.rand(16) * 0.9 + 0.1)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.equal(sample(logits, temperature=0.0, all_greedy=True), logits.argmax(-1))


def test_mixed_batch_samples_only_its_non_greedy_rows():
    logits = torch.randn(8, 40)
    temperature = torch.tensor([0.0, 1.0] * 4)
    tokens = sample(logits, temperature=temperature)
    assert torch.equal(tokens[::2], logits[::2].argmax(-1))
    assert torch.equal(tokens[1::2], sample(logits[1::2], seeds=torch.arange(8)[1::2]))


def test_seeded_runs_reproduce_and_other_seeds_or_steps_draw_differently():
    logits = torch.randn(64, 100) * 0.1
    first = sample(logits, seeds=torch.full((64,), 7), steps=torch.arange(64))
    assert torch.equal(first, sample(logits, seeds=torch.full((64,), 7), steps=torch.arange(64)))
    assert not torch.equal(first, sample(logits, seeds=torch.full((64,), 8), steps=torch.arange(64)))
    assert len(set(first.tolist())) > 20  # the steps of one seed are not one draw repeated


def test_a_row_gets_the_same_token_whatever_else_is_in_the_batch():
    batch = 12
    logits = torch.randn(batch, 30)
    temperature = torch.rand(batch) + 0.3
    top_k = torch.tensor([0, 3, 10, 0] * 3)
    top_p = torch.tensor([1.0, 1.0, 0.8, 0.5] * 3)
    seeds = torch.randint(0, 2**62, (batch,))
    steps = torch.randint(0, 1000, (batch,))
    together = sample(logits, temperature, top_k, top_p, seeds, steps)
    alone = [int(sample(logits[i : i + 1], temperature[i : i + 1], top_k[i : i + 1], top_p[i : i + 1],
                        seeds[i : i + 1], steps[i : i + 1])) for i in range(batch)]
    assert together.tolist() == alone
    shuffle = torch.randperm(batch)
    shuffled = sample(logits[shuffle], temperature[shuffle], top_k[shuffle], top_p[shuffle], seeds[shuffle],
                      steps[shuffle])
    assert torch.equal(shuffled, together[shuffle])


@pytest.mark.parametrize(
    "top_k, top_p, kept_ranks",
    [
        (2, 1.0, 2),     # the two most likely
        (0, 0.6, 2),     # 0.4 < 0.6 <= 0.4 + 0.3
        (0, 0.35, 1),    # the first token alone reaches it
        (0, 0.95, 4),    # 0.9 < 0.95
        (3, 0.75, 2),    # top-p on the top 3 renormalised: 0.4/0.9 < 0.75 <= 0.7/0.9
        (3, 0.8, 3),     # 0.7/0.9 < 0.8, whereas the full softmax would stop at 2
        (1, 1.0, 1),
        (100, 1.0, 6),   # k beyond the vocabulary keeps all
    ],
)
def test_top_k_and_top_p_sample_exactly_the_allowed_set(top_k, top_p, kept_ranks):
    probs = [0.4, 0.3, 0.2, 0.05, 0.03, 0.02]
    logits, order = hand_made_logits(probs, rows=3000)
    tokens = sample(logits, top_k=top_k, top_p=top_p, seeds=torch.randint(0, 2**62, (3000,)))
    assert set(tokens.tolist()) == set(order[:kept_ranks].tolist())


def test_tied_logits_at_the_top_k_edge_keep_the_lower_vocab_indices():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]]).expand(2000, -1)
    tokens = sample(logits, top_k=2, seeds=torch.randint(0, 2**62, (2000,)))
    assert set(tokens.tolist()) == {1, 3}


def test_top_p_keeps_the_most_likely_token_even_below_p():
    logits = torch.randn(500, 20) * 5
    tokens = sample(logits, top_p=1e-6, seeds=torch.randint(0, 2**62, (500,)))
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draws_over_many_seeds_follow_the_tempered_softmax(temperature):
    draws = 40000
    base = torch.randn(8)
    probs = (base / temperature).softmax(-1)
    seeds = torch.randint(0, 2**62, (draws,))
    tokens = sample(base.expand(draws, -1).clone(), temperature=temperature, seeds=seeds)
    assert chi_square(tokens, probs) < 40  # 7 degrees of freedom: p < 1e-5 for a correct sampler


def test_draws_over_the_steps_of_one_seed_follow_the_softmax():
    draws = 40000
    base = torch.randn(8)
    seed = int(torch.randint(0, 2**62, ()))
    tokens = sample(base.expand(draws, -1).clone(), seeds=torch.full((draws,), seed), steps=torch.arange(draws))
    assert chi_square(tokens, base.softmax(-1)) < 40


def test_top_k_draws_follow_the_renormalised_softmax():
    draws = 40000
    logits, order = hand_made_logits([0.4, 0.3, 0.2, 0.05, 0.03, 0.02], rows=draws)
    tokens = sample(logits, top_k=3, seeds=torch.randint(0, 2**62, (draws,)))
    expected = torch.zeros(6)
    expected[order[:3]] = torch.tensor([0.4, 0.3, 0.2]) / 0.9
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[order[3:]].sum() == 0
    kept = order[:3]
    assert float(((counts[kept] - expected[kept] * draws) ** 2 / (expected[kept] * draws)).sum()) < 30


def test_lower_temperature_concentrates_on_the_most_likely_token():
    row = torch.randn(30)
    best = int(torch.randint(0, 30, ()))
    row[best] = row.max() + 1.0  # a clear winner: at temperature 0.1 the runner-up is e**-10 as likely
    logits = row.expand(5000, -1).clone()
    share = {t: float((sample(logits, temperature=t) == best).double().mean()) for t in (0.1, 1.0, 5.0)}
    assert share[0.1] > 0.95 and share[0.1] > share[1.0] > share[5.0]


def test_skipping_the_sort_when_no_row_filters_gives_the_same_tokens():
    logits = torch.randn(32, 64)
    temperature = torch.rand(32) + 0.5
    assert torch.equal(sample(logits, temperature), sample(logits, temperature, apply_top_k_top_p=False))


def test_uniform_noise_stays_inside_the_open_interval_for_extreme_seeds_and_steps():
    seeds = torch.tensor([0, 1, 2**32 - 1, 2**32, 2**63 - 1])
    steps = torch.tensor([0, 2**40, 7, 2**63 - 1, 3])
    noise = uniform_noise(seeds, steps, 4096)
    assert noise.dtype == torch.float32 and noise.shape == (5, 4096)
    assert float(noise.min()) > 0 and float(noise.max()) < 1
    assert all(len(set(row.tolist())) > 4000 for row in noise)  # distinct hash inputs: few 24-bit collisions
    assert abs(float(noise.mean()) - 0.5) < 0.01


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_uniform_noise_is_bitwise_the_same_on_cuda_and_cpu():
    seeds = torch.randint(0, 2**63 - 1, (16,))
    steps = torch.randint(0, 2**40, (16,))
    assert torch.equal(uniform_noise(seeds, steps, 50000),
                       uniform_noise(seeds.cuda(), steps.cuda(), 50000).cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampler_captures_in_a_cuda_graph_and_replays_the_eager_tokens():
    batch, vocab = 8, 1000
    args = [torch.randn(batch, vocab, device="cuda"), torch.rand(batch, device="cuda") + 0.5,
            torch.tensor([0, 5] * 4, device="cuda"), torch.tensor([1.0, 0.9] * 4, device="cuda"),
            torch.arange(batch, device="cuda"), torch.zeros(batch, dtype=torch.long, device="cuda")]
    eager = SAMPLER(*args)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        SAMPLER(*args)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = SAMPLER(*args)
    graph.replay()
    assert torch.equal(captured, eager)
    args[5].fill_(3)
    graph.replay()
    assert torch.equal(captured, SAMPLER(*args))

