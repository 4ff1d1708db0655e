"""Low-bit key codes (encode_page_keys, page_scores_codes, both reranks): Triton (interpreter) == reference,
the reference == QuestRerankPolicy's key_bits estimator, the codes' scores converge to the exact max logit, and
the mass rerank finds a page that holds the mass without the best logit.

Every test draws fresh random inputs (never zeros); shapes stay tiny (the interpreter is slow).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from questkv import ops  # noqa: E402
from questkv.ops import LayerPages, reference  # noqa: E402
from questkv.ops import triton as tk  # noqa: E402
from questkv.ops.triton import codes as codes_kernels  # noqa: E402
from questkv.policies.paged import QuestRerankPolicy, quantize_within_bounds  # noqa: E402

BITS = [1, 2, 4, 8]
HEADS = [(8, 2, 32), (4, 4, 64)]  # (num_q_heads, num_kv_heads, head_dim): GQA 8/2 and MHA 4/4
MASS_HEADS = HEADS + [(8, 1, 32)]  # and MQA 8/1
MODES = [("kv_head", "sum"), ("kv_head", "max"), ("q_head", "sum")]
PAD = 10**6  # page-table padding: never read


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _case(heads, lens, page_size, max_pages, dtype, gen):
    """Random keys, their page bounds (a few zero-width channels), a page table with distinct random
    pages per row and out-of-range padding, and one query per sequence."""
    num_q, num_kv, head_dim = heads
    num_pages = 2 * max_pages + 3
    k_pages = torch.randn(num_pages, page_size, num_kv, head_dim, generator=gen).to(dtype)
    flat = torch.rand(num_pages, num_kv, head_dim, generator=gen) < 0.05  # channels constant over the page
    k_pages = torch.where(flat[:, None], k_pages[:, :1], k_pages)
    kmin, kmax = k_pages.amin(1), k_pages.amax(1)
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(lens), max_pages), PAD, dtype=torch.int32)
    used = 0
    for row, length in enumerate(lens):
        n = -(-length // page_size)
        table[row, :n] = perm[used : used + n].int()
        used += n
    q = torch.randn(len(lens), num_q, head_dim, generator=gen).to(dtype)
    return q, k_pages, kmin, kmax, table, torch.tensor(lens, dtype=torch.int32)


def _readable(table):
    return torch.where(table >= PAD, 0, table)


def _random_codes(num_pages, page_size, num_kv, head_dim, bits, gen):
    """Garbage codes (what a page holds before it is encoded)."""
    shape = (num_pages, page_size, num_kv, head_dim * bits // 8)
    return torch.randint(0, 256, shape, generator=gen).to(torch.uint8)


def _full_pages(table, lens, page_size):
    """Physical pages of every full page of the batch (int32)."""
    pages = [table[row, : int(length) // page_size] for row, length in enumerate(lens.tolist())]
    return torch.cat(pages).int()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_page_keys_matches_reference(bits, heads, dtype):
    """Codes bit for bit, only the given pages written; a partial page with NaN in its unwritten slots
    (code 0 there) and zero-width channels included."""
    gen = _gen()
    num_q, num_kv, head_dim = heads
    page_size = 16
    _, k_pages, _, _, _, _ = _case(heads, [40], page_size, 4, dtype, gen)
    k_pages[3, 9:] = float("nan")  # page 3 holds 9 tokens
    live = torch.where(k_pages.isnan(), float("inf"), k_pages.float())
    kmin = live.amin(1).to(dtype)
    kmax = torch.where(k_pages.isnan(), float("-inf"), k_pages.float()).amax(1).to(dtype)
    pages = torch.tensor([5, 3, 0, 7], dtype=torch.int32)
    start = _random_codes(k_pages.shape[0], page_size, num_kv, head_dim, bits, gen)
    want, got = start.clone(), start.clone()
    reference.encode_page_keys(want, k_pages, kmin, kmax, pages, bits)
    tk.encode_page_keys(got, k_pages, kmin, kmax, pages, bits)
    assert torch.equal(got, want)
    untouched = torch.ones(k_pages.shape[0], dtype=torch.bool)
    untouched[pages.long()] = False
    assert torch.equal(got[untouched], start[untouched])
    assert not want[3, 9:].any()  # NaN slots: code 0
    # through the dispatch point (CPU: the reference; forced: the kernel)
    auto, forced = start.clone(), start.clone()
    ops.encode_page_keys(auto, k_pages, kmin, kmax, pages, bits)
    ops.encode_page_keys(forced, k_pages, kmin, kmax, pages, bits, backend="triton")
    assert torch.equal(auto, want) and torch.equal(forced, want)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("page_size", [16, 4])
def test_reference_decoded_keys_equal_quantize_within_bounds(bits, page_size):
    """The layout round trip (pack / unpack) and the decoded keys: exactly the policy's quantizer."""
    gen = _gen()
    _, k_pages, kmin, kmax, _, _ = _case((8, 2, 32), [4 * page_size], page_size, 4, torch.bfloat16, gen)
    pages = torch.randperm(k_pages.shape[0], generator=gen)[:5].int()
    codes = _random_codes(k_pages.shape[0], page_size, 2, 32, bits, gen)
    reference.encode_page_keys(codes, k_pages, kmin, kmax, pages, bits)
    index = pages.long()
    decoded = reference.decode_key_codes(codes[index], kmin[index], kmax[index], bits)
    assert torch.equal(decoded, quantize_within_bounds(k_pages[index], kmin[index], kmax[index], bits))
    cells = reference.unpack_key_codes(codes[index], bits)
    assert cells.shape[-1] == 32 and int(cells.max()) < 2**bits
    assert torch.equal(reference.pack_key_codes(cells, bits), codes[index])
    # element d sits in byte d * bits // 8 at bit (d * bits) % 8
    d = torch.arange(32)
    byte = codes[index][..., d * bits // 8].to(torch.int32)
    assert torch.equal((byte >> (d * bits % 8)) & (2**bits - 1), cells)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("selection,reduction", MODES)
@pytest.mark.parametrize("dtype,page_size,block_p,per_program", [(torch.float32, 16, 4, 2), (torch.bfloat16, 8, 1, 3)])
def test_page_scores_codes_matches_reference(bits, heads, selection, reduction, dtype, page_size, block_p, per_program,
                                             monkeypatch):
    """Ragged lengths (a partial last page, a one-token sequence, a row of full pages), padding in the page
    table, several programs per row, each looping over several blocks (10 pages: blocks of 4 pages, 2 a
    program, the last block past the table; or of 1 page, 3 a program, the last program with 1); -inf past
    each sequence; scores to 1e-5 (float32 math)."""
    monkeypatch.setattr(codes_kernels, "_BLOCK_P", block_p)
    monkeypatch.setattr(codes_kernels, "_BLOCKS_PER_PROGRAM", per_program)
    monkeypatch.setattr(codes_kernels, "_MIN_PROGRAMS_PER_SM", 0)
    gen = _gen()
    num_q, num_kv, head_dim = heads
    max_pages = 10
    lens = [page_size * 9 + 5, 1, page_size * 4]
    q, k_pages, kmin, kmax, table, seq_lens = _case(heads, lens, page_size, max_pages, dtype, gen)
    codes = _random_codes(k_pages.shape[0], page_size, num_kv, head_dim, bits, gen)
    reference.encode_page_keys(codes, k_pages, kmin, kmax, _full_pages(table, seq_lens, page_size), bits)
    want = reference.page_scores_codes(q, codes, kmin, kmax, _readable(table), seq_lens, page_size, bits, selection,
                                       reduction)
    got = tk.page_scores_codes(q, codes, kmin, kmax, table, seq_lens, page_size, bits, selection, reduction)
    sel_heads = num_q if selection == "q_head" else num_kv
    assert got.shape == want.shape == (3, sel_heads, max_pages) and got.dtype == torch.float32
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    assert torch.isneginf(want[1, :, 1:]).all() and torch.isfinite(want[0, :, :10]).all()
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)
    # the *_into forms and the dispatch point
    out = torch.full_like(want, float("nan"))
    assert tk.page_scores_codes_into(out, q, codes, kmin, kmax, table, seq_lens, page_size, bits, selection,
                                     reduction) is out
    assert torch.equal(out, got)
    ref_out = torch.full_like(want, float("nan"))
    reference.page_scores_codes_into(ref_out, q, codes, kmin, kmax, _readable(table), seq_lens, page_size, bits,
                                     selection, reduction)
    assert torch.equal(ref_out, want)
    assert torch.equal(ops.page_scores_codes(q, codes, kmin, kmax, _readable(table), seq_lens, page_size, bits,
                                             selection, reduction), want)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("heads", HEADS)
def test_page_scores_codes_two_term_dot_matches_reference(bits, heads, monkeypatch):
    """The GPU path for 16-bit queries (each decoded key as two 16-bit dot operands), run under the
    interpreter with float16 (whose dot the interpreter computes correctly, unlike bf16's)."""
    monkeypatch.setattr(codes_kernels, "interpreting", lambda: False)
    gen = _gen()
    num_q, num_kv, head_dim = heads
    page_size, max_pages = 16, 6
    q, k_pages, kmin, kmax, table, seq_lens = _case(heads, [page_size * 5 + 9, 20], page_size, max_pages,
                                                    torch.float16, gen)
    codes = _random_codes(k_pages.shape[0], page_size, num_kv, head_dim, bits, gen)
    reference.encode_page_keys(codes, k_pages, kmin, kmax, torch.unique(_readable(table)).int(), bits)
    want = reference.page_scores_codes(q, codes, kmin, kmax, _readable(table), seq_lens, page_size, bits)
    got = tk.page_scores_codes(q, codes, kmin, kmax, table, seq_lens, page_size, bits)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    err = ((got[finite] - want[finite]).double().norm() / want[finite].double().norm()).item()
    assert err < 1e-5, err


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("pad", [1, 2])
def test_page_scores_codes_unaligned_codes(bits, pad):
    """Codes whose rows are not 4-byte aligned (a view of wider rows) are read in 1- or 2-byte words, with the
    same scores, bit for bit, as contiguous codes (read in 4-byte words)."""
    gen = _gen()
    heads = (8, 2, 32)
    page_size, max_pages = 16, 5
    q, k_pages, kmin, kmax, table, seq_lens = _case(heads, [page_size * 4 + 3, 9], page_size, max_pages,
                                                    torch.float32, gen)
    nbytes = reference.key_code_bytes(heads[2], bits)
    wide = _random_codes(k_pages.shape[0], page_size, heads[1], 8 * (nbytes + pad) // bits, bits, gen)
    codes = wide[..., :nbytes]
    reference.encode_page_keys(codes, k_pages, kmin, kmax, torch.unique(_readable(table)).int(), bits)
    assert codes_kernels._code_unit(codes, nbytes) == pad and codes_kernels._code_unit(codes.contiguous(), nbytes) == 4
    want = reference.page_scores_codes(q, codes, kmin, kmax, _readable(table), seq_lens, page_size, bits)
    got = tk.page_scores_codes(q, codes, kmin, kmax, table, seq_lens, page_size, bits)
    assert torch.equal(got, tk.page_scores_codes(q, codes.contiguous(), kmin, kmax, table, seq_lens, page_size, bits))
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("selection,reduction", MODES)
def test_codes_selection_equals_quest_rerank_policy(bits, heads, selection, reduction):
    """With the codes of every full page written, page_scores_codes + select_pages selects what
    QuestRerankPolicy(key_bits=bits, shortlist covering every page, rerank="max") selects (the current,
    partial page's codes are garbage here: it is always selected)."""
    gen = _gen()
    num_q, num_kv, head_dim = heads
    page_size, max_pages, budget_pages = 16, 12, 5
    lens = [page_size * 11 + 7, page_size * 8, page_size * 3 + 1]  # partial, exactly full, shorter than the budget
    q, k_pages, kmin, kmax, table, seq_lens = _case(heads, lens, page_size, max_pages, torch.float32, gen)
    readable = _readable(table)
    codes = _random_codes(k_pages.shape[0], page_size, num_kv, head_dim, bits, gen)
    ops.encode_page_keys(codes, k_pages, kmin, kmax, _full_pages(table, seq_lens, page_size), bits)
    policy = QuestRerankPolicy(budget_pages * page_size, page_size, shortlist=max_pages, rerank="max", key_bits=bits,
                               selection=selection, group_reduction=reduction, sink_pages=1, recent_pages=1)
    want = policy.select(q, LayerPages(k_pages, k_pages, kmin, kmax), readable, seq_lens).pages
    for scores in (reference.page_scores_codes(q, codes, kmin, kmax, readable, seq_lens, page_size, bits, selection, reduction),
                   tk.page_scores_codes(q, codes, kmin, kmax, table, seq_lens, page_size, bits, selection, reduction)):
        got = reference.select_pages(scores, seq_lens, page_size, budget_pages, 1, 1)
        assert torch.equal(got, want)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("selection,reduction", MODES)
def test_code_scores_approach_exact_max_logit(heads, selection, reduction):
    """The error against the exact max logit (float32 keys) shrinks with the width; 8 bits is within 1%."""
    gen = _gen()
    num_q, num_kv, head_dim = heads
    page_size, max_pages = 16, 8
    lens = [page_size * 7 + 3, page_size * 5]
    q, k_pages, kmin, kmax, table, seq_lens = _case(heads, lens, page_size, max_pages, torch.float32, gen)
    readable = _readable(table)
    batch = len(lens)
    keys = k_pages[readable.long()]  # [B, P, ps, Hkv, D]
    logits = torch.einsum("bkgd,bptkd->bkgpt", q.view(batch, num_kv, num_q // num_kv, head_dim), keys)
    written = torch.arange(max_pages * page_size).view(max_pages, page_size)[None] < seq_lens[:, None, None]
    per_q = logits.reshape(batch, num_q, max_pages, page_size).masked_fill(~written[:, None], float("-inf")).amax(-1)
    if selection == "kv_head":
        grouped = per_q.view(batch, num_kv, num_q // num_kv, max_pages)
        per_q = grouped.sum(2) if reduction == "sum" else grouped.amax(2)
    exact = per_q.masked_fill(~reference.valid_pages(seq_lens, page_size, max_pages)[:, None], float("-inf"))
    finite = torch.isfinite(exact)
    errors = {}
    for bits in BITS:
        codes = _random_codes(k_pages.shape[0], page_size, num_kv, head_dim, bits, gen)
        reference.encode_page_keys(codes, k_pages, kmin, kmax, torch.unique(readable).int(), bits)
        got = tk.page_scores_codes(q, codes, kmin, kmax, table, seq_lens, page_size, bits, selection, reduction)
        assert torch.equal(torch.isfinite(got), finite)
        errors[bits] = ((got[finite] - exact[finite]).norm() / exact[finite].norm()).item()
    assert errors[1] > errors[2] > errors[4] > errors[8], errors
    assert errors[8] < 1e-2, errors


@pytest.mark.parametrize("backend", [reference, tk])
def test_key_codes_reject_bad_arguments(backend):
    gen = _gen()
    q, k_pages, kmin, kmax, table, lens = _case((8, 2, 32), [40], 16, 4, torch.float32, gen)
    codes = _random_codes(k_pages.shape[0], 16, 2, 32, 2, gen)
    pages = torch.tensor([0, 1], dtype=torch.int32)
    table = _readable(table)
    with pytest.raises(ValueError, match="bits"):
        backend.encode_page_keys(codes, k_pages, kmin, kmax, pages, 3)
    with pytest.raises(ValueError, match="codes"):
        backend.encode_page_keys(codes, k_pages, kmin, kmax, pages, 4)  # 8 bytes per key needed, 16 given
    with pytest.raises(ValueError, match="uint8"):
        backend.encode_page_keys(codes.to(torch.int32), k_pages, kmin, kmax, pages, 2)
    with pytest.raises(ValueError, match="pages"):
        backend.encode_page_keys(codes, k_pages, kmin, kmax, pages[None], 2)
    with pytest.raises(ValueError, match="head_dim"):
        small = torch.randn(3, 16, 2, 4, generator=gen)
        backend.encode_page_keys(torch.ones(3, 16, 2, 1, dtype=torch.uint8), small, small.amin(1), small.amax(1), pages, 1)
    with pytest.raises(ValueError, match="codes"):
        backend.page_scores_codes(q, codes[:, :8], kmin, kmax, table, lens, 16, 2)
    with pytest.raises(ValueError, match="selection"):
        backend.page_scores_codes(q, codes, kmin, kmax, table, lens, 16, 2, "head")
    with pytest.raises(ValueError, match="group_reduction"):
        backend.page_scores_codes(q, codes, kmin, kmax, table, lens, 16, 2, "kv_head", "mean")
    with pytest.raises(ValueError, match="multiple"):
        backend.page_scores_codes(q[:, :7], codes, kmin, kmax, table, lens, 16, 2)
    with pytest.raises(ValueError, match=r"rerank must be one of \('max', 'mass'\), got 'sum'"):
        backend.page_scores_codes(q, codes, kmin, kmax, table, lens, 16, 2, "kv_head", "sum", "sum")
    with pytest.raises(ValueError, match="sm_scale"):
        backend.page_scores_codes(q, codes, kmin, kmax, table, lens, 16, 2, "kv_head", "sum", "mass", -1.0)


# ----------------------------------------------------------------------------------------------
# rerank="mass"


@pytest.mark.parametrize("bits", [2, 8])  # the max-mode tests cover every width's decoding; the interpreter is slow
@pytest.mark.parametrize("heads", MASS_HEADS)
@pytest.mark.parametrize("selection,reduction", MODES)
def test_page_scores_codes_mass_matches_reference(bits, heads, selection, reduction, monkeypatch):
    """rerank="mass": ragged lengths (a partial last page, a one-token sequence, a row of full pages), padding
    in the page table, several programs per row looping over several blocks; -inf past each sequence, every
    query head's masses summing to 1 over its pages; masses to 1e-5; the *_into forms and the dispatch point."""
    monkeypatch.setattr(codes_kernels, "_BLOCK_P", 4)
    monkeypatch.setattr(codes_kernels, "_BLOCKS_PER_PROGRAM", 2)
    monkeypatch.setattr(codes_kernels, "_MIN_PROGRAMS_PER_SM", 0)
    gen = _gen()
    num_q, num_kv, head_dim = heads
    page_size, max_pages = 16, 10
    lens = [page_size * 9 + 5, 1, page_size * 4]
    q, k_pages, kmin, kmax, table, seq_lens = _case(heads, lens, page_size, max_pages, torch.float32, gen)
    q = q * 4  # logits of a few units: masses far from uniform
    codes = _random_codes(k_pages.shape[0], page_size, num_kv, head_dim, bits, gen)
    reference.encode_page_keys(codes, k_pages, kmin, kmax, _full_pages(table, seq_lens, page_size), bits)
    args = (q, codes, kmin, kmax, _readable(table), seq_lens, page_size, bits, selection, reduction, "mass")
    want = reference.page_scores_codes(*args)
    got = tk.page_scores_codes(q, codes, kmin, kmax, table, *args[5:])
    sel_heads = num_q if selection == "q_head" else num_kv
    assert got.shape == want.shape == (3, sel_heads, max_pages) and got.dtype == torch.float32
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    assert torch.equal(torch.isneginf(want), ~reference.valid_pages(seq_lens, page_size, max_pages)[:, None].expand_as(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)
    if selection == "q_head" or reduction == "sum":
        per_head = 1 if selection == "q_head" else num_q // num_kv
        masses = want.masked_fill(~finite, 0.0).sum(-1)
        torch.testing.assert_close(masses, torch.full_like(masses, float(per_head)))
    out = torch.full_like(want, float("nan"))
    assert tk.page_scores_codes_into(out, q, codes, kmin, kmax, table, *args[5:]) is out
    assert torch.equal(out, got)
    ref_out = torch.full_like(want, float("nan"))
    assert reference.page_scores_codes_into(ref_out, *args) is ref_out and torch.equal(ref_out, want)
    assert torch.equal(ops.page_scores_codes(*args), want)
    # an explicit softmax scale reaches both backends; at scale 1 the logits reach hundreds, and a float32 rounding
    # of a logit L (the two backends sum its products in different orders) moves its exp by about L * 2^-24
    sharp = reference.page_scores_codes(*args, sm_scale=1.0)
    assert not torch.allclose(sharp[finite], want[finite])
    logits = reference.page_scores_codes(*args[:10], "max", sm_scale=1.0)
    rtol = max(1e-5, 16 * logits[torch.isfinite(logits)].abs().max().item() * 2.0 ** -24)
    torch.testing.assert_close(tk.page_scores_codes(q, codes, kmin, kmax, table, *args[5:], sm_scale=1.0)[finite],
                               sharp[finite], rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("bits", [2, 8])
@pytest.mark.parametrize("selection,reduction", MODES)
def test_page_scores_codes_mass_16_bit_paths_match_reference(bits, selection, reduction, monkeypatch):
    """rerank="mass" with bfloat16 pools and pages of 8 (float32 dots under the interpreter), one page per
    block and three blocks per program; and the two-term 16-bit dot path (float16 under the interpreter)."""
    monkeypatch.setattr(codes_kernels, "_BLOCK_P", 1)
    monkeypatch.setattr(codes_kernels, "_BLOCKS_PER_PROGRAM", 3)
    monkeypatch.setattr(codes_kernels, "_MIN_PROGRAMS_PER_SM", 0)
    gen = _gen()
    heads = (8, 2, 32)
    page_size, max_pages = 8, 7
    for dtype, interpreting in ((torch.bfloat16, True), (torch.float16, False)):
        monkeypatch.setattr(codes_kernels, "interpreting", lambda: interpreting)
        q, k_pages, kmin, kmax, table, seq_lens = _case(heads, [page_size * 6 + 3, 11], page_size, max_pages, dtype,
                                                        gen)
        codes = _random_codes(k_pages.shape[0], page_size, heads[1], heads[2], bits, gen)
        reference.encode_page_keys(codes, k_pages, kmin, kmax, torch.unique(_readable(table)).int(), bits)
        want = reference.page_scores_codes(q, codes, kmin, kmax, _readable(table), seq_lens, page_size, bits,
                                           selection, reduction, "mass")
        got = tk.page_scores_codes(q, codes, kmin, kmax, table, seq_lens, page_size, bits, selection, reduction,
                                   "mass")
        assert torch.equal(torch.isneginf(got), torch.isneginf(want))
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("heads", [(8, 2, 32), (8, 1, 32)])
@pytest.mark.parametrize("selection,reduction", MODES)
def test_codes_mass_equals_quest_rerank_policy_mass(bits, heads, selection, reduction):
    """page_scores_codes(rerank="mass") == QuestRerankPolicy(rerank="mass", key_bits=bits).rerank_scores with
    the shortlist covering every page, exactly (the reference) and to 1e-5 (Triton), and the same selection.
    Every page's codes are written from its final bounds: under "mass" a stale current page would also change
    each query head's normalisation (see page_scores_codes)."""
    gen = _gen()
    num_q, num_kv, head_dim = heads
    page_size, max_pages, budget_pages = 16, 12, 5
    lens = [page_size * 11 + 7, page_size * 8, page_size * 3 + 1]  # partial, exactly full, shorter than the budget
    q, k_pages, kmin, kmax, table, seq_lens = _case(heads, lens, page_size, max_pages, torch.float32, gen)
    q = q * 4
    readable = _readable(table)
    codes = _random_codes(k_pages.shape[0], page_size, num_kv, head_dim, bits, gen)
    ops.encode_page_keys(codes, k_pages, kmin, kmax, torch.unique(readable).int(), bits)
    sm_scale = [None, 0.5][int(torch.randint(0, 2, (1,), generator=gen))]
    policy = QuestRerankPolicy(budget_pages * page_size, page_size, shortlist=max_pages, rerank="mass", key_bits=bits,
                               selection=selection, group_reduction=reduction, sink_pages=1, recent_pages=1)
    layer = LayerPages(k_pages, k_pages, kmin, kmax)
    sel_heads = num_q if selection == "q_head" else num_kv
    valid = reference.valid_pages(seq_lens, page_size, max_pages)[:, None].expand(len(lens), sel_heads, max_pages)
    want = policy.rerank_scores(q, layer, readable, seq_lens, valid, sm_scale)
    ref = reference.page_scores_codes(q, codes, kmin, kmax, readable, seq_lens, page_size, bits, selection, reduction,
                                      "mass", sm_scale)
    assert torch.equal(ref, want)
    got = tk.page_scores_codes(q, codes, kmin, kmax, table, seq_lens, page_size, bits, selection, reduction, "mass",
                               sm_scale)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-5)
    pages = policy.select(q, layer, readable, seq_lens, sm_scale).pages
    assert torch.equal(reference.select_pages(ref, seq_lens, page_size, budget_pages, 1, 1), pages)


@pytest.mark.parametrize("backend", [reference, tk])
@pytest.mark.parametrize("selection,reduction", MODES)
def test_mass_ranks_first_the_page_holding_the_mass_without_the_best_logit(backend, selection, reduction):
    """Page 0 holds the best logit (one key at ~6, the rest at -10), page 1 the mass (eight keys at 5:
    8 e^5 > e^6 at sm_scale 1), page 2 little of either, page 3 is the current page: "mass" ranks page 1
    first and selects it with a budget of two pages, "max" ranks page 0 first and selects that."""
    gen = _gen()
    num_q, num_kv, head_dim, page_size, bits = 2, 1, 16, 8, 8
    noise = 0.01
    perm = torch.randperm(5, generator=gen)[:4].int()  # logical page j is physical page perm[j]
    k_pages = torch.randn(5, page_size, num_kv, head_dim, generator=gen)
    k_pages[:, :, :, 0] = -10.0
    k_pages[perm[0], 3, :, 0] = 6.0
    k_pages[perm[1], :, :, 0] = 5.0
    k_pages[perm[2], :, :, 0] = torch.rand(page_size, num_kv, generator=gen) - 2.0
    kmin, kmax = k_pages.amin(1), k_pages.amax(1)
    q = noise * torch.randn(1, num_q, head_dim, generator=gen)
    q[:, :, 0] = 1.0 + noise * torch.rand(1, num_q, generator=gen)
    table, seq_lens = perm[None], torch.tensor([3 * page_size + 2], dtype=torch.int32)
    codes = _random_codes(5, page_size, num_kv, head_dim, bits, gen)
    reference.encode_page_keys(codes, k_pages, kmin, kmax, perm, bits)
    for rerank, best in (("mass", 1), ("max", 0)):
        scores = backend.page_scores_codes(q, codes, kmin, kmax, table, seq_lens, page_size, bits, selection,
                                           reduction, rerank, 1.0)
        assert (scores[0, :, :3].argmax(-1) == best).all(), (rerank, scores)
        pages = reference.select_pages(scores, seq_lens, page_size, 2)
        assert (pages[0] == torch.tensor([best, 3], dtype=torch.int32)).all(), (rerank, pages)
