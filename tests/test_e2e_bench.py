"""benchmarks/e2e_bench.py's comparisons of the CUDA path with the eager reference path, on hand-made outputs (the
checks themselves need a GPU)."""

import pytest

from benchmarks.e2e_bench import _logprobs_agreement
from questkv.engine.sequence import Logprob


def entry(**logprobs):
    """A position's log-probabilities: ``t5=-0.1`` is token 5 at -0.1 (ranks in the given order)."""
    return {int(name[1:]): Logprob(value, rank) for rank, (name, value) in enumerate(logprobs.items(), start=1)}


def test_logprobs_are_compared_up_to_the_first_position_where_the_tokens_differ():
    tokens = {"cuda-graphs": [[5, 7, 9]], "eager-reference": [[5, 7, 8]]}
    logprobs = {"cuda-graphs": [[entry(t5=-0.1, t6=-2.0), entry(t7=-0.5, t3=-1.0), entry(t9=-9.0)]],
                "eager-reference": [[entry(t5=-0.1002, t6=-2.0), entry(t7=-0.5, t3=-1.001), entry(t8=0.0)]]}
    result = _logprobs_agreement(tokens, logprobs)
    assert result["logprobs_same_tokens"] is True
    assert result["logprobs_max_abs_diff"] == pytest.approx(1e-3)


def test_other_tokens_at_a_position_are_reported():
    tokens = {"cuda-graphs": [[5]], "eager-reference": [[5]]}
    logprobs = {"cuda-graphs": [[entry(t5=-0.1, t6=-2.0)]], "eager-reference": [[entry(t5=-0.1, t4=-2.0)]]}
    assert _logprobs_agreement(tokens, logprobs) == {"logprobs_max_abs_diff": 0.0, "logprobs_same_tokens": False}
