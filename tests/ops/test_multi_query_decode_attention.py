"""Decode attention of each sequence's last few queries (a lossless verify step): the reference against the paged
prefill reference (the same causal rule, another code path), and the Triton kernel against the reference under the
interpreter (CPU), with query blocks, splits and relaunches on the same buffers.

Pools are poisoned with NaN wherever no token of the batch lives and page tables padded with out-of-range pages:
neither may be read. Shapes stay tiny (the interpreter runs programs one after another).
"""

from __future__ import annotations

import pytest
import torch

from questkv.ops import reference

PAGE = 8
# (num_q_heads, num_kv_heads, head_dim): GQA of 4, MHA, a group of 3 with a head_dim that is not a power of two
HEADS = [(8, 2, 32), (4, 4, 16), (6, 2, 24)]


def generator() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def verify_case(lens, num_queries, heads, dtype, gen, max_pages=6):
    """``q`` ``[batch, num_queries, Hq, D]`` and a NaN-poisoned pool holding ``lens[i]`` random tokens per sequence
    in random pages; returns ``(q, k_pages, v_pages, page_table, seq_lens)``."""
    num_q, num_kv, head_dim = heads
    num_pages = sum(-(-length // PAGE) for length in lens) + 3
    k_pages = torch.full((num_pages, PAGE, num_kv, head_dim), float("nan"), dtype=dtype)
    v_pages = torch.full_like(k_pages, float("nan"))
    table = torch.full((len(lens), max_pages), 10**6, dtype=torch.int32)  # padding: never read
    perm, used = torch.randperm(num_pages, generator=gen), 0
    for row, length in enumerate(lens):
        pages = perm[used:used + -(-length // PAGE)]
        used += len(pages)
        table[row, :len(pages)] = pages.int()
        position = torch.arange(length)
        k_pages[pages[position // PAGE], position % PAGE] = torch.randn(length, num_kv, head_dim, generator=gen).to(dtype)
        v_pages[pages[position // PAGE], position % PAGE] = torch.randn(length, num_kv, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), num_queries, num_q, head_dim, generator=gen).to(dtype)
    return q, k_pages, v_pages, table, torch.tensor(lens, dtype=torch.int32)


def readable(table: torch.Tensor) -> torch.Tensor:
    """The table with padding replaced by page 0: the reference gathers padding before masking it."""
    return torch.where(table >= 10**6, 0, table)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("num_queries", [1, 2, 5])
def test_reference_equals_the_paged_prefill_reference_of_the_last_positions(heads, num_queries):
    q, k_pages, v_pages, table, lens = verify_case([37, 9, 16], num_queries, heads, torch.float32, generator())
    got = reference.paged_decode_attention(q, k_pages, v_pages, readable(table), lens, sm_scale=0.3)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32) * num_queries
    flat = q.reshape(-1, *q.shape[2:])
    want = reference.paged_prefill_attention(flat, k_pages, v_pages, readable(table), starts, lens, sm_scale=0.3)
    assert not got.isnan().any()
    torch.testing.assert_close(got.reshape(flat.shape), want, rtol=1e-5, atol=1e-5)


def test_reference_with_one_query_equals_the_one_query_form():
    q, k_pages, v_pages, table, lens = verify_case([37, 9], 1, (8, 2, 32), torch.float32, generator())
    scores = torch.randn(2, 2, table.shape[1], generator=generator())
    selected = reference.select_pages(scores, lens, PAGE, 2, 0, 0)
    for sel in (None, selected):
        one = reference.paged_decode_attention(q[:, 0], k_pages, v_pages, readable(table), lens, sel)
        assert torch.equal(reference.paged_decode_attention(q, k_pages, v_pages, readable(table), lens, sel)[:, 0], one)


@pytest.fixture
def kernels():
    pytest.importorskip("triton")
    from questkv.ops.triton import decode_attention

    return decode_attention


def _tol(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    assert not out.isnan().any()
    return ((out.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("num_queries", [2, 5, 17])
def test_kernel_matches_reference_dense(kernels, dtype, heads, num_queries):
    q, k_pages, v_pages, table, lens = verify_case([41, 17, 30], num_queries, heads, dtype, generator())
    want = reference.paged_decode_attention(q, k_pages, v_pages, readable(table), lens)
    got = kernels.paged_decode_attention(q, k_pages, v_pages, table, lens)
    assert got.shape == q.shape and got.dtype == dtype
    assert _rel_err(got, want) < _tol(dtype)


@pytest.mark.parametrize("selection", ["kv_head", "q_head"])
def test_kernel_matches_reference_over_selected_pages(kernels, selection):
    """Several queries over a selection (each query sees the selected keys up to its own position; the first page
    is selected, so every query sees a key)."""
    heads = (8, 2, 32)
    gen = generator()
    q, k_pages, v_pages, table, lens = verify_case([41, 30], 3, heads, torch.float32, gen)
    sel_heads = heads[0] if selection == "q_head" else heads[1]
    scores = torch.randn(2, sel_heads, table.shape[1], generator=gen)
    selected = reference.select_pages(scores, lens, PAGE, 3, sink_pages=1, recent_pages=1)
    want = reference.paged_decode_attention(q, k_pages, v_pages, readable(table), lens, selected)
    got = kernels.paged_decode_attention(q, k_pages, v_pages, table, lens, selected)
    assert _rel_err(got, want) < 1e-5


@pytest.mark.parametrize("num_splits", [1, 3])
def test_query_blocks_splits_and_relaunches(kernels, num_splits, monkeypatch):
    """Fewer rows per program than the queries need (blocks of 2 positions of a group of 4: 3 blocks of 5 queries),
    explicit splits (a short sequence leaves whole splits empty), and a second launch on the same buffers: the
    fused merge leaves every counter of every block at zero."""
    monkeypatch.setattr(kernels, "_MAX_QUERY_ROWS", 8)
    heads = (8, 2, 32)
    q, k_pages, v_pages, table, lens = verify_case([44, 6], 5, heads, torch.float32, generator())
    assert kernels.query_block(5, 4) == 2
    buffers = kernels.attention_buffers(2, 8, 2, 32, table.shape[1], PAGE, True, q.device, num_splits, num_queries=5)
    assert buffers.counters.shape == (2, 3 * 2) and buffers.part_out.shape[1] == 5 * 8
    want = reference.paged_decode_attention(q, k_pages, v_pages, readable(table), lens, None, 0.3)
    for _ in range(2):
        out = kernels.paged_decode_attention_into(torch.empty_like(q), buffers, q, k_pages, v_pages, table, lens, None, 0.3)
        assert _rel_err(out, want) < 1e-5
        assert not buffers.counters.any()


@pytest.mark.parametrize("queries", [2, 5])
def test_verify_grids_under_another_launch_configuration(kernels, queries, monkeypatch):
    """A multi-query grid under another iteration length and split plan (benchmarks/verify_attention.py --sweep
    tries them) gives the reference's output; the plan is the patched dense kind's."""
    monkeypatch.setitem(kernels._CONFIG, "dense", (128, 3, 2))
    monkeypatch.setitem(kernels._CONFIG, "dense-few", (128, 3, 2))
    heads = (8, 2, 32)
    q, k_pages, v_pages, table, lens = verify_case([45, 23], queries, heads, torch.float32, generator())
    buffers = kernels.attention_buffers(2, 8, 2, 32, table.shape[1], PAGE, True, q.device, num_queries=queries)
    assert buffers.items_per_split % kernels.pages_per_iter(PAGE, "dense") == 0
    want = reference.paged_decode_attention(q, k_pages, v_pages, readable(table), lens, None)
    got = kernels.paged_decode_attention_into(torch.empty_like(q), buffers, q, k_pages, v_pages, table, lens, None)
    assert _rel_err(got, want) < 1e-5


def test_kernel_refuses_buffers_of_another_query_count(kernels):
    q, k_pages, v_pages, table, lens = verify_case([20, 9], 3, (8, 2, 32), torch.float32, generator())
    one_query = kernels.attention_buffers(2, 8, 2, 32, table.shape[1], PAGE, True, q.device)
    with pytest.raises(ValueError, match="part_out must have shape"):
        kernels.paged_decode_attention_into(torch.empty_like(q), one_query, q, k_pages, v_pages, table, lens, None)
    buffers = kernels.attention_buffers(2, 8, 2, 32, table.shape[1], PAGE, True, q.device, num_queries=3)
    with pytest.raises(ValueError, match="out must have shape"):
        kernels.paged_decode_attention_into(torch.empty_like(q[:, 0]), buffers, q, k_pages, v_pages, table, lens, None)
