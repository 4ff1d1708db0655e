"""questkv.models.shapes: named configs for random-weight runs read into the right ModelSpec."""

import pytest

from questkv.layers.rotary import RopeScaling
from questkv.models.llama import ModelSpec
from questkv.models.shapes import DUMMY_SHAPES, dummy_config

LLAMA3_SCALING = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)

# name -> (layers, hidden, intermediate, q heads, kv heads, vocab, theta, scaling, max positions, qkv bias, tied)
WANT = {
    "llama3.1-8b": (32, 4096, 14336, 32, 8, 128256, 500000.0, LLAMA3_SCALING, 131072, False, False),
    "llama2-7b": (32, 4096, 11008, 32, 32, 32000, 10000.0, None, 4096, False, False),
    "llama3-70b": (80, 8192, 28672, 64, 8, 128256, 500000.0, LLAMA3_SCALING, 131072, False, False),
    "qwen2.5-7b": (28, 3584, 18944, 28, 4, 152064, 1000000.0, None, 32768, True, False),
    "qwen2.5-1.5b": (28, 1536, 8960, 12, 2, 151936, 1000000.0, None, 32768, True, True),
}


def test_every_name_is_tested():
    assert set(DUMMY_SHAPES) == set(WANT)


@pytest.mark.parametrize("name", list(WANT))
def test_dummy_configs_have_the_published_shapes(name):
    spec = ModelSpec.from_hf_config(dummy_config(name))
    got = (spec.num_layers, spec.hidden_size, spec.intermediate_size, spec.num_q_heads, spec.num_kv_heads,
           spec.vocab_size, spec.rope_theta, spec.rope_scaling, spec.max_position_embeddings, spec.attention_bias,
           spec.tie_word_embeddings)
    assert got == WANT[name]
    assert spec.head_dim == 128 and not spec.o_proj_bias


def test_max_position_embeddings_can_be_overridden_and_each_call_is_a_fresh_config():
    long = dummy_config("llama2-7b", max_position_embeddings=32768)
    assert ModelSpec.from_hf_config(long).max_position_embeddings == 32768
    assert dummy_config("llama2-7b").max_position_embeddings == 4096
    short = ModelSpec.from_hf_config(dummy_config("llama3.1-8b", max_position_embeddings=16384))
    assert short.max_position_embeddings == 16384 and short.rope_scaling == LLAMA3_SCALING
    first = dummy_config("llama3.1-8b")
    first.rope_parameters["factor"] = 2.0
    assert dummy_config("llama3.1-8b").rope_parameters["factor"] == 8.0


def test_unknown_names_raise_value_error_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"one of 'llama3.1-8b', 'llama2-7b', 'llama3-70b', 'qwen2.5-7b', 'qwen2.5-1.5b'; got 'gpt-5'"):
        dummy_config("gpt-5")
    with pytest.raises(ValueError, match="max_position_embeddings must be >= 1"):
        dummy_config("llama2-7b", max_position_embeddings=0)
