"""questkv.layers.rotary (and the rotation of questkv.ops.reference) against transformers' Llama rotary embedding,
for each supported rope type."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from questkv.layers.rotary import RopeScaling, RotaryEmbedding, inverse_frequencies
from questkv.models.llama import ModelSpec
from questkv.models.shapes import dummy_config
from questkv.ops.reference import rotate
from tests.helpers import tiny_config


def _ours(config) -> RotaryEmbedding:
    spec = ModelSpec.from_hf_config(config)
    return RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling)


CONFIGS = {
    "default": lambda: tiny_config("llama_mha"),
    "linear": lambda: tiny_config("llama_linear"),
    "llama3": lambda: tiny_config("llama3"),
    "llama3.1-8b": lambda: dummy_config("llama3.1-8b"),
    "qwen3 head_dim": lambda: tiny_config("qwen3"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_inverse_frequencies_equal_transformers(name):
    config = CONFIGS[name]()
    hf = LlamaRotaryEmbedding(config)
    spec = ModelSpec.from_hf_config(config)
    ours = inverse_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, hf.inv_freq, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_rotated_queries_and_keys_equal_transformers(name, dtype):
    config = CONFIGS[name]()
    spec = ModelSpec.from_hf_config(config)
    hf, ours = LlamaRotaryEmbedding(config), _ours(config)
    num_tokens, hq, hkv, d = 9, 4, 2, spec.head_dim
    positions = torch.randint(0, spec.max_position_embeddings, (num_tokens,))
    positions[0] = spec.max_position_embeddings - 1
    q = torch.randn(num_tokens, hq, d).to(dtype)
    k = torch.randn(num_tokens, hkv, d).to(dtype)
    cos, sin = hf(q, positions[None])  # [1, T, D]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cos_rows, sin_rows = ours.cos_sin(positions, dtype)
    got_q, got_k = rotate(q, cos_rows, sin_rows), rotate(k, cos_rows, sin_rows)
    assert got_q.shape == q.shape and got_k.shape == k.shape and got_q.dtype == dtype
    # cos/sin from the same fp32 formula; only the vectorised cos/sin of the CPU may differ by an ulp
    tol = dict(rtol=1e-6, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), **tol)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), **tol)


def test_rotation_keeps_position_zero_unchanged_and_rotates_pairs_of_halves():
    d = 8
    rope = RotaryEmbedding(d, 16, 10000.0)
    x = torch.randn(2, 3, d)
    torch.testing.assert_close(rotate(x, *rope.cos_sin(torch.tensor([0, 0]), torch.float32)), x)
    cos, sin = rope.cos_sin(torch.tensor([5]), torch.float32)
    q = rotate(x[:1], cos, sin)
    # dimension i pairs with i + d/2: the pair's norm is kept
    pair_norm = lambda t: t[..., : d // 2] ** 2 + t[..., d // 2 :] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(q), pair_norm(x[:1]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rope_type="yarn", factor=2.0), "rope_type"),
        (dict(rope_type="linear", factor=0.0), "factor"),
        (dict(rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0,
              original_max_position_embeddings=8192), "high_freq_factor"),
        (dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0), "original_max"),
    ],
)
def test_bad_rope_scaling_raises_value_error_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RopeScaling(**kwargs)


def test_odd_head_dim_is_refused():
    with pytest.raises(ValueError, match="head_dim must be even"):
        RotaryEmbedding(7, 16, 10000.0)
