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
    bad = [
        ("active", (active.long(), q, queries, slots, forced, thresholds, selected)),
        ("active", (torch.zeros(2, 3, dtype=torch.int32), q, queries, slots, forced, thresholds, selected)),
        ("slots", (active, q, queries, slots.int(), forced, thresholds, selected)),
        ("thresholds", (active, q, queries, slots, forced, thresholds.double(), selected)),
        ("queries", (active, q, queries[:, :1], slots, forced, thresholds, selected)),
        ("selected", (active, q, queries, slots, forced, thresholds, selected[..., :2])),
    ]
    for module in (reference, reselect):
        for name, args in bad:
            with pytest.raises(ValueError, match=name):
                module.reselect_heads_into(*args, BUDGET_PAGES)


@pytest.mark.parametrize("selection", ["kv_head", "q_head"])
def test_a_decode_step_with_reselection_matches_the_torch_backends(selection):
    """``QuestDecodeStep.sparse`` with a :class:`Reselection` (reselect, then per-head estimate and select, then
    attend) on the Triton backend (interpreter) against the torch backend: the same flags, memory, selections and,
    within float tolerance, output. Row 0 is forced, row 1 decides per head; one of its heads keeps its selection."""
    from questkv.config import QuestConfig
    from questkv.decode.step import QuestDecodeStep, Reselection
    from questkv.ops import LayerPages

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    num_q, num_kv, head_dim, page_size, max_pages = 4, 2, 16, 4, 8
    heads = num_q if selection == "q_head" else num_kv
    lens = torch.tensor([29, 23], dtype=torch.int32)
    k_pages = torch.randn(16, page_size, num_kv, head_dim, generator=gen)
    v_pages = torch.randn(16, page_size, num_kv, head_dim, generator=gen)
    layer = LayerPages(k_pages, v_pages, k_pages.amin(1), k_pages.amax(1))
    table = torch.randperm(16, generator=gen)[:2 * max_pages].view(2, max_pages).int()
    q = torch.randn(2, num_q, head_dim, generator=gen)
    queries = torch.randn(3, heads, num_q // heads * head_dim, generator=gen)
    slots = torch.tensor([2, 0])
    queries[0, 0] = q.reshape(2, heads, -1)[1, 0]  # row 1's head 0 keeps its selection
    forced = torch.tensor([1, 0], dtype=torch.int32)
    thresholds = torch.tensor([0.5, 0.5])
    config = dict(token_budget=12, page_size=page_size, dense_layers=0, selection=selection, selection_interval=5,
                  reselect_similarity=0.5)
    results = {}
    for backend in ("triton", "torch"):
        cfg = QuestConfig(backend=backend, **config)
        step = QuestDecodeStep(cfg, 2, num_q, num_kv, head_dim, max_pages, torch.float32, "cpu")
        selected = torch.randint(0, 6, (2, heads, cfg.budget_pages + cfg.reuse_extra_pages), generator=gen)
        selected = selected.int() if backend == "triton" else results["triton"][3]
        before = selected.clone()
        reselection = Reselection(queries.clone(), slots, thresholds, torch.empty(2, heads, dtype=torch.int32))
        out = step.sparse(q, layer, table, lens, None, None, forced, selected, reselection).clone()
        results[backend] = (out, reselection.head_active, reselection.queries, before, selected)
    (out, flags, memory, before, chosen), (ref_out, ref_flags, ref_memory, _, ref_chosen) = results.values()
    assert torch.equal(flags, ref_flags) and torch.equal(memory, ref_memory) and torch.equal(chosen, ref_chosen)
    assert flags[0].all() and flags[1, 0] == 0
    assert torch.equal(chosen[1, 0], before[1, 0])  # a keeping head's selection, its extra columns included
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
