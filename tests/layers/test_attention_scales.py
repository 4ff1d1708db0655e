"""The fp8 pool's K/V scales in the engine's attention layer: the data-free rule (``Attention.fit_kv_scales``: the
smallest power of two >= 1 that brings a head's bound within e4m3's range, never over a checkpoint's scale) and
per-KV-head scales applied as the maths says: the layer attends ``fp8(k / s) * s`` and ``fp8(v / s) * s``, each KV
head with its own ``s``, on a whole prefill and on one that reads the pages after a cached chunk."""

import re

import pytest
import torch
import torch.nn.functional as F

from questkv.cache.paged import PagedKVCache
from questkv.decode.context import PrefillRows, StepContext
from questkv.layers.attention import Attention, bind_cache
from questkv.layers.rotary import RotaryEmbedding
from questkv.ops import reference

HQ, HKV, D, PAGE = 4, 2, 8, 4
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def test_fit_kv_scales_gives_the_smallest_power_of_two_at_least_one_that_keeps_each_head_in_range():
    attention = Attention(0, HQ, HKV, D, sm_scale=D ** -0.5)
    attention.fit_kv_scales(torch.tensor([[3.0, FP8_MAX], [FP8_MAX * 1.01, FP8_MAX * 100]]), FP8_MAX)
    assert attention.kv_scales.tolist() == [[1.0, 1.0], [2.0, 128.0]]
    attention.set_kv_scale("k", torch.tensor(0.5), "model.layers.0.self_attn.k_scale")
    attention.fit_kv_scales(torch.tensor([[FP8_MAX * 9, FP8_MAX * 9], [1.0, FP8_MAX * 3]]), FP8_MAX)
    assert attention.kv_scales.tolist() == [[0.5, 0.5], [1.0, 4.0]]  # the checkpoint's keys' scale is kept


@pytest.mark.parametrize("shape", [(3,), (2, 2)])
def test_a_kv_scale_of_another_size_is_refused_naming_it_and_changes_nothing(shape):
    attention = Attention(0, HQ, HKV, D, sm_scale=D ** -0.5)
    message = r"weight 'w' must be one number .* or 2 \(one per KV head\), got shape " + re.escape(str(shape))
    with pytest.raises(ValueError, match=message):
        attention.set_kv_scale("v", torch.full(shape, 2.0), "w")
    assert attention.kv_scales.tolist() == [[1.0, 1.0], [1.0, 1.0]] and attention.kv_scales_given == [False, False]


def expected(q, k, v, cos, sin, k_scale, v_scale):
    """Causal GQA attention of the rotated ``q`` over ``fp8(rotated k / k_scale) * k_scale`` and
    ``fp8(v / v_scale) * v_scale`` (scales ``[HKV]``), fp32: ``[T, HQ, D]``."""
    q, k = reference.rotate(q, cos, sin), reference.rotate(k, cos, sin)
    k = (k / k_scale[:, None]).to(FP8).float() * k_scale[:, None]
    v = (v / v_scale[:, None]).to(FP8).float() * v_scale[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, scale=D ** -0.5, enable_gqa=True)
    return out[0].transpose(0, 1)


def test_per_head_scales_attend_each_heads_rescaled_fp8_keys_and_values_on_a_prefill_and_after_cached_pages():
    k_scale, v_scale = torch.tensor([0.25, 8.0]), torch.tensor([16.0, 0.5])
    magnitude = torch.tensor([0.3, 40.0])[None, :, None]  # the two KV heads' keys and values far apart in size
    n, first = 11, 8
    q = torch.randn(n, HQ, D)
    k, v = torch.randn(n, HKV, D) * magnitude, torch.randn(n, HKV, D) * magnitude.flip(1)
    cos, sin = RotaryEmbedding(D, 64, 10000.0).cos_sin(torch.arange(n), torch.float32)
    want = expected(q, k, v, cos, sin, k_scale, v_scale)

    def layer_and_cache():
        attention = Attention(0, HQ, HKV, D, sm_scale=D ** -0.5)
        attention.set_kv_scale("k", k_scale, "k_scale")
        attention.set_kv_scale("v", v_scale, "v_scale")
        cache = PagedKVCache(1, HKV, D, 16, PAGE, kv_dtype=FP8)
        bind_cache(attention, cache)
        assert attention.scaled
        return attention, cache, cache.add_sequence()

    attention, cache, seq = layer_and_cache()
    whole = attention(q.clone(), k.clone(), v, cos, sin, StepContext.for_prefill(cache, [seq], [n]))
    torch.testing.assert_close(whole, want, rtol=1e-5, atol=1e-5)

    attention, cache, seq = layer_and_cache()
    attention(q[:first].clone(), k[:first].clone(), v[:first], cos[:first], sin[:first],
              StepContext.for_prefill(cache, [seq], [first]))
    slots = cache.reserve([seq], [n - first])
    page_table, seq_lens = cache.batch([seq])
    ctx = StepContext(slots, prefill=PrefillRows(page_table, seq_lens, [0, n - first], [first]))
    rest = attention(q[first:].clone(), k[first:].clone(), v[first:], cos[first:], sin[first:], ctx)
    torch.testing.assert_close(rest, want[first:], rtol=1e-5, atol=1e-5)
