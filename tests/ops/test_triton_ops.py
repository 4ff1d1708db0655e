"""Every Quest Triton kernel against the torch reference, under the Triton interpreter (CPU).

Shapes stay tiny (<= 16 pages, batch <= 2): the interpreter runs programs one after another.
Every test draws fresh random inputs; pools are poisoned with NaN where nothing may be read.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from questkv import ops  # noqa: E402
from questkv.ops import reference  # noqa: E402
from questkv.ops import triton as tk  # noqa: E402
from questkv.ops.triton import decode_attention as attention, estimate, select  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (num_q_heads, num_kv_heads, head_dim): GQA and MHA
HEADS = [(8, 2, 32), (4, 4, 64)]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any()
    return ((out - ref).norm() / ref.norm()).item()


def _tol(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


def _pool(num_pages, page_size, num_kv_heads, head_dim, dtype, gen):
    """Random K/V pages and consistent-looking bounds; every slot past a sequence is garbage."""
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_pages = torch.randn(shape, generator=gen).to(dtype)
    v_pages = torch.randn(shape, generator=gen).to(dtype)
    kmin = k_pages.amin(1)
    kmax = k_pages.amax(1)
    return k_pages, v_pages, kmin, kmax


def _batch(lens, page_size, num_pages, max_pages, gen):
    """Page table with distinct random pages per row and out-of-range padding past each length."""
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(lens), max_pages), 10**6, dtype=torch.int32)  # padding: never read
    used = 0
    for row, length in enumerate(lens):
        n = -(-length // page_size)
        table[row, :n] = perm[used : used + n].int()
        used += n
    return table, torch.tensor(lens, dtype=torch.int32)


def _readable(table: torch.Tensor) -> torch.Tensor:
    """The table with padding replaced by page 0: the reference gathers padding before masking it."""
    return torch.where(table >= 10**6, 0, table)


def _poison_unused(k_pages, v_pages, table, lens, page_size):
    """NaN in every pool slot that holds no token of the batch: the kernels must never read it."""
    keep = torch.zeros(k_pages.shape[:2], dtype=torch.bool)
    for row, length in enumerate(lens.tolist()):
        for pos in range(length):
            keep[table[row, pos // page_size], pos % page_size] = True
    k_pages[~keep] = float("nan")
    v_pages[~keep] = float("nan")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 24])
def test_append_kv_matches_reference(dtype, head_dim):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    num_pages, page_size, heads = 6, 8, 2
    pools = _pool(num_pages, page_size, heads, head_dim, dtype, gen)
    ref = [t.clone() for t in pools]
    out = [t.clone() for t in pools]
    # a prefill chunk that starts a page and ends mid-page, a decode token widening a half-full
    # page, and a reused page restarted at offset 0 (its old bounds must be dropped)
    slots = torch.cat([torch.arange(2 * 8, 2 * 8 + 13), torch.tensor([4 * 8 + 5]), torch.arange(0, 3)])
    # float32 tokens cast to the pool's dtype in the kernel; bf16 pools get bf16 tokens, because
    # the interpreter rounds float32 -> bf16 toward zero where the GPU rounds to nearest even
    token_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    keys = torch.randn(slots.shape[0], heads, head_dim, generator=gen).to(token_dtype)
    values = torch.randn(slots.shape[0], heads, head_dim, generator=gen).to(token_dtype)
    reference.append_kv(*ref, slots, keys, values)
    tk.append_kv(*out, slots.int(), keys, values)
    for got, want in zip(out, ref):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 24])
def test_rope_append_kv_matches_reference(dtype, head_dim):
    """RoPE folded into the append: queries and keys rotated in place (views of one fused projection output,
    as the model passes them), the rotated keys, the values and the bounds stored, for a prefill run that starts
    a page and ends mid-page, a decode token widening a half-full page and a reused page restarted at offset 0.
    float32 and float16 equal the reference bit for bit; bfloat16 to within its roundings (the interpreter
    rounds float32 -> bf16 toward zero, the GPU and torch to nearest even)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    num_pages, page_size, num_q, heads = 6, 8, 8, 2
    pools = _pool(num_pages, page_size, heads, head_dim, dtype, gen)
    ref = [t.clone() for t in pools]
    out = [t.clone() for t in pools]
    slots = torch.cat([torch.arange(2 * 8, 2 * 8 + 13), torch.tensor([4 * 8 + 5]), torch.arange(0, 3)])
    tokens = slots.shape[0]
    fused = torch.randn(tokens, (num_q + 2 * heads) * head_dim, generator=gen).to(dtype)  # [T, (Hq + 2 Hkv) D]

    def views(buffer):
        q, k, v = buffer.split([num_q * head_dim, heads * head_dim, heads * head_dim], dim=1)
        return q.view(tokens, num_q, head_dim), k.view(tokens, heads, head_dim), v.view(tokens, heads, head_dim)

    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 100.0
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want, got = fused.clone(), fused.clone()
    reference.rope_append_kv(*ref, slots, *views(want), cos, sin)
    tk.rope_append_kv(*out, slots.int(), *views(got), cos, sin)
    assert not torch.equal(want, fused)  # rotated in place
    if dtype == torch.bfloat16:  # three roundings, each at most one bf16 ulp (2**-7 relative) off
        torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-2)
        for got_pool, want_pool in zip(out, ref):
            torch.testing.assert_close(got_pool, want_pool, rtol=2e-2, atol=5e-2)
    else:
        assert torch.equal(got, want)
        for got_pool, want_pool in zip(out, ref):
            assert torch.equal(got_pool, want_pool)


def test_rope_append_kv_rejects_bad_arguments():
    pools = _pool(2, 4, 1, 6, torch.float32, torch.Generator().manual_seed(0))
    slots = torch.arange(3, dtype=torch.int32)
    q, k, v = torch.randn(3, 2, 6), torch.randn(3, 1, 6), torch.randn(3, 1, 6)
    cos, sin = torch.randn(3, 3), torch.randn(3, 3)
    with pytest.raises(ValueError, match="q must be"):
        tk.rope_append_kv(*pools, slots, q[:2], k, v, cos, sin)
    with pytest.raises(ValueError, match="cos must have shape"):
        tk.rope_append_kv(*pools, slots, q, k, v, cos[:, :2], sin)
    with pytest.raises(ValueError, match="share a dtype"):
        tk.rope_append_kv(*pools, slots, q, k, v, cos.double(), sin)
    odd = _pool(2, 4, 1, 5, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="head_dim must be even"):
        tk.rope_append_kv(*odd, slots, torch.randn(3, 2, 5), torch.randn(3, 1, 5), torch.randn(3, 1, 5),
                          torch.randn(3, 2), torch.randn(3, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("selection,reduction", [("kv_head", "sum"), ("kv_head", "max"), ("q_head", "sum")])
@pytest.mark.parametrize("block_p,blocks", [(64, 1), (4, 2)])
def test_page_scores_matches_reference(dtype, heads, selection, reduction, block_p, blocks, monkeypatch):
    monkeypatch.setattr(estimate, "_BLOCK_P", block_p)  # (4, 2): several programs, each a 2-block loop
    monkeypatch.setattr(estimate, "_BLOCKS_PER_PROGRAM", blocks)
    monkeypatch.setattr(estimate, "_MIN_PROGRAMS_PER_SM", 0)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    num_q, num_kv, head_dim = heads
    page_size, num_pages, max_pages = 16, 40, 16
    _, _, kmin, kmax = _pool(num_pages, page_size, num_kv, head_dim, dtype, gen)
    table, lens = _batch([250, 37], page_size, num_pages, max_pages, gen)
    q = torch.randn(2, num_q, head_dim, generator=gen).to(dtype)
    want = reference.page_scores(q, kmin, kmax, _readable(table), lens, page_size, selection, reduction)
    got = tk.page_scores(q, kmin, kmax, table, lens, page_size, selection, reduction)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("selection,reduction", [("kv_head", "sum"), ("q_head", "sum")])
@pytest.mark.parametrize("blocks", [1, 2])
def test_page_scores_in_a_wide_table_match_reference(selection, reduction, blocks, monkeypatch):
    """A table far wider than every row (programs wholly past a sequence only store -inf, one of
    two blocks may be past it): the scores equal the reference's, -inf at exactly its columns, into
    an output full of garbage."""
    monkeypatch.setattr(estimate, "_BLOCK_P", 4)
    monkeypatch.setattr(estimate, "_BLOCKS_PER_PROGRAM", blocks)
    monkeypatch.setattr(estimate, "_MIN_PROGRAMS_PER_SM", 0)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    num_q, num_kv, head_dim = HEADS[0]
    page_size, num_pages, max_pages = 16, 40, 30
    _, _, kmin, kmax = _pool(num_pages, page_size, num_kv, head_dim, torch.float32, gen)
    table, lens = _batch([85, 1], page_size, num_pages, max_pages, gen)  # 6 pages and 1 of 30 columns
    q = torch.randn(2, num_q, head_dim, generator=gen)
    want = reference.page_scores(q, kmin, kmax, _readable(table), lens, page_size, selection, reduction)
    got = torch.full_like(want, float("nan"))
    tk.page_scores_into(got, q, kmin, kmax, table, lens, page_size, selection, reduction)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-4)


def _active(kind: str, batch: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch]`` int32 flags: ``"mixed"`` (random, at least one 0 and one nonzero), ``"none"``, ``"all"``."""
    if kind == "none":
        return torch.zeros(batch, dtype=torch.int32)
    if kind == "all":
        return torch.randint(1, 5, (batch,), generator=gen, dtype=torch.int32)  # any nonzero value is active
    flags = torch.randint(0, 2, (batch,), generator=gen, dtype=torch.int32)
    rows = torch.randperm(batch, generator=gen)[:2]
    flags[rows[0]], flags[rows[1]] = 0, 3
    return flags


@pytest.mark.parametrize("kind", ["mixed", "none", "all"])
@pytest.mark.parametrize("selection,reduction", [("kv_head", "sum"), ("q_head", "sum")])
def test_page_scores_of_inactive_sequences_are_left_untouched(kind, selection, reduction, monkeypatch):
    """With ``active`` flags (several programs per row, a row past some blocks): the rows of sequences
    flagged 0 keep their random contents bit for bit, the others equal the launch without flags bit for
    bit (and the reference); the reference's ``active`` does the same."""
    monkeypatch.setattr(estimate, "_BLOCK_P", 4)
    monkeypatch.setattr(estimate, "_MIN_PROGRAMS_PER_SM", 0)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    num_q, num_kv, head_dim = HEADS[0]
    page_size, num_pages, max_pages = 16, 40, 12
    _, _, kmin, kmax = _pool(num_pages, page_size, num_kv, head_dim, torch.float32, gen)
    table, lens = _batch([150, 17, 64], page_size, num_pages, max_pages, gen)
    q = torch.randn(3, num_q, head_dim, generator=gen)
    active = _active(kind, 3, gen)
    sentinel = torch.randn(3, num_q if selection == "q_head" else num_kv, max_pages, generator=gen)
    full = tk.page_scores(q, kmin, kmax, table, lens, page_size, selection, reduction)
    want = torch.where(active[:, None, None] != 0, full, sentinel)
    got = tk.page_scores_into(sentinel.clone(), q, kmin, kmax, table, lens, page_size, selection, reduction, active)
    assert torch.equal(got, want)
    ref = reference.page_scores(q, kmin, kmax, _readable(table), lens, page_size, selection, reduction)
    ref_got = reference.page_scores_into(sentinel.clone(), q, kmin, kmax, _readable(table), lens, page_size,
                                         selection, reduction, active)
    assert torch.equal(ref_got, torch.where(active[:, None, None] != 0, ref, sentinel))
    finite = torch.isfinite(ref_got)
    assert torch.equal(finite, torch.isfinite(got))
    torch.testing.assert_close(got[finite], ref_got[finite], rtol=1e-5, atol=1e-4)


def test_page_scores_refuse_bad_active_flags():
    """``active`` of the wrong length, shape (one flag per head), dtype, device or layout: ValueError naming it,
    in both backends; the shape's message says what is allowed."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    _, _, kmin, kmax = _pool(8, 4, 2, 16, torch.float32, gen)
    table, lens = _batch([9, 4], 4, 8, 3, gen)
    q = torch.randn(2, 4, 16, generator=gen)
    out = torch.empty(2, 2, 3)
    bad = (torch.ones(3, dtype=torch.int32), torch.ones(2, dtype=torch.bool), torch.ones(2, dtype=torch.int64),
           torch.ones(2, dtype=torch.int32, device="meta"), torch.ones(2, 2, dtype=torch.int32)[:, 0])
    for module in (tk, reference):
        for active in bad:
            with pytest.raises(ValueError, match="active"):
                module.page_scores_into(out, q, kmin, kmax, table, lens, 4, active=active)
        with pytest.raises(ValueError, match=r"active must be None or a contiguous int32 tensor of shape \(2,\) on "
                                             r"cpu, got shape \(2, 2\)"):
            module.page_scores_into(out, q, kmin, kmax, table, lens, 4, active=torch.ones(2, 2, dtype=torch.int32))


@pytest.mark.parametrize(
    "lens,budget,sink,recent",
    [([250, 37], 5, 1, 1), ([256, 100], 8, 0, 0), ([40, 17], 6, 2, 1), ([16, 1], 3, 0, 2), ([130, 33], 11, 1, 3)],
)
@pytest.mark.parametrize("ties", [False, True])
def test_select_pages_matches_reference(lens, budget, sink, recent, ties):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    page_size, max_pages, heads = 16, 16, 3
    scores = torch.randn(2, heads, max_pages, generator=gen)
    if ties:  # few distinct values, some valid pages at -inf: ties must go to the lower index
        scores = scores.round()
        scores[scores < -1] = float("-inf")
    lens = torch.tensor(lens, dtype=torch.int32)
    want = reference.select_pages(scores, lens, page_size, budget, sink, recent)
    got = tk.select_pages(scores, lens, page_size, budget, sink, recent)
    assert got.dtype == torch.int32
    assert torch.equal(got, want)


@pytest.mark.parametrize("sink,recent", [(0, 0), (1, 1)])
@pytest.mark.parametrize("ties", [False, True])
def test_select_pages_with_per_sequence_budgets_matches_reference(sink, recent, ties):
    """Mixed budgets in one batch: each row picks its own budget, bit for bit with the reference,
    and a row's choice equals the same row selected alone at that budget."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    page_size, max_pages, heads, budget_pages = 16, 16, 3, 8
    scores = torch.randn(3, heads, max_pages, generator=gen)
    if ties:
        scores = scores.round()
    lens = torch.tensor([250, 200, 90], dtype=torch.int32)
    budgets = torch.tensor([8 * page_size, 3 * page_size, 5 * page_size], dtype=torch.int32)
    want = reference.select_pages(scores, lens, page_size, budget_pages, sink, recent, budgets)
    got = tk.select_pages(scores, lens, page_size, budget_pages, sink, recent, budgets)
    assert torch.equal(got, want)
    for row in range(3):
        alone = reference.select_pages(scores[row : row + 1], lens[row : row + 1], page_size, int(budgets[row]) // page_size, sink, recent)
        picked = want[row][:, : alone.shape[-1]]
        assert torch.equal(picked, alone[0])
        assert (want[row][:, alone.shape[-1]:] == -1).all()
    full = reference.select_pages(scores, lens, page_size, budget_pages, sink, recent)
    same = reference.select_pages(scores, lens, page_size, budget_pages, sink, recent, torch.full((3,), 8 * page_size, dtype=torch.int32))
    assert torch.equal(full, same)


def _attention_case(dtype, heads, lens, max_pages, page_size, gen):
    num_q, num_kv, head_dim = heads
    num_pages = 2 * max_pages + 3
    k_pages, v_pages, _, _ = _pool(num_pages, page_size, num_kv, head_dim, dtype, gen)
    table, seq_lens = _batch(lens, page_size, num_pages, max_pages, gen)
    _poison_unused(k_pages, v_pages, table, seq_lens, page_size)
    q = torch.randn(len(lens), num_q, head_dim, generator=gen).to(dtype)
    return q, k_pages, v_pages, table, seq_lens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("selection", ["kv_head", "q_head", None])
def test_paged_decode_attention_matches_reference(dtype, heads, selection):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    page_size, max_pages = 16, 8
    q, k_pages, v_pages, table, lens = _attention_case(dtype, heads, [115, 21], max_pages, page_size, gen)
    selected = None
    if selection is not None:
        sel_heads = heads[0] if selection == "q_head" else heads[1]
        scores = torch.randn(2, sel_heads, max_pages, generator=gen)
        selected = reference.select_pages(scores, lens, page_size, 4, 0, 0)  # row 1 has 2 pages: -1 padding
    want = reference.paged_decode_attention(q, k_pages, v_pages, _readable(table), lens, selected)
    got = tk.paged_decode_attention(q, k_pages, v_pages, table, lens, selected)
    assert got.dtype == dtype and got.shape == want.shape
    assert _rel_err(got, want) < _tol(dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_row_budgets_below_the_steps_read_their_columns_then_the_extra_ones_over_every_split(num_splits):
    """A selection of 6 budget columns then 2 extra ones (a reused selection's pages begun since), rows whose token
    budgets leave 1-6 of the budget columns: the kernel, each row's pages spread over all the splits of a plan made
    for every column, equals the reference, which reads the same columns; columns past a row's budget hold pages
    here (any value there is ignored), so ignoring them changes the output."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    page_size, max_pages, heads, batch = 16, 12, (8, 2, 32), 4
    q, k_pages, v_pages, table, lens = _attention_case(torch.float32, heads, [180, 120, 60, 40], max_pages,
                                                        page_size, gen)
    selected = torch.full((batch, heads[1], 8), -1, dtype=torch.int32)  # each row's own pages, then -1
    for row, length in enumerate(lens.tolist()):
        n = -(-length // page_size)
        for head in range(heads[1]):
            selected[row, head, :min(n, 8)] = torch.randperm(n, generator=gen)[:8].int()
    budgets = torch.randint(1, 7, (batch,), generator=gen, dtype=torch.int32) * page_size
    budgets[0] = 2 * page_size  # (row 0 holds a page in every column: its budget surely leaves some out)
    want = reference.paged_decode_attention(q, k_pages, v_pages, _readable(table), lens, selected, None, budgets, 6)
    unlimited = reference.paged_decode_attention(q, k_pages, v_pages, _readable(table), lens, selected)
    skipped = selected.masked_fill((torch.arange(8) >= budgets[:, None] // page_size)[:, None, :]
                                   & (torch.arange(8) < 6)[None, None, :], -1)
    torch.testing.assert_close(want, reference.paged_decode_attention(q, k_pages, v_pages, _readable(table), lens,
                                                                      skipped), rtol=0, atol=0)
    assert not torch.equal(want[0], unlimited[0])
    buffers = tk.attention_buffers(batch, heads[0], heads[1], heads[2], 8, page_size, False, q.device, num_splits)
    got = tk.paged_decode_attention_into(torch.empty_like(q), buffers, q, k_pages, v_pages, table, lens, selected,
                                         None, budgets, 6)
    assert _rel_err(got, want) < _tol(torch.float32)


def test_row_budgets_are_checked():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k_pages, v_pages, table, lens = _attention_case(torch.float32, (8, 2, 32), [60, 40], 8, 16, gen)
    selected = torch.zeros((2, 2, 4), dtype=torch.int32)
    budgets = torch.full((2,), 32, dtype=torch.int32)
    args = (q, k_pages, v_pages, _readable(table), lens)
    with pytest.raises(ValueError, match="dense attention"):
        reference.paged_decode_attention(*args, None, None, budgets)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        reference.paged_decode_attention(*args, selected, None, budgets.long())
    with pytest.raises(ValueError, match=r"selection_cols must be an int in \[1, 4\].*5"):
        reference.paged_decode_attention(*args, selected, None, budgets, 5)
    with pytest.raises(ValueError, match="without budgets"):
        reference.paged_decode_attention(*args, selected, None, None, 2)


@pytest.mark.parametrize("selection", ["kv_head", None])
def test_paged_decode_attention_reads_a_head_major_pool(selection):
    """The kernel takes the pools' strides: the same values stored head-major ([pages, kv heads, page
    size, head_dim], viewed as the usual shape) give the same output bit for bit."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    page_size, max_pages, heads = 16, 8, (8, 2, 32)
    q, k_pages, v_pages, table, lens = _attention_case(torch.float32, heads, [115, 60], max_pages, page_size, gen)
    selected = None
    if selection is not None:
        scores = torch.randn(2, heads[1], max_pages, generator=gen)
        selected = reference.select_pages(scores, lens, page_size, 4, 0, 0)
    head_major = [pages.transpose(1, 2).contiguous().transpose(1, 2) for pages in (k_pages, v_pages)]
    assert not head_major[0].is_contiguous()  # same values (unused slots hold NaN: no torch.equal here)
    want = tk.paged_decode_attention(q, k_pages, v_pages, table, lens, selected)
    assert torch.equal(tk.paged_decode_attention(q, *head_major, table, lens, selected), want)


@pytest.mark.parametrize("few", [True, False])  # a dense grid of few programs (8-page iterations) or not (4)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_split_merge_and_scale(num_splits, few, monkeypatch):
    """Explicit split counts (a short sequence leaves whole splits empty), a custom scale, and two
    launches on the same buffers: the fused merge must leave its counters at zero."""
    if not few:
        monkeypatch.setattr(attention, "_FEW_PROGRAMS", 0)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    page_size, max_pages = 16, 24
    q, k_pages, v_pages, table, lens = _attention_case(torch.float32, (8, 2, 32), [300, 5], max_pages, page_size, gen)
    buffers = tk.attention_buffers(2, 8, 2, 32, max_pages, page_size, True, q.device, num_splits)
    part_out, part_lse, counters, _ = buffers
    assert part_lse.shape[-1] == num_splits
    want = reference.paged_decode_attention(q, k_pages, v_pages, _readable(table), lens, None, 0.3)
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        part_out.fill_(float("nan"))
        part_lse.fill_(float("nan"))
        tk.paged_decode_attention_into(out, buffers, q, k_pages, v_pages, table, lens, None, 0.3)
        assert _rel_err(out, want) < 1e-5
        assert not counters.any()


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("selection", ["kv_head", None])
def test_attention_merges_more_splits_than_one_merge_step_holds(wide, selection, monkeypatch):
    """37 splits of one page (pages of 128 tokens: one page per inner iteration) merged in steps of the
    narrow (16) or the wide (32) chunk: three or two merge steps, the last one partial, a sequence too
    short for most splits beside a long one; equal to the reference, counters left at zero."""
    monkeypatch.setattr(attention, "_WIDE_MERGE_PROGRAMS_PER_SM", 10**6 if wide else 0)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    page_size, max_pages, heads, num_splits = 128, 37, (8, 2, 32), 37
    q, k_pages, v_pages, table, lens = _attention_case(torch.float32, heads, [37 * 128 - 5, 400], max_pages, page_size, gen)
    selected = None
    if selection is not None:
        selected = torch.arange(max_pages, dtype=torch.int32).expand(2, heads[1], max_pages).contiguous()
        selected[1, :, 4:] = -1
    assert attention.merge_chunk(num_splits * heads[1] * 2, 4, q.device) == (32 if wide else 16)
    buffers = tk.attention_buffers(2, 8, 2, 32, max_pages, page_size, selection is None, q.device, num_splits)
    assert buffers.part_lse.shape[-1] == num_splits
    want = reference.paged_decode_attention(q, k_pages, v_pages, _readable(table), lens, selected)
    out = tk.paged_decode_attention_into(torch.empty_like(q), buffers, q, k_pages, v_pages, table, lens, selected)
    assert _rel_err(out, want) < 1e-5
    assert not buffers.counters.any()


def test_merge_chunk_is_wide_only_for_few_programs_and_small_groups():
    """The wide merge serves grids of at most two programs per SM (132 on a CPU tensor) and groups of at most
    4 query heads; anything else merges in steps of 16."""
    cpu = torch.device("cpu")
    assert attention.merge_chunk(264, 4, cpu) == 32
    assert attention.merge_chunk(265, 4, cpu) == 16
    assert attention.merge_chunk(8, 8, cpu) == 16
    assert attention.merge_chunk(8, 1, cpu) == 32


def test_dense_grids_of_few_programs_take_longer_splits():
    """A dense grid of at most 16 (sequence, KV head) pairs (batch 1 of 8 KV heads) aims at 2 programs per SM with
    128 keys per iteration; more pairs at 4 per SM with 64 (on model-dtype and on fp8 pages); sparse grids at 3
    per SM with 128, on fp8 pages at 2 (132 SMs on a CPU)."""
    cpu = torch.device("cpu")
    assert [attention.grid_kind(True, n) for n in (8, 16, 17)] == ["dense-few", "dense-few", "dense"]
    assert [attention.grid_kind(True, n, fp8=True) for n in (16, 17)] == ["dense-few", "dense-fp8"]
    assert attention.grid_kind(False, 8) == "sparse" and attention.grid_kind(False, 64, fp8=True) == "sparse-fp8"
    assert attention.plan_splits(2048, 8, 16, cpu, True) == (32, 64)  # 33 aimed at, whole 8-page iterations
    assert attention.plan_splits(2048, 64, 16, cpu, True) == (8, 256)  # 8 = 4 * 132 // 64, 4-page iterations
    assert attention.plan_splits(2048, 64, 16, cpu, True, fp8=True) == (8, 256)  # as on model-dtype pages
    assert attention.plan_splits(2048, 128, 16, cpu, False, fp8=True) == (2, 1024)  # 2 = 2 * 132 // 128
    assert attention.plan_splits(129, 8, 16, cpu, False) == (17, 8)  # 49 aimed at, at least one 8-page iteration


def test_multi_query_grids_take_their_own_launch():
    """A dense grid of several queries per sequence on model-dtype pages (a verify step) aims at 2 programs per SM
    in 3 stages, 128 keys per iteration for tiles of up to 32 rows, 64 for 64 rows, whatever its program count;
    on fp8 pages it keeps the dense grids' launch; one query per sequence is the dense grid's."""
    cpu = torch.device("cpu")
    assert [attention.grid_kind(True, n, verify_rows=r) for n, r in ((8, 16), (64, 32), (64, 64))] == [
        "verify", "verify", "verify-64"]
    assert attention.grid_kind(True, 64, fp8=True, verify_rows=32) == "dense-fp8"
    assert attention.grid_kind(False, 64, verify_rows=32) == "sparse"
    assert attention.plan_splits(2048, 64, 16, cpu, True, verify_rows=32) == (4, 512)  # 4 = 2 * 132 // 64, 8 pages
    assert attention.plan_splits(2048, 64, 16, cpu, True, verify_rows=64) == (4, 512)  # 4-page iterations
    buffers = attention.attention_buffers(16, 32, 8, 128, 2048, 16, True, cpu, num_queries=9)  # 36 rows -> 64
    assert buffers.part_lse.shape == (16, 9 * 32, 2)  # 2 = 2 * 132 // 128 programs


def _force_split_select(monkeypatch, split):
    """Make every select take the split path (chunks of 8 pages) or the one-program-per-row kernel."""
    monkeypatch.setattr(select, "_SPLIT_MIN_PAGES", 1 if split else 10**9)
    monkeypatch.setattr(select, "_SPLIT_MAX_ROWS", 10**9)
    monkeypatch.setattr(select, "_SPLIT_CHUNK_PAGES", 8)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("selection", ["kv_head", "q_head"])
def test_decode_step_matches_reference(selection, split, monkeypatch):
    """QuestDecodeStep on the Triton backend (CPU tensors, interpreter) against the torch backend,
    with either select path (split: 2 chunks per row, the last one partial)."""
    from questkv.ops import LayerPages
    from questkv.config import QuestConfig
    from questkv.decode import QuestDecodeStep, quest_decode

    _force_split_select(monkeypatch, split)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    page_size, max_pages, heads = 16, 10, (8, 2, 32)
    q, k_pages, v_pages, table, lens = _attention_case(torch.float16, heads, [150, 60], max_pages, page_size, gen)
    # bounds of the live tokens only (poisoned slots are NaN)
    live_min = torch.where(k_pages.isnan(), float("inf"), k_pages.float()).amin(1).to(k_pages.dtype)
    live_max = torch.where(k_pages.isnan(), float("-inf"), k_pages.float()).amax(1).to(k_pages.dtype)
    layer = LayerPages(k_pages, v_pages, live_min, live_max)
    for cfg_kwargs in ({"token_budget": 64, "sink_pages": 1, "recent_pages": 1}, {"token_budget": None}):
        outs, chosen = {}, {}
        for backend in ("triton", "torch"):
            config = QuestConfig(selection=selection, backend=backend, **cfg_kwargs)
            step = QuestDecodeStep(config, 2, *heads, max_pages, q.dtype, q.device)
            outs[backend] = step(q, layer, table if backend == "triton" else _readable(table), lens).clone()
            chosen[backend] = None if config.is_dense else step.selected.clone()
        if chosen["torch"] is not None:
            assert torch.equal(chosen["triton"], chosen["torch"])
        direct = quest_decode(q, layer, _readable(table), lens, QuestConfig(selection=selection, backend="torch", **cfg_kwargs))
        assert _rel_err(outs["triton"], direct) < 2e-3
        assert _rel_err(outs["torch"], direct) < 1e-6


@pytest.mark.parametrize("split", [False, True])
def test_decode_step_with_mixed_budgets_matches_reference_and_each_row_alone(split, monkeypatch):
    """Per-sequence token budgets through QuestDecodeStep: Triton == torch (selection bit for bit,
    either select path), and every row equals the same sequence decoded alone at its own budget."""
    from questkv.config import QuestConfig
    from questkv.decode import QuestDecodeStep
    from questkv.ops import LayerPages

    _force_split_select(monkeypatch, split)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    page_size, max_pages, heads = 16, 10, (8, 2, 32)
    q, k_pages, v_pages, table, lens = _attention_case(torch.float32, heads, [150, 140, 60], max_pages, page_size, gen)
    live_min = torch.where(k_pages.isnan(), float("inf"), k_pages).amin(1)
    live_max = torch.where(k_pages.isnan(), float("-inf"), k_pages).amax(1)
    layer = LayerPages(k_pages, v_pages, live_min, live_max)
    budgets = torch.tensor([96, 32, 64], dtype=torch.int32)
    outs, chosen = {}, {}
    for backend in ("triton", "torch"):
        config = QuestConfig(token_budget=96, sink_pages=1, backend=backend)
        step = QuestDecodeStep(config, 3, *heads, max_pages, q.dtype, q.device)
        outs[backend] = step(q, layer, table if backend == "triton" else _readable(table), lens, budgets=budgets).clone()
        chosen[backend] = step.selected.clone()
    assert torch.equal(chosen["triton"], chosen["torch"])
    assert _rel_err(outs["triton"], outs["torch"]) < 1e-5
    for row in range(3):
        alone_cfg = QuestConfig(token_budget=int(budgets[row]), sink_pages=1, backend="torch")
        alone = QuestDecodeStep(alone_cfg, 1, *heads, max_pages, q.dtype, q.device)
        want = alone(q[row : row + 1], layer, _readable(table)[row : row + 1], lens[row : row + 1])
        torch.testing.assert_close(outs["torch"][row : row + 1], want, rtol=1e-6, atol=1e-6)


def test_dispatch_picks_reference_for_cpu_and_kernels_when_forced():
    cpu = torch.empty(1)
    assert ops.resolve_backend(cpu, "auto") is reference
    assert ops.resolve_backend(cpu, "torch") is reference
    assert ops.resolve_backend(cpu, "triton") is tk
    with pytest.raises(ValueError):
        ops.resolve_backend(cpu, "cuda")
