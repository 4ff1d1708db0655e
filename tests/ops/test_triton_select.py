"""Both select paths against the torch reference, bit for bit, under the Triton interpreter (CPU).

The one-program path loops over chunks of its row, as many as the row's own pages fill: chunks of
2 to 16 pages (``_ROW_BLOCK`` and ``_ROW_SINGLE_PAGES`` made small) give rows of one chunk, of several,
and of a power of two plus one (17, 33, 65 pages), in tables much wider than every row, with ties
across chunk boundaries and budgets at or above the row's pages (padding over several chunks); tables
no wider than a chunk take the loop-free ``SINGLE`` kernel.

The split select (several programs per row, global histograms): chunks of 2 or 4 pages give up to
7 programs per row, the last one often partial; both digit widths run (8 bits x 4 passes, 11 / 11 /
10). Every launch must leave the merged histograms and counters zeroed, and a second launch on the
same buffers must still match.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from questkv.ops import reference  # noqa: E402
from questkv.ops.triton import select  # noqa: E402

PAGE_SIZE = 16
KINDS = ("random", "few", "equal")


def _row(kind: str, max_pages: int, gen: torch.Generator) -> torch.Tensor:
    """One score row: random; heavy ties among a few values with -inf and both zeros; all equal."""
    if kind == "random":
        return torch.randn(max_pages, generator=gen)
    if kind == "few":
        values = torch.tensor([float("-inf"), -1.0, -0.0, 0.0, 2.0])
        return values[torch.randint(len(values), (max_pages,), generator=gen)]
    return torch.full((max_pages,), 0.5)


def _chunks(monkeypatch, block: int) -> None:
    """The one-program path in chunks of ``block`` pages: tables of at most ``block`` columns are one
    chunk (``SINGLE``, no chunk loop), wider ones loop over chunks."""
    monkeypatch.setattr(select, "_ROW_BLOCK", block)
    monkeypatch.setattr(select, "_ROW_SINGLE_PAGES", block)


def _check_row(scores, lens, budget_pages, sink, recent, budgets=None):
    """The one-program path into ``out`` full of garbage equals the reference."""
    want = reference.select_pages(scores, lens, PAGE_SIZE, budget_pages, sink, recent, budgets)
    out = torch.full(want.shape, 12345, dtype=torch.int32)
    select.select_pages_into(out, scores, lens, PAGE_SIZE, budget_pages, sink, recent, budgets, split=False)
    assert torch.equal(out, want)


@pytest.mark.parametrize(
    "pages,max_pages,block",
    [((17, 3), 64, 16), ((33, 1), 64, 16), ((65, 16), 80, 16), ((9, 16), 64, 8), ((16, 5), 16, 16)],
)
def test_row_select_follows_each_rows_pages(pages, max_pages, block, monkeypatch):
    """Rows of very different lengths in one batch (one page past a power of two, a single page,
    exactly one chunk), tables much wider than every row, partial last pages: every kind of score per
    row, forced sink / recent pages, budgets below, at and above the rows' pages, with and without
    per-row budgets (one of them 0), equal to the reference."""
    _chunks(monkeypatch, block)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    lens = torch.tensor([n * PAGE_SIZE - (3 if n > 1 else 0) for n in pages], dtype=torch.int32)
    rows = [_row(KINDS[(seq + head) % len(KINDS)], max_pages, gen) for seq in range(2) for head in range(2)]
    scores = torch.stack(rows).view(2, 2, max_pages)
    budget_cases = ((5, 1, 2), (min(pages) + 1, 0, 1), (max(pages), 2, 0), (max(pages) + 2 * block, 0, 0))
    for budget_pages, sink, recent in budget_cases:
        _check_row(scores, lens, budget_pages, sink, recent)
    budgets = torch.tensor([budget_pages * PAGE_SIZE, 0], dtype=torch.int32)
    _check_row(scores, lens, budget_pages, 1, 1, budgets)
    _check_row(scores, lens, budget_pages, 1, 1, budgets.flip(0))


@pytest.mark.parametrize("block", [4, 8])
def test_row_select_breaks_ties_across_chunks_lowest_page_first(block, monkeypatch):
    """Ties at the threshold spread over several chunks: the first ones by page index are kept,
    whatever chunk holds them (few distinct values, -inf and both zeros among them; all equal)."""
    _chunks(monkeypatch, block)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    max_pages = 32
    values = torch.tensor([float("-inf"), -0.0, 0.0, 1.0])
    scores = torch.stack([values[torch.randint(len(values), (max_pages,), generator=gen)],
                          torch.full((max_pages,), 0.25)]).view(2, 1, max_pages)
    lens = torch.tensor([27 * PAGE_SIZE - 1, 13 * PAGE_SIZE], dtype=torch.int32)
    for budget_pages in (3, 2 * block + 1, 12):
        _check_row(scores, lens, budget_pages, 1, 1)


@settings(max_examples=8, deadline=None)
@given(
    batch=st.integers(1, 2),
    max_pages=st.integers(1, 20),
    block=st.sampled_from([2, 4, 8]),
    budget_pages=st.integers(1, 12),
    sink=st.integers(0, 2),
    recent=st.integers(0, 2),
    with_budgets=st.booleans(),
    data=st.data(),
)
def test_row_select_property(batch, max_pages, block, budget_pages, sink, recent, with_budgets, data):
    """Any shape, lengths (0 and past the table included), chunk size, budgets and score kinds: the
    one-program path equals the reference."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    lengths = st.lists(st.integers(0, (max_pages + 2) * PAGE_SIZE), min_size=batch, max_size=batch)
    lens = torch.tensor(data.draw(lengths), dtype=torch.int32)
    kinds = data.draw(st.lists(st.sampled_from(KINDS), min_size=batch, max_size=batch))
    scores = torch.stack([_row(kind, max_pages, gen) for kind in kinds]).view(batch, 1, max_pages)
    budgets = None
    if with_budgets:
        pages = data.draw(st.lists(st.integers(0, budget_pages), min_size=batch, max_size=batch))
        budgets = torch.tensor(pages, dtype=torch.int32) * PAGE_SIZE
    with pytest.MonkeyPatch.context() as patch:  # hypothesis forbids function-scoped fixtures
        _chunks(patch, block)
        _check_row(scores, lens, budget_pages, sink, recent, budgets)


def _check_split(scores, lens, budget_pages, sink, recent, budgets, buffers):
    """The split path into ``out`` full of garbage equals the reference; scratch left zeroed."""
    want = reference.select_pages(scores, lens, PAGE_SIZE, budget_pages, sink, recent, budgets)
    out = torch.full(want.shape, 12345, dtype=torch.int32)
    select.select_pages_into(out, scores, lens, PAGE_SIZE, budget_pages, sink, recent, budgets, buffers, split=True)
    assert torch.equal(out, want)
    assert not buffers.hist.any() and not buffers.counters.any()


@pytest.mark.parametrize("digit_bits", [8, 11])
def test_split_select_matches_reference(digit_bits):
    """Ragged rows (full with a partial last page, shorter than the budget, one page) with mixed
    budgets, forced sink / recent pages, every score kind; then the same buffers again without
    budgets and other scores."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    max_pages, chunk_pages, budget_pages, sink, recent = 13, 4, 6, 1, 2  # 3 full chunks + 1 of one page
    lens = torch.tensor([max_pages * PAGE_SIZE - 5, 4 * PAGE_SIZE + 1, 1], dtype=torch.int32)
    budgets = torch.tensor([6, 4, 5], dtype=torch.int32) * PAGE_SIZE
    buffers = select.select_buffers(3, 2, max_pages, lens.device, chunk_pages, digit_bits)
    assert buffers.chunk_hist.shape[2] == 4
    for row_budgets in (budgets, None):
        rows = [_row(KINDS[(seq + head) % len(KINDS)], max_pages, gen) for seq in range(3) for head in range(2)]
        scores = torch.stack(rows).view(3, 2, max_pages)
        _check_split(scores, lens, budget_pages, sink, recent, row_budgets, buffers)


@settings(max_examples=8, deadline=None)
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 2),
    max_pages=st.integers(1, 14),
    chunk_pages=st.sampled_from([2, 4]),
    digit_bits=st.sampled_from([8, 11]),
    budget_pages=st.integers(1, 8),
    sink=st.integers(0, 2),
    recent=st.integers(0, 2),
    with_budgets=st.booleans(),
    data=st.data(),
)
def test_split_select_property(batch, heads, max_pages, chunk_pages, digit_bits, budget_pages, sink, recent,
                               with_budgets, data):
    """Any shape, lengths (0 included), budgets and score kinds: the split path equals the reference."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    lens = torch.tensor(data.draw(st.lists(st.integers(0, max_pages * PAGE_SIZE), min_size=batch, max_size=batch)),
                        dtype=torch.int32)
    kinds = data.draw(st.lists(st.sampled_from(KINDS), min_size=batch * heads, max_size=batch * heads))
    scores = torch.stack([_row(kind, max_pages, gen) for kind in kinds]).view(batch, heads, max_pages)
    budgets = None
    if with_budgets:
        pages = data.draw(st.lists(st.integers(0, budget_pages), min_size=batch, max_size=batch))
        budgets = torch.tensor(pages, dtype=torch.int32) * PAGE_SIZE
    buffers = select.select_buffers(batch, heads, max_pages, lens.device, chunk_pages, digit_bits)
    _check_split(scores, lens, budget_pages, sink, recent, budgets, buffers)


def _flags(kind: str, batch: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch]`` int32 ``active`` flags: ``"mixed"`` (random, at least one 0 and one nonzero), ``"none"``, ``"all"``."""
    if kind == "none":
        return torch.zeros(batch, dtype=torch.int32)
    if kind == "all":
        return torch.randint(1, 5, (batch,), generator=gen, dtype=torch.int32)
    flags = torch.randint(0, 2, (batch,), generator=gen, dtype=torch.int32)
    rows = torch.randperm(batch, generator=gen)[:2]
    flags[rows[0]], flags[rows[1]] = 0, 2
    return flags


@pytest.mark.parametrize("split", [False, True])
def test_select_of_inactive_sequences_leaves_their_rows_and_the_extra_columns_untouched(split, monkeypatch):
    """Both paths into an ``out`` wider than the budget (a strided view of a larger tensor full of random
    sentinels), with per-row budgets and forced sink / recent pages, under mixed, all-zero and all-nonzero
    ``active`` flags, several launches on the same split scratch: active rows equal the select without flags
    (the reference's) in their first ``budget_pages`` columns; the columns past them, the rows of inactive
    sequences and everything around ``out`` keep their sentinel; the split scratch ends zeroed. The reference
    op does the same."""
    _chunks(monkeypatch, 4)  # one-program path: rows of several chunks
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    batch, heads, max_pages, budget_pages, sink, recent = 4, 2, 13, 6, 1, 1
    lens = torch.tensor([max_pages * PAGE_SIZE - 5, 4 * PAGE_SIZE + 1, 1, 9 * PAGE_SIZE], dtype=torch.int32)
    budgets = torch.tensor([6, 3, 4, 5], dtype=torch.int32) * PAGE_SIZE
    buffers = select.select_buffers(batch, heads, max_pages, lens.device, chunk_pages=4)
    for kind, row_budgets in (("mixed", budgets), ("none", budgets), ("all", None), ("mixed", None)):
        rows = [_row(KINDS[(seq + head) % len(KINDS)], max_pages, gen) for seq in range(batch) for head in range(heads)]
        scores = torch.stack(rows).view(batch, heads, max_pages)
        active = _flags(kind, batch, gen)
        want = reference.select_pages(scores, lens, PAGE_SIZE, budget_pages, sink, recent, row_budgets)
        sentinel = torch.randint(-(2**31), 2**31 - 1, (batch, heads, budget_pages + 7), generator=gen, dtype=torch.int32)
        expected = sentinel.clone()
        expected[:, :, 2 : 2 + budget_pages] = torch.where(active[:, None, None] != 0, want,
                                                           sentinel[:, :, 2 : 2 + budget_pages])
        for backend in (select, reference):
            big = sentinel.clone()
            out = big[:, :, 2 : 2 + budget_pages + 3]  # 3 columns past the budget; rows strided
            backend.select_pages_into(out, scores, lens, PAGE_SIZE, budget_pages, sink, recent, row_budgets,
                                      buffers, split=split, active=active)
            assert torch.equal(big, expected), backend.__name__
        assert not buffers.hist.any() and not buffers.counters.any()


def test_select_without_flags_is_unchanged_and_checks_its_output_and_flags():
    """``active=None`` and all-nonzero flags give the same output as before, bit for bit; an ``out`` narrower
    than the budget and bad ``active`` flags (length, shape, dtype, device, layout) are refused with a ValueError
    naming them, by both backends and both paths."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    scores = torch.randn(2, 2, 9, generator=gen)
    lens = torch.tensor([9 * PAGE_SIZE, 3 * PAGE_SIZE - 2], dtype=torch.int32)
    want = reference.select_pages(scores, lens, PAGE_SIZE, 4, 1, 1)
    for split in (False, True):
        for active in (None, torch.ones(2, dtype=torch.int32)):
            out = torch.full_like(want, 12345)
            select.select_pages_into(out, scores, lens, PAGE_SIZE, 4, 1, 1, split=split, active=active)
            assert torch.equal(out, want)
    bad = (torch.ones(3, dtype=torch.int32), torch.ones(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.bool),
           torch.ones(2, dtype=torch.int64), torch.ones(2, dtype=torch.int32, device="meta"),
           torch.ones(2, 2, dtype=torch.int32)[:, 0])
    for backend in (select, reference):
        for split in (False, True):
            with pytest.raises(ValueError, match=r"out must have shape \(2, 2, >= budget_pages=4\), got \(2, 2, 3\)"):
                backend.select_pages_into(torch.empty(2, 2, 3, dtype=torch.int32), scores, lens, PAGE_SIZE, 4,
                                          split=split)
            with pytest.raises(ValueError, match="out must have shape"):
                backend.select_pages_into(torch.empty(2, 3, 4, dtype=torch.int32), scores, lens, PAGE_SIZE, 4,
                                          split=split)
            for active in bad:
                with pytest.raises(ValueError, match="active"):
                    backend.select_pages_into(torch.empty_like(want), scores, lens, PAGE_SIZE, 4, split=split,
                                              active=active)


def test_split_path_choice_and_buffer_checks(monkeypatch):
    """``split=None`` follows ``_SPLIT_MIN_PAGES`` and ``_SPLIT_MAX_ROWS`` (the split path
    allocates its own buffers when given none); buffers of another shape are refused."""
    scores = torch.randn(1, 2, 6)
    lens = torch.tensor([6 * PAGE_SIZE], dtype=torch.int32)
    want = reference.select_pages(scores, lens, PAGE_SIZE, 3)
    monkeypatch.setattr(select, "_SPLIT_CHUNK_PAGES", 2)
    calls, split_select = [], select._select_split
    monkeypatch.setattr(select, "_select_split", lambda *args: calls.append(split_select(*args)))
    for min_pages, max_rows, split in ((6, 2, True), (7, 2, False), (6, 1, False)):
        monkeypatch.setattr(select, "_SPLIT_MIN_PAGES", min_pages)
        monkeypatch.setattr(select, "_SPLIT_MAX_ROWS", max_rows)
        calls.clear()
        assert torch.equal(select.select_pages(scores, lens, PAGE_SIZE, 3), want)
        assert bool(calls) == split
    with pytest.raises(ValueError, match="chunk_hist"):
        buffers = select.select_buffers(1, 2, 12, lens.device, 2)
        select.select_pages_into(torch.empty_like(want), scores, lens, PAGE_SIZE, 3, buffers=buffers, split=True)
    with pytest.raises(ValueError, match="power of two"):
        select.select_buffers(1, 1, 6, lens.device, 3)
