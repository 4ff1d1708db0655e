"""The selection-memory kernels (selection reuse) against the torch reference, under the Triton interpreter (CPU):
the same gathered rows and, after a step, the same memory and counters, bit for bit; and a hypothesis state machine
that keeps one memory with each through random steps."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

pytest.importorskip("triton")

from questkv.ops import reuse_reference as reference  # noqa: E402
from questkv.ops.triton import reuse  # noqa: E402

PAGE = 4


def _memory(layers, max_seqs, heads, width, gen):
    """A memory with random selections, some slots without one (``selected_at`` -1), random counters."""
    pages = torch.randint(-1, 60, (layers, max_seqs, heads, width), generator=gen, dtype=torch.int32)
    selected_at = torch.randint(-1, 12, (max_seqs,), generator=gen, dtype=torch.int32)
    counters = tuple(torch.randint(0, 100, (max_seqs,), generator=gen, dtype=torch.int64) for _ in range(3))
    return pages, selected_at, counters


def _clone(memory):
    pages, selected_at, counters = memory
    return pages.clone(), selected_at.clone(), tuple(c.clone() for c in counters)


@pytest.mark.parametrize("layers,heads,budget,width", [(2, 3, 4, 5), (1, 4, 3, 7), (3, 2, 6, 6), (0, 2, 2, 3)])
def test_the_kernels_gather_and_store_as_the_reference_does(layers, heads, budget, width):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    max_seqs, batch = 6, 4
    memory = _memory(layers, max_seqs, heads, width, gen)
    slots = torch.randperm(max_seqs, generator=gen)[:batch]  # real rows: slots of their own
    due = torch.randint(0, 2, (batch,), generator=gen)
    # page counts from one below the stored ones to one past what the extra columns hold: rows that keep, that
    # just fit, that outgrow them
    grown = torch.randint(-1, width - budget + 2, (batch,), generator=gen)
    lens = ((memory[1][slots].clamp(min=1) + grown).clamp(min=1) * PAGE
            - torch.randint(0, PAGE, (batch,), generator=gen)).to(torch.int32)
    results = []
    for module in (reference, reuse):
        pages, selected_at, counters = state = _clone(memory)
        rows = module.gather_selections(pages, selected_at, slots, due, lens, PAGE, budget)
        gathered = tuple(t.clone() for t in rows)
        # the step: new selections in the active rows' budget columns
        step_gen = torch.Generator().manual_seed(seed + 1)
        new = torch.randint(0, 60, rows.selected.shape, generator=step_gen, dtype=torch.int32)
        rows.selected.copy_(torch.where(rows.active.bool()[None, :, None, None], new, rows.selected))
        module.store_selections(pages, selected_at, counters, slots, rows)
        results.append((gathered, state))
    (ref_rows, ref_state), (got_rows, got_state) = results
    assert len(ref_rows) == len(got_rows) == 4
    for name, want, got in zip(("active", "selected", "selected_at", "num_pages"), ref_rows, got_rows):
        assert got.dtype == want.dtype and torch.equal(got, want), (name, seed)
    for want, got in zip(ref_state[:2] + ref_state[2], got_state[:2] + got_state[2]):
        assert torch.equal(got, want), seed
    # the gather itself: a row is active by its phase, by having no selection, or by outgrowing its extra columns
    before = memory[1][slots]
    count = (lens + PAGE - 1) // PAGE
    active = (due != 0) | (before < 0) | (count - before > width - budget)
    assert ref_rows[0].tolist() == active.int().tolist()
    assert torch.equal(ref_rows[1][..., :budget], memory[0][:, slots, :, :budget])


def test_padding_rows_that_share_a_scratch_slot_leave_the_real_rows_slots_as_the_reference_does():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    memory = _memory(2, 5, 2, 4, gen)
    slots = torch.tensor([3, 1, 4, 4, 4])  # slot 4: scratch of three padding rows
    due = torch.tensor([1, 0, 0, 0, 0])
    lens = torch.full((5,), 9, dtype=torch.int32)
    states = []
    for module in (reference, reuse):
        pages, selected_at, counters = state = _clone(memory)
        rows = module.gather_selections(pages, selected_at, slots, due, lens, PAGE, 3)
        module.store_selections(pages, selected_at, counters, slots, rows)
        states.append(state)
    (ref_pages, ref_at, ref_counters), (got_pages, got_at, got_counters) = states
    real = [0, 1, 2, 3]
    assert torch.equal(got_pages[:, real], ref_pages[:, real]) and torch.equal(got_at[real], ref_at[real])
    for want, got in zip(ref_counters, got_counters):
        assert torch.equal(got[real], want[real])


def test_bad_memories_and_rows_are_refused_before_any_launch():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    pages, selected_at, counters = _memory(2, 4, 2, 5, gen)
    slots = torch.tensor([0, 2])
    due = torch.zeros(2, dtype=torch.int64)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    for module in (reference, reuse):
        with pytest.raises(ValueError, match="budget_pages=6"):
            module.gather_selections(pages, selected_at, slots, due, lens, PAGE, 6)
        with pytest.raises(ValueError, match="selected_at must be"):
            module.gather_selections(pages, selected_at[:3], slots, due, lens, PAGE, 3)
        with pytest.raises(ValueError, match="slots must be"):
            module.gather_selections(pages, selected_at, slots.int(), due, lens, PAGE, 3)
        rows = reference.gather_selections(pages, selected_at, slots, due, lens, PAGE, 3)
        before = pages.clone()
        with pytest.raises(ValueError, match="rows.selected must be"):
            module.store_selections(pages, selected_at, counters, slots[:1], rows)
        assert torch.equal(pages, before)
    strided = pages.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, another layout
    with pytest.raises(ValueError, match="pages must be contiguous"):
        reuse.gather_selections(strided, selected_at, slots, due, lens, PAGE, 3)
    rows = reference.gather_selections(pages, selected_at, slots, due, lens, PAGE, 3)
    with pytest.raises(ValueError, match="pages must be contiguous"):
        reuse.store_selections(strided, selected_at, counters, slots, rows)
    assert torch.equal(strided, pages)


class SelectionMemoryMachine(RuleBasedStateMachine):
    """One memory kept by the reference ops and one by the kernels, through decode steps of random rows (each in a
    slot of its own), phases, growth (rows that keep their selection, that outgrow the extra columns) and
    forgotten slots; a step writes new selections into its active rows. Both must gather the same rows and hold the same memory and counters after every step."""

    LAYERS, HEADS, BUDGET, WIDTH, MAX_SEQS = 2, 3, 3, 5, 4

    @initialize(seed=st.integers(0, 2**31 - 1))
    def a_random_memory(self, seed):
        gen = torch.Generator().manual_seed(seed)
        memory = _memory(self.LAYERS, self.MAX_SEQS, self.HEADS, self.WIDTH, gen)
        self.memories = {reference: _clone(memory), reuse: _clone(memory)}
        self.lens = torch.randint(1, 12 * PAGE, (self.MAX_SEQS,), generator=gen, dtype=torch.int32)

    @rule(data=st.data())
    def step(self, data):
        batch = data.draw(st.integers(1, self.MAX_SEQS))
        slots = torch.tensor(data.draw(st.permutations(range(self.MAX_SEQS)))[:batch])
        due = torch.tensor(data.draw(st.lists(st.integers(0, 1), min_size=batch, max_size=batch)))
        grown = data.draw(st.lists(st.integers(1, 2 * PAGE * (self.WIDTH - self.BUDGET + 1)), min_size=batch,
                                   max_size=batch))
        self.lens[slots] += torch.tensor(grown, dtype=torch.int32)
        seed = data.draw(st.integers(0, 2**31 - 1))
        gathered = []
        for module, (pages, selected_at, counters) in self.memories.items():
            rows = module.gather_selections(pages, selected_at, slots, due, self.lens[slots], PAGE, self.BUDGET)
            gathered.append(tuple(t.clone() for t in rows))
            gen = torch.Generator().manual_seed(seed)
            new = torch.randint(0, 60, rows.selected.shape, generator=gen, dtype=torch.int32)
            rows.selected[..., :self.BUDGET].copy_(torch.where(rows.active.bool()[None, :, None, None],
                                                               new, rows.selected)[..., :self.BUDGET])
            module.store_selections(pages, selected_at, counters, slots, rows)
        for want, got in zip(*gathered):
            assert torch.equal(got, want)

    @rule(slot=st.integers(0, MAX_SEQS - 1))
    def forget(self, slot):
        for _, selected_at, _ in self.memories.values():
            selected_at[slot] = -1

    @invariant()
    def the_memories_agree(self):
        (ref_pages, ref_at, ref_counters), (pages, at, counters) = self.memories.values()
        assert torch.equal(pages, ref_pages) and torch.equal(at, ref_at)
        assert all(torch.equal(got, want) for got, want in zip(counters, ref_counters))


TestSelectionMemoryMachine = SelectionMemoryMachine.TestCase
TestSelectionMemoryMachine.settings = settings(max_examples=40, stateful_step_count=10, deadline=None)
