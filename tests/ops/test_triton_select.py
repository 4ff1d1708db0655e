"""The split select (several programs per row, global histograms) against the torch reference,
under the Triton interpreter (CPU).

Chunks of 2 or 4 pages give up to 7 programs per row, the last one often partial; both digit
widths run (8 bits x 4 passes, 11 / 11 / 10). Every launch must leave the merged histograms and
counters zeroed, and a second launch on the same buffers must still match.
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
