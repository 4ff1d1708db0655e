"""The reselect kernel (adaptive selection reuse) against the torch reference, under the Triton interpreter (CPU):
the same flags, the same stored queries and the same cleared selection columns, bit for bit; nothing of a head
that keeps its selection is written."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from questkv.ops import reference  # noqa: E402
from questkv.ops.triton import reselect  # noqa: E402

BUDGET_PAGES, WIDTH = 3, 5


def _case(selection: str, dtype: torch.dtype, gen: torch.Generator):
    """Two rows in slots 2 and 0 of a 3-slot memory: row 0 forced, row 1 not. Row 1's KV head / query head 0
    keeps (its last query is its query scaled: similarity 1 > threshold), head 1's last query points the
    other way (similarity -1: reselects at any threshold above -1), the rest are random."""
    num_q, num_kv, head_dim = 4, 2, 8
    heads = num_q if selection == "q_head" else num_kv
    q = torch.randn(2, num_q, head_dim, generator=gen).to(dtype)
    queries = torch.randn(3, heads, num_q // heads * head_dim, generator=gen).to(dtype)
    slots = torch.tensor([2, 0])
    grouped = q.reshape(2, heads, -1)
    queries[0, 0] = grouped[1, 0] * 2
    queries[0, 1] = -grouped[1, 1]
    forced = torch.tensor([1, 0], dtype=torch.int32)
    thresholds = torch.tensor([0.3, 0.5], dtype=torch.float32)
    selected = torch.randint(0, 50, (2, heads, WIDTH), generator=gen, dtype=torch.int32)
    active = torch.randint(0, 2, (2, heads), generator=gen, dtype=torch.int32)
    return active, q, queries, slots, forced, thresholds, selected


@pytest.mark.parametrize("selection", ["kv_head", "q_head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_gives_the_references_flags_queries_and_selections_bit_for_bit(selection, dtype):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    args = _case(selection, dtype, gen)
    active, q, queries, slots, forced, thresholds, selected = args
    results = []
    for module in (reference, reselect):
        outs = [active.clone(), q, queries.clone(), slots, forced, thresholds, selected.clone()]
        module.reselect_heads_into(*outs, BUDGET_PAGES)
        results.append((outs[0], outs[2], outs[6]))
    (ref_active, ref_queries, ref_selected), (got_active, got_queries, got_selected) = results
    assert torch.equal(got_active, ref_active) and torch.equal(got_queries, ref_queries)
    assert torch.equal(got_selected, ref_selected)
    assert ref_active[0].tolist() == [1] * active.shape[1]  # forced row: every head
    assert ref_active[1, :2].tolist() == [0, 1]  # kept direction / turned round
    kept = ref_active == 0
    grouped = q.reshape(2, active.shape[1], -1)
    assert torch.equal(ref_queries[slots][~kept], grouped[~kept])  # a reselecting head's query is stored
    assert torch.equal(ref_queries[slots][kept], queries[slots][kept])  # a keeping head's is untouched
    assert torch.equal(ref_queries[1], queries[1])  # a slot of no row
    assert (ref_selected[..., BUDGET_PAGES:][~kept] == -1).all()
    assert torch.equal(ref_selected[kept], selected[kept])
    assert torch.equal(ref_selected[..., :BUDGET_PAGES], selected[..., :BUDGET_PAGES])


def test_a_threshold_of_minus_one_never_reselects_and_of_one_reselects_a_changed_query():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    active, q, queries, slots, _, _, selected = _case("kv_head", torch.float32, gen)
    forced = torch.zeros(2, dtype=torch.int32)
    for module in (reference, reselect):
        flags = module.reselect_heads_into(active.clone(), q, queries.clone(), slots, forced,
                                           torch.full((2,), -1.0), selected.clone(), BUDGET_PAGES)
        assert not flags.any()
        flags = module.reselect_heads_into(active.clone(), q, queries.clone(), slots, forced,
                                           torch.full((2,), 1.0), selected.clone(), BUDGET_PAGES)
        assert flags[0].tolist() == [1, 1] and flags[1, 1] == 1  # random or turned-round queries


def test_bad_arguments_are_refused_naming_them():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    active, q, queries, slots, forced, thresholds, selected = _case("kv_head", torch.float32, gen)
    bad = {
        "active": (active.long(), q, queries, slots, forced, thresholds, selected),
        "slots": (active, q, queries, slots.int(), forced, thresholds, selected),
        "thresholds": (active, q, queries, slots, forced, thresholds.double(), selected),
        "queries": (active, q, queries[:, :1], slots, forced, thresholds, selected),
        "selected": (active, q, queries, slots, forced, thresholds, selected[..., :2]),
    }
    for module in (reference, reselect):
        for name, args in bad.items():
            with pytest.raises(ValueError, match=name):
                module.reselect_heads_into(*args, BUDGET_PAGES)
