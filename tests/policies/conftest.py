import math

import pytest
import torch

from questkv import PagedKVCache


class Cache:
    """A one-layer paged cache of given per-sequence keys/values (lists of ``[len, Hkv, D]``),
    appended in page-straddling chunks so sequences' physical pages interleave."""

    def __init__(self, keys, values, page_size, extra_tokens=0):
        num_kv_heads, head_dim = keys[0].shape[1:]
        num_pages = sum(math.ceil((k.shape[0] + extra_tokens) / page_size) for k in keys) + 2
        self.cache = PagedKVCache(1, num_kv_heads, head_dim, num_pages, page_size, max_seqs=len(keys))
        self.ids = [self.cache.add_sequence() for _ in keys]
        self.keys, self.values = [k.clone() for k in keys], [v.clone() for v in values]
        written, chunk = [0] * len(keys), page_size + 1
        while any(w < k.shape[0] for w, k in zip(written, keys)):
            ids, counts, ks, vs = [], [], [], []
            for i, k in enumerate(keys):
                n = min(chunk, k.shape[0] - written[i])
                if n > 0:
                    ids.append(self.ids[i]), counts.append(n)
                    ks.append(k[written[i] : written[i] + n]), vs.append(values[i][written[i] : written[i] + n])
                    written[i] += n
            self.cache.append(ids, counts, torch.cat(ks)[None], torch.cat(vs)[None])

    def append_token(self, keys, values):
        """Append one token per sequence: keys/values ``[batch, Hkv, D]``."""
        self.cache.append(self.ids, [1] * len(self.ids), keys[None], values[None])
        for i in range(len(self.ids)):
            self.keys[i] = torch.cat([self.keys[i], keys[i : i + 1]])
            self.values[i] = torch.cat([self.values[i], values[i : i + 1]])

    def step_inputs(self):
        """``(layer, page_table, seq_lens)`` for a decode step."""
        page_table, seq_lens = self.cache.batch(self.ids)
        return self.cache.layer(0), page_table, seq_lens


@pytest.fixture(scope="session")
def random_cache():
    """``random_cache(lens, num_kv_heads, head_dim, page_size, extra_tokens=0)``: a :class:`Cache` of
    random mixed-sign keys (shared per-dim offsets) and values."""

    def build(lens, num_kv_heads=2, head_dim=8, page_size=4, extra_tokens=0):
        offset = torch.randn(head_dim)
        keys = [torch.randn(n, num_kv_heads, head_dim) * 2 + offset for n in lens]
        values = [torch.randn(n, num_kv_heads, head_dim) for n in lens]
        return Cache(keys, values, page_size, extra_tokens)

    return build


def dense_probs(q, keys, sm_scale=None):
    """Softmax probabilities ``[Hq, len]`` (float64) of one sequence's query ``[Hq, D]`` over its keys
    ``[len, Hkv, D]``, brute force."""
    group = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).double()  # [len, Hq, D]
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    return torch.softmax(torch.einsum("hd,thd->ht", q.double(), k) * scale, dim=-1)


@pytest.fixture(scope="session")
def brute_probs():
    """:func:`dense_probs`."""
    return dense_probs


@pytest.fixture(scope="session")
def cache_of():
    """``cache_of(keys, values, page_size, extra_tokens=0)``: a :class:`Cache` of given tensors."""
    return Cache
