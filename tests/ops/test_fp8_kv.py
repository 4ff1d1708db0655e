"""An fp8 (e4m3) KV cache in the ops: the append rounds and saturates as torch's cast does and keeps fp8 bounds equal
to the stored keys' min and max (so Quest's page scores bound what attention multiplies); the Triton estimate, decode
and prefill attention read fp8 bounds and pages as the reference does: under the Triton interpreter on a CPU (CI), and
compiled on a CUDA GPU when run there without the interpreter (``pytest --noconftest tests/ops/test_fp8_kv.py``; the
compiled kernels convert e4m3 with instructions the interpreter cannot run)."""

from __future__ import annotations

import os

import pytest
import torch

from questkv import ops
from questkv.ops import fp8_codes, reference
from tests.ops.test_triton_ops import HEADS, _batch, _poison_unused, _readable, _rel_err

FP8 = torch.float8_e4m3fn
PAGE = 8


def kernel_device() -> torch.device:
    """Where the Triton kernels under test run: a CUDA GPU when there is one and Triton compiles, else the CPU (the
    interpreter)."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return torch.device("cuda" if torch.cuda.is_available() and not interpreting else "cpu")


def on_kernel_device(*tensors):
    """``tensors`` (``None`` kept) on :func:`kernel_device`."""
    return [None if t is None else t.to(kernel_device()) for t in tensors]


def saturated(x: torch.Tensor) -> torch.Tensor:
    """torch's cast to e4m3 of ``x`` clamped to ±448 first (torch's own cast saturates in some versions, 2.13, and gives
    NaN from ±464 on in others, 2.11)."""
    return x.clamp(-448, 448).to(FP8)


def fp8_pool(num_pages: int, heads: int, dim: int):
    """Empty fp8 pages and bounds, as an fp8 cache holds them (random bounds: a page's first write restarts them)."""
    shape = (num_pages, PAGE, heads, dim)
    return (torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8),
            torch.randn(num_pages, heads, dim).to(FP8), torch.randn(num_pages, heads, dim).to(FP8))


def test_order_codes_sort_as_the_values_and_invert():
    every = torch.arange(256, dtype=torch.uint8).view(FP8)
    every = every[~every.float().isnan()]
    codes = fp8_codes.fp8_order(every)
    assert len(set(codes.tolist())) == len(codes)  # distinct codes (-0 just below +0)
    ordered = every.float()[torch.argsort(codes.long())]
    assert bool((ordered[1:] >= ordered[:-1]).all())
    assert torch.equal(fp8_codes.fp8_from_order(codes).view(torch.uint8), every.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_append_stores_torchs_cast_and_bounds_equal_the_stored_keys(dtype):
    k_pages, v_pages, kmin, kmax = fp8_pool(6, 2, 16)
    lengths = [11, 5]
    keys = (torch.randn(sum(lengths), 2, 16) * 40).to(dtype)  # some beyond ±448: saturated
    keys[0, 0, 0] = 1000.0
    values = torch.randn(sum(lengths), 2, 16).to(dtype)
    pages = [[3, 0], [5]]
    slots = torch.tensor([pages[row][pos // PAGE] * PAGE + pos % PAGE
                          for row, n in enumerate(lengths) for pos in range(n)])
    ops.append_kv(k_pages, v_pages, kmin, kmax, slots[:7], keys[:7], values[:7])  # in two steps: bounds widen
    ops.append_kv(k_pages, v_pages, kmin, kmax, slots[7:], keys[7:], values[7:])
    stored = k_pages.flatten(0, 1)[slots]
    assert torch.equal(stored.float(), saturated(keys).float()) and stored[0, 0, 0].float() == 448.0
    assert torch.equal(v_pages.flatten(0, 1)[slots].float(), saturated(values).float())
    for page, count in ((3, 8), (0, 3), (5, 5)):
        held = k_pages[page, :count].float()
        assert torch.equal(kmin[page].float(), held.amin(0)) and torch.equal(kmax[page].float(), held.amax(0))


def test_a_page_restarted_by_a_new_owner_drops_its_old_bounds():
    k_pages, v_pages, kmin, kmax = fp8_pool(2, 1, 8)
    slot = torch.tensor([PAGE])  # page 1, offset 0
    ops.append_kv(k_pages, v_pages, kmin, kmax, slot, torch.full((1, 1, 8), 100.0), torch.ones(1, 1, 8))
    fresh = torch.randn(1, 1, 8)
    ops.append_kv(k_pages, v_pages, kmin, kmax, slot, fresh, torch.ones(1, 1, 8))
    assert torch.equal(kmax[1].float(), fresh.to(FP8).float()[0]) and torch.equal(kmin[1].float(), kmax[1].float())


def test_recomputed_bounds_of_fp8_pages_equal_their_kept_keys():
    k_pages = (torch.randn(2, 4, PAGE, 2, 8) * 5).to(FP8)  # [layers, pages, page_size, heads, dim]
    kmin, kmax = torch.zeros(2, 4, 2, 8).to(FP8), torch.zeros(2, 4, 2, 8).to(FP8)
    reference.recompute_key_bounds(k_pages, kmin, kmax, torch.tensor([1, 3]), torch.tensor([5, PAGE]))
    assert torch.equal(kmin[:, 1].float(), k_pages[:, 1, :5].float().amin(1))
    assert torch.equal(kmax[:, 3].float(), k_pages[:, 3].float().amax(1))


def test_page_scores_from_fp8_bounds_bound_every_dequantized_key():
    k_pages, v_pages, kmin, kmax = fp8_pool(8, 2, 16)
    slots = torch.arange(8 * PAGE)
    ops.append_kv(k_pages, v_pages, kmin, kmax, slots, torch.randn(len(slots), 2, 16) * 3, torch.randn(len(slots), 2, 16))
    q = torch.randn(3, 4, 16).to(torch.bfloat16)
    table = torch.stack([torch.randperm(8)[:6] for _ in range(3)]).int()
    lens = torch.tensor([48, 30, 7], dtype=torch.int32)
    scores = reference.page_scores(q, kmin, kmax, table, lens, PAGE, "q_head")  # [3, 4, 6]
    assert kmin.dtype == FP8
    for row in range(3):
        for col in range(-(-int(lens[row]) // PAGE)):
            keys = k_pages[table[row, col]].float()  # [PAGE, Hkv, D]: what attention multiplies
            for head in range(4):
                best = (keys[:, head // 2] @ q[row, head].float()).max()
                assert scores[row, head, col] >= best - 1e-4


pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("selection, num_queries, budgets", [("kv_head", 1, False), ("q_head", 1, False),
                                                                ("kv_head", 1, True), (None, 1, False),
                                                                (None, 5, False)])
def test_triton_decode_attention_reads_fp8_pages_as_the_reference(dtype, heads, selection, num_queries, budgets):
    """One query per sequence (Quest's pages per KV or per query head, rows' budgets below the step's, or every
    page: scores in e4m3 dots) and a lossless verify's five (dense, causal among them: float16 dots)."""
    from questkv.ops import triton as tk

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    num_q, num_kv, dim = heads
    lens, max_pages, num_pages = [115, 21], 8, 19
    shape = (num_pages, 16, num_kv, dim)
    k_pages, v_pages = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    table, seq_lens = _batch(lens, 16, num_pages, max_pages, gen)
    _poison_unused(k_pages, v_pages, table, seq_lens, 16)  # (NaN stays NaN in e4m3)
    k_pages, v_pages = k_pages.to(FP8), v_pages.to(FP8)
    q = torch.randn(len(lens), *([num_queries] if num_queries > 1 else []), num_q, dim, generator=gen).to(dtype)
    selected = row_budgets = None
    if selection is not None:
        scores = torch.randn(2, num_kv if selection == "kv_head" else num_q, max_pages, generator=gen)
        selected = reference.select_pages(scores, seq_lens, 16, 4, 0, 0)
    if budgets:  # the first row's budget reads 2 of its 4 columns
        row_budgets = torch.tensor([32, 64], dtype=torch.int32)
    want = reference.paged_decode_attention(q, k_pages, v_pages, _readable(table), seq_lens, selected, None,
                                            row_budgets)
    got = tk.paged_decode_attention(*on_kernel_device(q, k_pages, v_pages, table, seq_lens, selected), None,
                                    *on_kernel_device(row_budgets)).cpu()
    assert got.dtype == dtype and _rel_err(got, want) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_prefill_attention_reads_fp8_pages_as_the_reference(dtype):
    from questkv.ops import triton as tk
    from tests.ops.test_prefill_attention import prefill_case

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    (q, k_pages, v_pages, table, starts, lens), _, _ = prefill_case([13, 0, 40], [5, 9, 3], (8, 2, 32), dtype, gen)
    k_pages, v_pages = k_pages.to(FP8), v_pages.to(FP8)
    want = reference.paged_prefill_attention(q, k_pages, v_pages, _readable(table), starts, lens)
    got = tk.paged_prefill_attention(*on_kernel_device(q, k_pages, v_pages, table, starts, lens)).cpu()
    assert got.dtype == dtype and _rel_err(got, want) < 1e-2


@pytest.mark.parametrize("selection", ["kv_head", "q_head"])
def test_triton_page_scores_read_fp8_bounds_as_the_reference(selection):
    from questkv.ops import triton as tk

    k_pages, v_pages, kmin, kmax = fp8_pool(12, 2, 32)
    slots = torch.arange(12 * PAGE)
    ops.append_kv(k_pages, v_pages, kmin, kmax, slots, torch.randn(len(slots), 2, 32) * 4,
                  torch.randn(len(slots), 2, 32))
    q = torch.randn(2, 8, 32).to(torch.bfloat16)
    table = torch.stack([torch.randperm(12)[:10] for _ in range(2)]).int()
    lens = torch.tensor([75, 33], dtype=torch.int32)
    want = reference.page_scores(q, kmin, kmax, table, lens, PAGE, selection)
    got = tk.page_scores(*on_kernel_device(q, kmin, kmax, table, lens), PAGE, selection).cpu()
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)) and _rel_err(got[finite], want[finite]) < 1e-5


def _bytes(tensors) -> list[torch.Tensor]:
    return [t.view(torch.uint8) for t in tensors]


def test_triton_append_rounds_every_bf16_value_as_torchs_cast():
    """Every finite bfloat16 value (ties, subnormals, ±0, past ±448) through the Triton append into fp8 pages:
    each stored byte is torch's cast's and each page's bounds the reference's, bit for bit (the interpreter's kernel rounds
    with integer and exact float32 arithmetic, the compiled one with the hardware's conversion)."""
    from questkv.ops import triton as tk

    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every)]
    every = every[torch.randperm(len(every))]  # pages of mixed magnitudes and signs
    heads, dim = 2, 32
    tokens = len(every) // (heads * dim)
    keys = every[:tokens * heads * dim].view(tokens, heads, dim)
    values = keys.flip(0)
    pools = fp8_pool(-(-tokens // PAGE) + 1, heads, dim)
    want, got = [t.clone() for t in pools], on_kernel_device(*pools)
    slots = torch.arange(PAGE, PAGE + tokens)  # (page 0 keeps its random bounds)
    reference.append_kv(*want, slots, keys, values)
    tk.append_kv(*got, *on_kernel_device(slots.int(), keys, values))
    got = [t.cpu() for t in got]
    assert torch.equal(got[0].view(torch.uint8).flatten(0, 1)[slots], saturated(keys).view(torch.uint8))
    for got_pool, want_pool in zip(_bytes(got), _bytes(want)):
        assert torch.equal(got_pool, want_pool)


# (the interpreter rounds float32 -> bf16 toward zero, so a bf16 rotation is not the reference's there)
@pytest.mark.parametrize("dtype, rope", [(torch.bfloat16, False), (torch.float16, False), (torch.float16, True),
                                         (torch.float32, True)])
def test_triton_append_into_fp8_pages_equals_the_reference(dtype, rope):
    """The Triton append (with RoPE folded in, or not) into fp8 pages equals the reference byte for byte: a prefill
    run that starts a page and ends mid-page, a decode token widening a half-full page (its fp8 bounds read back),
    and a reused page restarted at offset 0; keys over many magnitudes, some past ±448."""
    from questkv.ops import triton as tk

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    heads, num_q, dim = 2, 4, 16
    pools = fp8_pool(6, heads, dim)
    reference.append_kv(*pools, torch.arange(4 * PAGE, 4 * PAGE + 5), torch.randn(5, heads, dim, generator=gen),
                        torch.randn(5, heads, dim, generator=gen))  # page 4 half full before the step
    slots = torch.cat([torch.arange(2 * PAGE, 2 * PAGE + 13), torch.tensor([4 * PAGE + 5]), torch.arange(0, 3)])
    tokens = len(slots)
    scale = 2.0 ** torch.randint(-12, 10, (tokens, num_q + heads, dim), generator=gen)
    qk = (torch.randn(tokens, num_q + heads, dim, generator=gen) * scale).to(dtype)
    values = (torch.randn(tokens, heads, dim, generator=gen) * 30).to(dtype)
    want, got = [t.clone() for t in pools], on_kernel_device(*pools)
    if rope:
        angles = torch.rand(tokens, dim // 2, generator=gen) * 100.0
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        q_want, k_want, q_got, k_got = (part.clone() for part in (*qk.split([num_q, heads], 1),) * 2)
        reference.rope_append_kv(*want, slots, q_want, k_want, values, cos, sin)
        q_got, k_got = on_kernel_device(q_got, k_got)
        tk.rope_append_kv(*got, *on_kernel_device(slots.int()), q_got, k_got, *on_kernel_device(values, cos, sin))
        assert torch.equal(q_got.cpu(), q_want) and torch.equal(k_got.cpu(), k_want)
    else:
        keys = qk[:, num_q:].contiguous()
        reference.append_kv(*want, slots, keys, values)
        tk.append_kv(*got, *on_kernel_device(slots.int(), keys, values))
    got = [t.cpu() for t in got]
    for got_pool, want_pool in zip(_bytes(got), _bytes(want)):
        assert torch.equal(got_pool, want_pool)


def test_fp8_values_of_an_odd_head_dim_are_refused_before_a_launch():
    """The attention reads fp8 values in pairs of channels: an odd head_dim is a ValueError naming the shape."""
    from questkv.ops import triton as tk

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    shape = (3, 16, 1, 15)
    k_pages, v_pages = (torch.randn(shape, generator=gen).to(FP8) for _ in range(2))
    q = torch.randn(1, 2, 15, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="even head_dim"):
        tk.paged_decode_attention(q, k_pages, v_pages, torch.tensor([[0, 1]], dtype=torch.int32),
                                  torch.tensor([20], dtype=torch.int32))
