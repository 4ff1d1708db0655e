"""Output log-probabilities (``SamplingParams.logprobs``) on CPU: the log-softmax of a reference forward's logits,
the output token's rank, the most likely tokens; a lossless request's equal the dense engine's; forced outputs,
stop strings inside an accepted run, asynchronous scheduling and a batch that mixes verify rows with forced rows.
The tiny random model and prompts of ``test_llm.py`` (float64)."""

import random

import pytest
import torch

from questkv.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from questkv.engine.sequence import Logprob
from tests.engine.test_llm import SMALL, VOCAB, greedy, make_llm, prompt
from tests.helpers import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), VOCAB, seed=random.randrange(1 << 16))


def lossless(model_dir, k: int = 4, **kwargs):
    return make_llm(model_dir, SMALL, speculative_config={"method": "quest", "num_speculative_tokens": k,
                                                          "adaptive": False}, **kwargs)


def reference_log_probs(model_dir, prompt_ids, output_ids) -> torch.Tensor:
    """``[len(output_ids), vocab]`` float32 log-softmax of transformers' logits at each output position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt_ids) + list(output_ids)])).logits[0]
    return torch.log_softmax(logits[len(prompt_ids) - 1:-1].float(), dim=-1)


def assert_entries_match(entries, log_probs: torch.Tensor, output_ids, top: int, tol: float = 1e-5) -> None:
    """Each position's dict: the output token first with its log-probability and rank, then the ``top`` most likely
    tokens, nothing else; ranks and the top set as the reference gives them, up to tokens within ``tol`` of each
    other (the two forwards round differently)."""
    assert len(entries) == len(output_ids)
    for entry, row, token in zip(entries, log_probs, output_ids):
        assert next(iter(entry)) == token
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=tol)
        above = lambda value, margin: 1 + int((row > value + margin).sum())  # noqa: E731 (a rank within a margin)
        assert above(row[token], tol) <= entry[token].rank <= above(row[token], -tol)
        others = {t: lp for t, lp in entry.items() if t != token}  # the most likely tokens but the output one
        assert len(entry) in (top, top + 1) and len(others) in (top - 1, top)
        assert sorted(lp.rank for lp in others.values()) == sorted({lp.rank for lp in others.values()})
        assert all(lp.rank <= top for lp in others.values())
        floor = row.topk(top).values[-1] if top else None
        for t, lp in others.items():
            assert lp.logprob == pytest.approx(row[t].item(), abs=tol)
            assert row[t] >= floor - tol  # among the reference's top ``top``, up to near-ties


@pytest.mark.parametrize("top", [0, 1, 5])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_a_reference_forwards_log_softmax_before_temperature(model_dir, top, temperature):
    llm = make_llm(model_dir)
    prompts = [prompt(random.randint(1, 40)) for _ in range(3)]
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=12, ignore_eos=True, logprobs=top)
    for p, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert_entries_match(out.logprobs, reference_log_probs(model_dir, p, out.token_ids), out.token_ids, top)
        if temperature == 0:
            assert all(entry[token].rank == 1 for entry, token in zip(out.logprobs, out.token_ids))


def test_a_request_without_logprobs_gets_none_beside_one_that_asks(model_dir):
    llm = make_llm(model_dir)
    plain, asking = llm.generate([prompt(9), prompt(14)], [greedy(5), greedy(5, logprobs=2)], use_tqdm=False)
    assert plain.logprobs is None and len(asking.logprobs) == 5
    assert all(isinstance(lp, Logprob) for entry in asking.logprobs for lp in entry.values())


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_lossless_logprobs_are_the_dense_engines(model_dir, asynchronous, temperature):
    """A lossless request's log-probabilities come from its verify steps' dense attention: the dense engine's,
    whatever it drafted (a ragged batch, rounds of 4 drafts)."""
    dense, fast = make_llm(model_dir), lossless(model_dir, async_scheduling=asynchronous)
    prompts = [prompt(random.randint(20, 90)) for _ in range(4)]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=random.randint(8, 24), ignore_eos=True,
                             logprobs=3) for i in range(4)]
    want = dense.generate(prompts, params, use_tqdm=False)
    got = fast.generate(prompts, params, use_tqdm=False)
    assert sum(out.metrics.mean_tokens_per_verify or 0 for out in got) > 0  # rounds were verified
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [list(entry) for entry in g.logprobs] == [list(entry) for entry in w.logprobs]
        for ge, we in zip(g.logprobs, w.logprobs):
            for token in we:
                assert ge[token].logprob == pytest.approx(we[token].logprob, abs=1e-6)
                assert ge[token].rank == we[token].rank


def test_a_stop_string_inside_an_accepted_run_drops_the_logprobs_after_it(model_dir):
    dense, fast = make_llm(model_dir), lossless(model_dir, 8)
    for _ in range(50):  # a prompt whose greedy output holds a new token past the first round
        p = prompt(random.randint(60, 90))
        (ref,) = dense.generate([p], greedy(24, logprobs=1), use_tqdm=False)
        k = next((k for k in range(3, 24) if ref.token_ids[k] >= 2 and ref.token_ids[k] not in ref.token_ids[:k]),
                 None)
        if k is not None:
            break
    (out,) = fast.generate([p], greedy(24, stop=f"x{ref.token_ids[k]:02d}", logprobs=1), use_tqdm=False)
    assert out.token_ids == ref.token_ids[:k + 1] and len(out.logprobs) == k + 1


def test_forced_outputs_beside_verify_rows_keep_each_rows_logprobs(model_dir):
    """A step that carries lossless verify rows (several tokens each) and a request at its forced outputs: each
    row's log-probabilities are its own (the forced token's, at a forced output)."""
    fast = lossless(model_dir)
    long = prompt(80)
    tail = torch.randint(2, VOCAB, (6,)).tolist()
    params = [greedy(20, logprobs=0), greedy(10, forced_token_ids=tail, speculative_tokens=0, logprobs=2)]
    drafting, forced = fast.generate([long, prompt(30)], params, use_tqdm=False)
    assert drafting.metrics.mean_tokens_per_verify is not None
    dense = make_llm(model_dir)
    want_drafting, want_forced = dense.generate([long, prompt(1)], [params[0], greedy(1)], use_tqdm=False)
    assert drafting.token_ids == want_drafting.token_ids
    assert forced.token_ids[:6] == tuple(tail) and len(forced.logprobs) == 10
    assert [entry[t].logprob for entry, t in zip(forced.logprobs, tail)] == pytest.approx(forced.forced_logprobs)


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 1.5, "3", True])
def test_bad_logprobs_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="SamplingParams.logprobs"):
        SamplingParams(logprobs=value)
