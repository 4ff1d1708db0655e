"""SamplingParams: defaults, normalisation and a ValueError naming every bad field."""

import dataclasses

import pytest

from questkv.engine.sampling_params import SamplingParams


def test_defaults_sample_at_temperature_one_with_no_filter_and_no_stop():
    params = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.seed, params.max_tokens) == (1.0, 1.0, 0, None, 16)
    assert params.stop == () and params.stop_token_ids == () and not params.ignore_eos
    assert params.token_budget is None and not params.greedy


def test_temperature_zero_is_greedy_and_values_are_normalised():
    params = SamplingParams(temperature=0, top_p=1, top_k=-1, stop="###", stop_token_ids=[3, 5], seed=0)
    assert params.greedy and isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert params.top_k == 0  # vLLM's -1 means off, stored as 0
    assert params.stop == ("###",) and params.stop_token_ids == (3, 5)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc") and SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()


def test_params_are_frozen_and_hashable():
    params = SamplingParams(stop=["x"], stop_token_ids=[1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5
    assert hash(params) == hash(SamplingParams(stop=("x",), stop_token_ids=(1,)))


def test_there_is_no_n_field():
    with pytest.raises(TypeError):
        SamplingParams(n=2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, r"SamplingParams.temperature must be in \[0.0, inf\], got -0.1"),
        ({"temperature": float("nan")}, "SamplingParams.temperature must be a finite number"),
        ({"temperature": "1"}, "SamplingParams.temperature must be a finite number"),
        ({"top_p": 0.0}, r"SamplingParams.top_p must be in \(0.0, 1.0\], got 0.0"),
        ({"top_p": 1.5}, r"SamplingParams.top_p must be in \(0.0, 1.0\], got 1.5"),
        ({"top_k": -2}, "SamplingParams.top_k must be >= 0, got -2"),
        ({"top_k": 2.0}, "SamplingParams.top_k must be an int"),
        ({"top_k": -1.0}, "SamplingParams.top_k must be an int"),
        ({"top_k": True}, "SamplingParams.top_k must be an int"),
        ({"seed": -1}, "SamplingParams.seed must be >= 0, got -1"),
        ({"seed": 2**63}, "SamplingParams.seed must be <= 9223372036854775807"),
        ({"seed": 1.5}, "SamplingParams.seed must be an int"),
        ({"max_tokens": 0}, "SamplingParams.max_tokens must be >= 1, got 0"),
        ({"max_tokens": None}, "SamplingParams.max_tokens must be an int"),
        ({"stop": ""}, "SamplingParams.stop must hold non-empty strings, got ''"),
        ({"stop": ["ok", ""]}, "SamplingParams.stop must hold non-empty strings"),
        ({"stop": ["ok", 3]}, "SamplingParams.stop must hold non-empty strings, got 3"),
        ({"stop": 3}, "SamplingParams.stop must be a string or a list of strings, got 3"),
        ({"stop_token_ids": [1, -1]}, r"SamplingParams.stop_token_ids\[1\] must be >= 0, got -1"),
        ({"stop_token_ids": ["1"]}, r"SamplingParams.stop_token_ids\[0\] must be an int"),
        ({"stop_token_ids": 5}, "SamplingParams.stop_token_ids must be a list of token ids, got 5"),
        ({"ignore_eos": 1}, "SamplingParams.ignore_eos must be a bool, got 1"),
        ({"token_budget": 0}, "SamplingParams.token_budget must be >= 1, got 0"),
        ({"token_budget": 64.0}, "SamplingParams.token_budget must be an int"),
    ],
)
def test_every_invalid_field_raises_a_value_error_naming_it(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 1e-6, 9.99e-6])
def test_a_positive_temperature_below_1e_5_is_greedy(temperature):
    params = SamplingParams(temperature=temperature, top_p=0.5, seed=3)
    assert params.greedy and params.temperature == 0.0  # dividing logits by it would overflow float32
    assert not SamplingParams(temperature=1e-5).greedy


def test_a_stop_string_that_is_not_valid_unicode_is_refused():
    with pytest.raises(ValueError, match="SamplingParams.stop is not valid Unicode: a lone surrogate"):
        SamplingParams(stop=["ok", "x\ud800"])
