"""The engine's attention layer on a prefill that starts after cached pages (``PrefillRows.cached_lens``): the new
tokens' outputs equal those of one causal prefill of the whole sequence."""

import torch

from questkv.cache.paged import PagedKVCache
from questkv.decode.context import PrefillRows, StepContext
from questkv.layers.attention import Attention, bind_cache
from questkv.layers.rotary import RotaryEmbedding

HQ, HKV, D, PAGE = 4, 2, 8, 4


def test_a_prefill_after_cached_pages_equals_the_whole_causal_prefill():
    torch.manual_seed(0)
    attention = Attention(0, HQ, HKV, D, sm_scale=D ** -0.5)
    whole_cache = PagedKVCache(1, HKV, D, 16, PAGE)
    split_cache = PagedKVCache(1, HKV, D, 16, PAGE)
    lens, cached = (11, 6), (8, 0)  # sequence 0 holds two pages already, sequence 1 starts empty
    q = [torch.randn(n, HQ, D) for n in lens]
    k = [torch.randn(n, HKV, D) for n in lens]
    v = [torch.randn(n, HKV, D) for n in lens]
    rope = [RotaryEmbedding(D, 64, 10000.0).cos_sin(torch.arange(n), torch.float32) for n in lens]  # (cos, sin)

    def rows(tensors, first, rest):  # sequence 0's rows [first:], sequence 1's rows [rest:], one tensor
        return torch.cat([tensors[0][first:], tensors[1][rest:]])

    bind_cache(attention, whole_cache)
    ids = [whole_cache.add_sequence() for _ in lens]
    ctx = StepContext.for_prefill(whole_cache, ids, lens)
    cos, sin = (rows([r[i] for r in rope], 0, 0) for i in (0, 1))
    whole = attention(torch.cat(q), torch.cat(k), torch.cat(v), cos, sin, ctx)  # rotates its clones of q and k

    bind_cache(attention, split_cache)
    ids = [split_cache.add_sequence() for _ in lens]
    first = StepContext.for_prefill(split_cache, ids[:1], cached[:1])
    attention(q[0][:8].clone(), k[0][:8].clone(), v[0][:8], rope[0][0][:8], rope[0][1][:8], first)
    news = [n - c for n, c in zip(lens, cached)]
    slots = split_cache.reserve(ids, news)
    page_table, seq_lens = split_cache.batch(ids)
    ctx = StepContext(slots, prefill=PrefillRows(page_table, seq_lens, [0, news[0], sum(news)], list(cached)))
    cos, sin = (rows([r[i] for r in rope], 8, 0) for i in (0, 1))
    out = attention(rows(q, 8, 0), rows(k, 8, 0), rows(v, 8, 0), cos, sin, ctx)

    torch.testing.assert_close(out[:news[0]], whole[8:lens[0]])
    torch.testing.assert_close(out[news[0]:], whole[lens[0]:])
    torch.testing.assert_close(split_cache.k_pages[:, :6], whole_cache.k_pages[:, :6])  # the same pages, written
