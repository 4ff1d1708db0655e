"""Paged prefill attention's torch reference against dense SDPA, its dispatch, and the inputs it refuses (the Triton
kernel against this reference: ``test_triton_prefill_attention.py``).

Ragged batches: sequences with no cached token, a cache ending inside a page or on a page boundary, one new token,
chunks crossing pages. Pools are poisoned with NaN wherever no token of the batch lives, and the page table is
padded with out-of-range pages: neither may be read.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from questkv import ops
from questkv.ops import reference

PAGE = 4
# (cached tokens, new tokens) per sequence
CASES = {
    "fresh, mid-page and page-aligned caches": ([0, 5, 8], [7, 1, 13]),
    "a long cache and one token": ([37, 3], [1, 9]),
    "a sequence with no new token": ([4, 6], [0, 5]),
    "first rows two keys before a key block ends": ([14, 30], [3, 4]),
}
# (num_q_heads, num_kv_heads, head_dim): MHA, GQA of 4, a group of 3 with a head_dim that is not a power of two
HEADS = [(4, 4, 32), (8, 2, 32), (6, 2, 24)]


def prefill_case(cached, new, heads, dtype, gen, max_pages=12):
    """Contiguous per-sequence K/V ``[L, Hkv, D]`` written into random pages of a NaN pool; returns the op's inputs
    and the contiguous K/V."""
    num_q, num_kv, head_dim = heads
    lens = [c + n for c, n in zip(cached, new)]
    num_pages = sum(-(-length // PAGE) for length in lens) + 3
    k_pages = torch.full((num_pages, PAGE, num_kv, head_dim), float("nan"), dtype=dtype)
    v_pages = torch.full_like(k_pages, float("nan"))
    table = torch.full((len(lens), max_pages), 10**6, dtype=torch.int32)  # padding: never read
    perm = torch.randperm(num_pages, generator=gen)
    keys, values, used = [], [], 0
    for row, length in enumerate(lens):
        pages = perm[used:used + -(-length // PAGE)]
        used += len(pages)
        table[row, :len(pages)] = pages.int()
        keys.append(torch.randn(length, num_kv, head_dim, generator=gen).to(dtype))
        values.append(torch.randn(length, num_kv, head_dim, generator=gen).to(dtype))
        position = torch.arange(length)
        k_pages[pages[position // PAGE], position % PAGE] = keys[-1]
        v_pages[pages[position // PAGE], position % PAGE] = values[-1]
    starts = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(new), num_q, head_dim, generator=gen).to(dtype)
    return (q, k_pages, v_pages, table, starts, torch.tensor(lens, dtype=torch.int32)), keys, values


def generator() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", HEADS)
# float64 queries are attended in float64 (reference.attention_dtype), as the prefill without cached tokens attends
# them: a float64 model's chunked prefill then rounds as its unchunked one.
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_reference_equals_dense_causal_sdpa_over_each_whole_sequence(case, heads, dtype, tol):
    inputs, keys, values = prefill_case(*CASES[case], heads, dtype, generator())
    q, starts = inputs[0], inputs[4].tolist()
    out = reference.paged_prefill_attention(*inputs, sm_scale=0.3)
    for row, (begin, end) in enumerate(zip(starts[:-1], starts[1:])):
        if begin == end:
            continue
        qs = q[begin:end].transpose(0, 1)[None].double()  # [1, Hq, n, D]
        ks = keys[row].transpose(0, 1)[None].double()  # [1, Hkv, L, D]
        vs = values[row].transpose(0, 1)[None].double()
        mask = causal_lower_right(end - begin, ks.shape[2])
        want = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out[begin:end].double(), want[0].transpose(0, 1), rtol=tol, atol=tol)


def test_dispatch_runs_the_reference_on_cpu():
    inputs, _, _ = prefill_case([5, 0], [3, 2], (8, 2, 16), torch.float32, generator())
    want = reference.paged_prefill_attention(*inputs)
    assert torch.equal(ops.paged_prefill_attention(*inputs, backend="auto"), want)


def _bad(inputs, **changes):
    names = ("q", "k_pages", "v_pages", "page_table", "query_starts", "seq_lens")
    values = dict(zip(names, inputs))
    values.update(changes)
    return [values[name] for name in names]


def mismatched_inputs():
    """Inputs that disagree in shape or dtype, each a full argument list of the op."""
    inputs, _, _ = prefill_case([5, 0], [3, 2], (8, 2, 16), torch.float32, generator())
    q, k_pages, v_pages, table, starts, lens = inputs
    bad = {
        "head_dim": dict(q=q[..., :8]),
        "q heads": dict(q=q[:, :7]),
        "v dtype": dict(v_pages=v_pages.double()),
        "v shape": dict(v_pages=v_pages[:, :2]),
        "starts dtype": dict(query_starts=starts.long()),
        "starts length": dict(query_starts=starts[:2]),
        "lens dtype": dict(seq_lens=lens.long()),
        "table rows": dict(page_table=table[:1]),
        "q ints": dict(q=q.int()),
    }
    return {name: _bad(inputs, **change) for name, change in bad.items()}


def test_mismatched_inputs_are_refused():
    for name, args in mismatched_inputs().items():
        with pytest.raises(ValueError):
            reference.paged_prefill_attention(*args)


def test_the_reference_refuses_inconsistent_lengths():
    inputs, _, _ = prefill_case([5, 0], [3, 2], (8, 2, 16), torch.float32, generator())
    q, k_pages, v_pages, table, starts, lens = inputs
    with pytest.raises(ValueError, match="query_starts"):
        reference.paged_prefill_attention(q, k_pages, v_pages, table, torch.tensor([0, 3, 4], dtype=torch.int32), lens)
    with pytest.raises(ValueError, match="hold its new tokens"):
        reference.paged_prefill_attention(q, k_pages, v_pages, table, starts, torch.tensor([8, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="max_query_len"):
        reference.paged_prefill_attention(*inputs, max_query_len=2)
