"""The Triton paged prefill attention against the torch reference, under the interpreter (CPU), fp32 unless said.

Cases and pools from ``test_prefill_attention.py``: ragged batches, NaN wherever no token lives, padded page tables.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from questkv.ops import reference  # noqa: E402
from questkv.ops import triton as tk  # noqa: E402
from questkv.ops.triton import prefill_attention  # noqa: E402
from tests.ops.test_prefill_attention import CASES, HEADS, generator, mismatched_inputs, prefill_case  # noqa: E402


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any()
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 32)])
def test_triton_matches_reference(case, heads, block_m, block_n, monkeypatch):
    """Small tiles: several query tiles per sequence and several key blocks, unmasked and masked."""
    monkeypatch.setattr(prefill_attention, "_BLOCK_M", block_m)
    monkeypatch.setattr(prefill_attention, "_BLOCK_N", block_n)
    inputs, _, _ = prefill_case(*CASES[case], heads, torch.float32, generator())
    max_query_len = max(CASES[case][1])
    want = reference.paged_prefill_attention(*inputs)
    got = tk.paged_prefill_attention(*inputs, max_query_len=max_query_len)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert _rel_err(got, want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_matches_reference_in_16_bits(dtype, monkeypatch):
    monkeypatch.setattr(prefill_attention, "_BLOCK_N", 16)
    inputs, _, _ = prefill_case(*CASES["fresh, mid-page and page-aligned caches"], (8, 2, 32), dtype, generator())
    want = reference.paged_prefill_attention(*inputs)
    got = tk.paged_prefill_attention(*inputs)  # max_query_len read from query_starts
    assert got.dtype == dtype
    assert _rel_err(got, want) < {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


def test_triton_reads_a_head_major_pool_with_a_custom_scale():
    """The kernel takes the pools' strides: the same values stored head-major give the same output bit for bit."""
    inputs, _, _ = prefill_case([9, 2], [6, 11], (8, 2, 32), torch.float32, generator())
    q, k_pages, v_pages, table, starts, lens = inputs
    head_major = [pages.transpose(1, 2).contiguous().transpose(1, 2) for pages in (k_pages, v_pages)]
    assert not head_major[0].is_contiguous()
    want = tk.paged_prefill_attention(*inputs, max_query_len=11, sm_scale=0.2)
    assert torch.equal(tk.paged_prefill_attention(q, *head_major, table, starts, lens, 11, 0.2), want)
    assert _rel_err(want, reference.paged_prefill_attention(*inputs, sm_scale=0.2)) < 1e-5


def test_tiles_shrink_to_short_queries_and_stop_at_the_configured_rows():
    assert prefill_attention.tile_tokens(1, 4) == 4  # 16 rows, the smallest dot
    assert prefill_attention.tile_tokens(9, 4) == 16
    assert prefill_attention.tile_tokens(48, 4) == prefill_attention._BLOCK_M // 4
    assert prefill_attention.tile_tokens(3000, 1) == prefill_attention._BLOCK_M
    assert prefill_attention.tile_tokens(5, 32) == max(1, prefill_attention._BLOCK_M // 32)


def test_mismatched_inputs_are_refused():
    for name, args in mismatched_inputs().items():
        with pytest.raises(ValueError):
            tk.paged_prefill_attention(*args)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", HEADS[1:])
@pytest.mark.parametrize("min_split_keys", [8, 16])
def test_keys_split_over_programs_merge_to_the_reference(case, heads, min_split_keys, monkeypatch):
    """Few programs split the keys (some ranges empty, some wholly below a row's first key, the masked blocks in
    the last ones); the merged output is the reference's."""
    monkeypatch.setattr(prefill_attention, "_BLOCK_M", 16)
    monkeypatch.setattr(prefill_attention, "_BLOCK_N", 16)
    monkeypatch.setattr(prefill_attention, "_MIN_SPLIT_KEYS", min_split_keys)
    inputs, _, _ = prefill_case(*CASES[case], heads, torch.float32, generator())
    assert prefill_attention.plan_splits(8, inputs[3].shape[1] * 4, inputs[0].device) == 48 // min_split_keys
    want = reference.paged_prefill_attention(*inputs)
    got = tk.paged_prefill_attention(*inputs)
    assert _rel_err(got, want) < 1e-5


def test_splits_only_when_the_tiles_leave_sms_idle():
    cpu = torch.device("cpu")  # 132 SMs assumed
    assert prefill_attention.plan_splits(132, 1 << 20, cpu) == 1
    assert prefill_attention.plan_splits(16, 1 << 20, cpu) == 2 * 132 // 16 + 1
    assert prefill_attention.plan_splits(16, 4 * prefill_attention._MIN_SPLIT_KEYS, cpu) == 4
    assert prefill_attention.plan_splits(16, 100, cpu) == 1


@pytest.mark.parametrize("group, num_kv_heads, table_width", [(6, 2, 2048), (4, 8, 2048), (1, 32, 64), (8, 1, 64)])
def test_launch_shapes_reach_every_configuration_a_prefill_takes(group, num_kv_heads, table_width):
    """A server compiles the launches of launch_shapes at start: every (tile size, split) that any prefill (new
    tokens per sequence, sequences) can launch must be one of them, or it compiles inside a serving step."""
    device, block_g, max_keys = torch.device("cpu"), prefill_attention.next_pow2(group), table_width * 16

    def configuration(max_query_len: int, batch: int) -> tuple[int, bool]:
        tokens = prefill_attention.tile_tokens(max_query_len, block_g)
        programs = batch * -(-max_query_len // tokens) * num_kv_heads
        return tokens, prefill_attention.plan_splits(programs, max_keys, device) > 1

    shapes = prefill_attention.launch_shapes(group, num_kv_heads, max_keys, device)
    reached = {configuration(length, batch) for length in range(1, 4097) for batch in (1, 2, 3, 7, 33, 200)}
    assert reached <= {configuration(*shape) for shape in shapes}
    assert len(shapes) == len(set(map(lambda shape: configuration(*shape), shapes)))  # one launch each


def test_compiling_the_launches_reads_the_pools_and_writes_nothing_there():
    gen = generator()
    k_pages, v_pages = torch.randn(3, 16, 4, 32, generator=gen), torch.randn(3, 16, 4, 32, generator=gen)
    kept = k_pages.clone(), v_pages.clone()
    launches = tk.compile_prefill_launches(torch.float32, 8, k_pages, v_pages, 128)
    assert launches == len(prefill_attention.launch_shapes(2, 4, 128 * 16, k_pages.device)) > 0
    assert torch.equal(k_pages, kept[0]) and torch.equal(v_pages, kept[1])
