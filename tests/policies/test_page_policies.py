"""Page-selection policies: full, quest, oracle, quest-topp and quest-rerank (its low-bit key codes too) against
brute force."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from questkv.ops import reference
from questkv.policies import make_policy
from questkv.policies.rerank import KEY_BITS, quantize_within_bounds

HEADS = [(4, 2), (2, 2), (4, 1)]  # (q heads, kv heads): GQA, MHA, MQA


def true_page_mass(q, keys, page_size, num_kv_heads, selection, reduction, brute_probs):
    """``[num_sel_heads, num_pages]`` true attention mass per page for one sequence (float64)."""
    probs = brute_probs(q, keys)  # [Hq, len]
    num_pages = math.ceil(probs.shape[1] / page_size)
    padded = torch.nn.functional.pad(probs, (0, num_pages * page_size - probs.shape[1]))
    mass = padded.view(probs.shape[0], num_pages, page_size).sum(-1)
    if selection == "q_head":
        return mass
    grouped = mass.view(num_kv_heads, -1, num_pages)
    return grouped.sum(1) if reduction == "sum" else grouped.amax(1)


def captured_mass(pages, mass):
    """Mass ``[H]`` captured by a selection ``[H, k]`` under per-page masses ``[H, P]``."""
    return torch.stack([mass[h, [p for p in row.tolist() if p >= 0]].sum() for h, row in enumerate(pages)])


def assert_selection_format(pages, seq_lens, page_size):
    for b, n in enumerate(seq_lens.tolist()):
        num_pages = math.ceil(n / page_size)
        for row in pages[b].tolist():
            chosen = [p for p in row if p >= 0]
            assert row == chosen + [-1] * (len(row) - len(chosen))  # -1 padding at the end only
            assert chosen == sorted(set(chosen)) and all(0 <= p < num_pages for p in chosen)
            assert num_pages - 1 in chosen  # the current page is always attended


@pytest.mark.parametrize("num_q_heads, num_kv_heads", HEADS)
def test_full_is_dense_attention(random_cache, brute_probs, num_q_heads, num_kv_heads):
    cache = random_cache([21, 6, 13], num_kv_heads=num_kv_heads)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.randn(3, num_q_heads, 8) * 2
    result = make_policy("full", None, page_size=4).decode(q, layer, page_table, seq_lens)
    for b, (k, v) in enumerate(zip(cache.keys, cache.values)):
        probs = brute_probs(q[b], k)
        expected = torch.einsum("ht,thd->hd", probs, v.repeat_interleave(num_q_heads // num_kv_heads, 1).double())
        torch.testing.assert_close(result.out[b].double(), expected, rtol=1e-5, atol=1e-5)
        assert result.tokens_attended[b].tolist() == [4 * math.ceil(len(k) / 4)] * num_kv_heads
    assert_selection_format(result.pages, seq_lens, 4)


@pytest.mark.parametrize("num_q_heads, num_kv_heads", HEADS)
@pytest.mark.parametrize("selection, reduction", [("q_head", "sum"), ("kv_head", "sum"), ("kv_head", "max")])
def test_quest_is_the_reference_pipeline(random_cache, num_q_heads, num_kv_heads, selection, reduction):
    cache = random_cache([37, 9], num_kv_heads=num_kv_heads)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.randn(2, num_q_heads, 8) * 2 - 0.5
    policy = make_policy("quest", 12, page_size=4, selection=selection, group_reduction=reduction, sink_pages=1)
    result = policy.decode(q, layer, page_table, seq_lens)
    scores = reference.page_scores(q, layer.kmin, layer.kmax, page_table, seq_lens, 4, selection, reduction)
    pages = reference.select_pages(scores, seq_lens, 4, 3, sink_pages=1)
    assert torch.equal(result.pages, pages)
    expected = reference.paged_decode_attention(q, layer.k_pages, layer.v_pages, page_table, seq_lens, pages)
    torch.testing.assert_close(result.out, expected)
    heads = num_q_heads if selection == "q_head" else num_kv_heads
    assert result.pages.shape == (2, heads, 3)
    assert result.tokens_attended.tolist() == [[12] * heads, [12] * heads]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    heads=st.sampled_from(HEADS),
    mode=st.sampled_from([("q_head", "sum"), ("kv_head", "sum"), ("kv_head", "max")]),
    budget_pages=st.integers(1, 5),
    sink=st.integers(0, 1),
    recent=st.integers(0, 1),
)
def test_oracle_picks_the_true_top_pages(random_cache, brute_probs, seed, heads, mode, budget_pages, sink, recent):
    torch.manual_seed(seed)
    budget_pages = max(budget_pages, sink + recent + 1)
    (num_q_heads, num_kv_heads), (selection, reduction) = heads, mode
    lens = torch.randint(1, 40, (2,)).tolist()
    cache = random_cache(lens, num_kv_heads=num_kv_heads)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.randn(2, num_q_heads, 8) * 2
    policy = make_policy("oracle", 4 * budget_pages, page_size=4, selection=selection, group_reduction=reduction,
                         sink_pages=sink, recent_pages=recent)
    selection_out = policy.select(q, layer, page_table, seq_lens)
    assert_selection_format(selection_out.pages, seq_lens, 4)
    for b, k in enumerate(cache.keys):
        mass = true_page_mass(q[b], k, 4, num_kv_heads, selection, reduction, brute_probs)
        num_pages = mass.shape[1]
        forced = {p for p in range(num_pages) if p < sink or p >= num_pages - 1 - recent}
        for h, row in enumerate(selection_out.pages[b].tolist()):
            chosen = {p for p in row if p >= 0}
            assert len(chosen) == min(budget_pages, num_pages) == selection_out.num_pages[b, h]
            assert forced <= chosen
            free = sorted(chosen - forced)
            rest = [p for p in range(num_pages) if p not in chosen]
            if free and rest:  # every freely chosen page outweighs every page left out
                assert min(mass[h, free]) >= max(mass[h, rest]) - 1e-6


def test_oracle_captures_at_least_the_mass_of_any_page_selector(random_cache, brute_probs):
    torch.manual_seed(0)
    cache = random_cache([64, 50], num_kv_heads=2)
    layer, page_table, seq_lens = cache.step_inputs()
    for _ in range(5):
        q = torch.randn(2, 4, 8) * 3
        results = {
            name: make_policy(name, 16, page_size=4, selection="q_head").select(q, layer, page_table, seq_lens)
            for name in ("oracle", "quest", "quest-topp")
        }
        for b, k in enumerate(cache.keys):
            mass = true_page_mass(q[b], k, 4, 2, "q_head", "sum", brute_probs)
            oracle = captured_mass(results["oracle"].pages[b], mass)
            for name in ("quest", "quest-topp"):
                assert torch.all(oracle >= captured_mass(results[name].pages[b], mass) - 1e-9), name


def page_constant_cache(lens, page_size, num_kv_heads, head_dim, cache_of):
    """Keys identical within each page (Quest's bound is then exact), values random."""
    keys = [
        (torch.randn(math.ceil(n / page_size), num_kv_heads, head_dim) * 2).repeat_interleave(page_size, 0)[:n]
        for n in lens
    ]
    return cache_of(keys, [torch.randn(n, num_kv_heads, head_dim) for n in lens], page_size)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    top_p=st.floats(0.05, 1.0),
    budget_pages=st.integers(1, 12),
    heads=st.sampled_from(HEADS),
)
def test_topp_keeps_the_smallest_quest_ranked_prefix_reaching_p(cache_of, brute_probs, seed, top_p,
                                                                 budget_pages, heads):
    """With page-constant keys the estimate is the true page mass: brute-force the shortest prefix
    of the ranking (current page first, then by mass) whose mass reaches p, capped at K."""
    torch.manual_seed(seed)
    num_q_heads, num_kv_heads = heads
    page_size = 4
    lens = torch.randint(1, 48, (2,)).tolist()
    cache = page_constant_cache(lens, page_size, num_kv_heads, 8, cache_of)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.randn(2, num_q_heads, 8)
    policy = make_policy("quest-topp", page_size * budget_pages, page_size, selection="q_head", top_p=top_p)
    result = policy.select(q, layer, page_table, seq_lens)
    estimate = policy.estimated_mass(q, layer, page_table, seq_lens)
    assert_selection_format(result.pages, seq_lens, page_size)
    for b, k in enumerate(cache.keys):
        mass = true_page_mass(q[b], k, page_size, num_kv_heads, "q_head", "sum", brute_probs)
        num_pages = mass.shape[1]
        torch.testing.assert_close(estimate[b, :, :num_pages].double(), mass, rtol=1e-4, atol=1e-6)
        for h in range(num_q_heads):
            current = num_pages - 1
            ranking = [current] + sorted(range(current), key=lambda p: (-mass[h, p].item(), p))
            cumulative = mass[h, ranking].cumsum(0)
            reached = [i for i in range(num_pages) if cumulative[i] >= top_p - 1e-6]
            count = min(reached[0] + 1 if reached else num_pages, budget_pages)
            chosen = [p for p in result.pages[b, h].tolist() if p >= 0]
            assert result.num_pages[b, h] == len(chosen)
            # Float ties at the threshold may shift the count by one page; the mass rule must hold.
            assert abs(len(chosen) - count) <= 1
            got = mass[h, chosen].sum()
            if len(chosen) < min(budget_pages, num_pages):
                assert got >= top_p - 1e-4  # stopped only once p was reached
            if len(chosen) > 1:  # ... and not a page later than needed
                weakest = min((p for p in chosen if p != current), key=lambda p: mass[h, p])
                assert got - mass[h, weakest] < top_p + 1e-4


@pytest.mark.parametrize(
    "top_p, budget_pages, expected",
    [
        # page masses: .0055 .1112 .0151 .8218 .0409 .0055; ranking 5 (current), 3, 1, 4, 2, 0
        (0.5, 6, [3, 5]),  # .0055 + .8218 >= .5
        (0.85, 6, [1, 3, 5]),  # .8273 < .85 <= .9385
        (0.99, 6, [1, 2, 3, 4, 5]),  # .9794 < .99 <= .9945
        (1.0, 6, [0, 1, 2, 3, 4, 5]),
        (0.99, 3, [1, 3, 5]),  # capped at K = 3 pages
    ],
)
def test_topp_hand_made_pattern_and_cap(cache_of, top_p, budget_pages, expected):
    """One head, page-constant keys on one axis: page masses are softmax(logits) exactly."""
    page_size, head_dim = 2, 4
    logits = torch.tensor([0.0, 3.0, 1.0, 5.0, 2.0, 0.0])  # page 5 is the current page
    keys = torch.randn(12, 1, head_dim)  # only dim 0 meets a nonzero query component
    keys[:, 0, 0] = logits.repeat_interleave(page_size)
    cache = cache_of([keys], [torch.randn(12, 1, head_dim)], page_size)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.zeros(1, 1, head_dim)
    q[0, 0, 0] = head_dim**0.5  # scaled scores equal `logits`
    policy = make_policy("quest-topp", page_size * budget_pages, page_size, top_p=top_p)
    result = policy.select(q, layer, page_table, seq_lens)
    torch.testing.assert_close(policy.estimated_mass(q, layer, page_table, seq_lens)[0, 0], torch.softmax(logits, 0))
    assert [p for p in result.pages[0, 0].tolist() if p >= 0] == expected
    assert result.num_pages.tolist() == [[len(expected)]]


def test_topp_floor_keeps_the_top_of_the_ranking(cache_of):
    """The hand-made pattern above: top_p=0.5 needs pages {3, 5}; a floor of 3 pages adds page 1 (the
    next by mass); a floor of the whole budget is plain Quest."""
    page_size, head_dim = 2, 4
    logits = torch.tensor([0.0, 3.0, 1.0, 5.0, 2.0, 0.0])
    keys = torch.randn(12, 1, head_dim)
    keys[:, 0, 0] = logits.repeat_interleave(page_size)
    cache = cache_of([keys], [torch.randn(12, 1, head_dim)], page_size)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.zeros(1, 1, head_dim)
    q[0, 0, 0] = head_dim**0.5
    for floor, expected in [(0, [3, 5]), (2, [3, 5]), (6, [1, 3, 5]), (8, [1, 3, 4, 5])]:
        policy = make_policy("quest-topp", 8, page_size, top_p=0.5, min_budget=floor)
        pages = policy.select(q, layer, page_table, seq_lens).pages
        assert [p for p in pages[0, 0].tolist() if p >= 0] == expected, floor
    quest = make_policy("quest", 8, page_size).select(q, layer, page_table, seq_lens).pages
    assert torch.equal(make_policy("quest-topp", 8, page_size, top_p=0.5, min_budget=8)
                       .select(q, layer, page_table, seq_lens).pages, quest)


RERANK_MODES = [("q_head", "sum"), ("kv_head", "sum"), ("kv_head", "max")]


@pytest.mark.parametrize("key_bits", [None, 1, 2])
@pytest.mark.parametrize("rerank", ["max", "mass"])
def test_rerank_drops_a_loose_page_that_quest_picks(cache_of, rerank, key_bits):
    """Page 0 mixes two keys, each large on one of the query's two axes: its bound (6) is loose, its
    best logit 3. Page 1's keys both sit on the diagonal: bound and best logit 5. Quest (one free
    page) takes page 0; the rerank, shortlisting both, takes page 1."""
    page_size, head_dim = 2, 6
    keys = torch.randn(6, 1, head_dim)  # the query is zero past dim 1: those dims never count
    keys[:, 0, :2] = torch.tensor([[3.0, 0.0], [0.0, 3.0], [2.5, 2.5], [2.5, 2.5], [-1.0, -1.0], [-1.0, -1.0]])
    cache = cache_of([keys], [torch.randn(6, 1, head_dim)], page_size)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.zeros(1, 1, head_dim)
    q[0, 0, :2] = 1.0
    quest = make_policy("quest", 4, page_size).select(q, layer, page_table, seq_lens)
    assert quest.pages.tolist() == [[[0, 2]]]
    policy = make_policy("quest-rerank", 4, page_size, shortlist=2, rerank=rerank, key_bits=key_bits)
    assert policy.shortlist_pages(q, layer, page_table, seq_lens).tolist() == [[[0, 1, 2, -1]]]
    result = policy.decode(q, layer, page_table, seq_lens)
    assert result.pages.tolist() == [[[1, 2]]] and result.tokens_attended.tolist() == [[4]]
    if rerank == "max" and key_bits is None:
        shortlisted = torch.tensor([[[True, True, True]]])
        scores = policy.rerank_scores(q, layer, page_table, seq_lens, shortlisted)
        torch.testing.assert_close(scores, torch.tensor([[[3.0, 5.0, -2.0]]]))


@pytest.mark.parametrize("num_q_heads, num_kv_heads", HEADS)
@pytest.mark.parametrize("selection, reduction", RERANK_MODES)
@pytest.mark.parametrize("rerank, key_bits", [("max", None), ("mass", None), ("max", 2), ("mass", 1)])
def test_rerank_with_a_budget_covering_the_context_is_dense(random_cache, brute_probs, num_q_heads, num_kv_heads,
                                                            selection, reduction, rerank, key_bits):
    lens = [37, 9, 22]
    cache = random_cache(lens, num_kv_heads=num_kv_heads)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.randn(3, num_q_heads, 8) * 2
    policy = make_policy("quest-rerank", 40, page_size=4, shortlist=2, rerank=rerank, selection=selection,
                         group_reduction=reduction, key_bits=key_bits)
    result = policy.decode(q, layer, page_table, seq_lens)
    for b, (k, v) in enumerate(zip(cache.keys, cache.values)):
        probs = brute_probs(q[b], k)
        expected = torch.einsum("ht,thd->hd", probs, v.repeat_interleave(num_q_heads // num_kv_heads, 1).double())
        torch.testing.assert_close(result.out[b].double(), expected, rtol=1e-5, atol=1e-5)
    assert_selection_format(result.pages, seq_lens, 4)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    heads=st.sampled_from(HEADS),
    mode=st.sampled_from(RERANK_MODES),
    rerank=st.sampled_from(["max", "mass"]),
    budget_pages=st.integers(1, 5),
    sink=st.integers(0, 1),
    recent=st.integers(0, 1),
)
def test_rerank_with_shortlist_one_is_quest(random_cache, seed, heads, mode, rerank, budget_pages, sink, recent):
    torch.manual_seed(seed)
    budget_pages = max(budget_pages, sink + recent + 1)
    (num_q_heads, num_kv_heads), (selection, reduction) = heads, mode
    cache = random_cache(torch.randint(1, 40, (2,)).tolist(), num_kv_heads=num_kv_heads)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.randn(2, num_q_heads, 8) * 2
    options = dict(selection=selection, group_reduction=reduction, sink_pages=sink, recent_pages=recent)
    quest = make_policy("quest", 4 * budget_pages, page_size=4, **options).decode(q, layer, page_table, seq_lens)
    rerank_policy = make_policy("quest-rerank", 4 * budget_pages, page_size=4, shortlist=1, rerank=rerank, **options)
    result = rerank_policy.decode(q, layer, page_table, seq_lens)
    assert torch.equal(result.pages, quest.pages)
    assert torch.equal(result.out, quest.out) and torch.equal(result.tokens_attended, quest.tokens_attended)


def exact_page_max(q, keys, page_size):
    """``[Hq, P]`` float64 max logit ``q_h . k_t`` over each page's tokens, one sequence, brute force."""
    group = q.shape[0] // keys.shape[1]
    logits = torch.einsum("hd,thd->ht", q.double(), keys.repeat_interleave(group, 1).double())
    num_pages = math.ceil(logits.shape[1] / page_size)
    return torch.stack([logits[:, p * page_size:(p + 1) * page_size].amax(-1) for p in range(num_pages)], dim=1)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    heads=st.sampled_from(HEADS),
    mode=st.sampled_from(RERANK_MODES),
    shortlist=st.integers(1, 4),
    budget_pages=st.integers(1, 4),
    sink=st.integers(0, 1),
)
def test_rerank_max_keeps_the_shortlists_best_pages(random_cache, seed, heads, mode, shortlist, budget_pages, sink):
    """The selection lies in Quest's shortlist, holds the forced pages, and every freely chosen page
    scores (exact max logit, combined over the group as Quest combines) at least every shortlisted
    page left out."""
    torch.manual_seed(seed)
    budget_pages = max(budget_pages, sink + 1)
    (num_q_heads, num_kv_heads), (selection, reduction) = heads, mode
    cache = random_cache(torch.randint(1, 48, (2,)).tolist(), num_kv_heads=num_kv_heads)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.randn(2, num_q_heads, 8) * 2
    policy = make_policy("quest-rerank", 4 * budget_pages, page_size=4, shortlist=shortlist, selection=selection,
                         group_reduction=reduction, sink_pages=sink)
    result = policy.select(q, layer, page_table, seq_lens)
    short = policy.shortlist_pages(q, layer, page_table, seq_lens)
    assert_selection_format(result.pages, seq_lens, 4)
    for b, k in enumerate(cache.keys):
        best = exact_page_max(q[b], k, 4)
        if selection == "kv_head":
            grouped = best.view(num_kv_heads, -1, best.shape[1])
            best = grouped.sum(1) if reduction == "sum" else grouped.amax(1)
        num_pages = best.shape[1]
        forced = {p for p in range(num_pages) if p < sink or p == num_pages - 1}
        for h, row in enumerate(result.pages[b].tolist()):
            chosen = {p for p in row if p >= 0}
            listed = {p for p in short[b, h].tolist() if p >= 0}
            assert forced <= chosen <= listed and len(chosen) == min(budget_pages, num_pages)
            free, rest = sorted(chosen - forced), sorted(listed - chosen)
            if free and rest:
                assert min(best[h, free]) >= max(best[h, rest]) - 1e-4


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("selection, reduction", RERANK_MODES)
def test_rerank_mass_over_every_page_is_the_oracle(random_cache, brute_probs, seed, selection, reduction):
    """A shortlist covering the context makes ``rerank="mass"`` the true page mass: the oracle's pick."""
    torch.manual_seed(seed)
    cache = random_cache([45, 30], num_kv_heads=2)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.randn(2, 4, 8) * 2
    options = dict(selection=selection, group_reduction=reduction)
    oracle = make_policy("oracle", 12, page_size=4, **options).select(q, layer, page_table, seq_lens)
    rerank = make_policy("quest-rerank", 12, page_size=4, shortlist=4, rerank="mass", **options)
    assert torch.equal(rerank.select(q, layer, page_table, seq_lens).pages, oracle.pages)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_low_bit_keys_decode_inside_their_page_bounds_within_half_a_cell(bits):
    pages, page_size, heads, dim = 5, 4, 2, 8
    keys = torch.randn(pages, page_size, heads, dim) * 3
    keys[2, :, 1, 3] = 0.7  # a channel whose bounds are a point decodes exactly
    kmin, kmax = keys.amin(1), keys.amax(1)
    decoded = quantize_within_bounds(keys, kmin, kmax, bits)
    half_cell = ((kmax - kmin) / 2**bits / 2).unsqueeze(1)
    assert ((decoded - keys).abs() <= half_cell + 1e-5).all()
    assert ((decoded >= kmin.unsqueeze(1) - 1e-6) & (decoded <= kmax.unsqueeze(1) + 1e-6)).all()
    assert (decoded[2, :, 1, 3] == 0.7).all()
    assert decoded.unique().numel() <= pages * heads * dim * 2**bits


def test_low_bit_rerank_over_every_page_tracks_the_exact_rerank_as_bits_grow(random_cache):
    """With a shortlist covering every page, 8-bit codes pick what the exact keys pick far more often
    than 1-bit codes do (the codes converge to the keys)."""
    cache = random_cache([160, 120], num_kv_heads=2)
    layer, page_table, seq_lens = cache.step_inputs()
    agree = {}
    for bits in (1, 8):
        same = 0
        for _ in range(8):
            q = torch.randn(2, 4, 8) * 2
            exact = make_policy("quest-rerank", 16, page_size=4, shortlist=64).select(q, layer, page_table, seq_lens)
            coded = make_policy("quest-rerank", 16, page_size=4, shortlist=64, key_bits=bits).select(
                q, layer, page_table, seq_lens)
            same += (exact.pages == coded.pages).float().mean().item()
        agree[bits] = same / 8
    assert agree[8] > 0.95 and agree[8] > agree[1]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("selection, reduction", RERANK_MODES)
def test_low_bit_max_scores_approach_the_exact_max_logit_as_bits_grow(random_cache, seed, selection, reduction):
    """With a shortlist covering every page, the max rerank's scores from codes approach its scores from the exact
    keys as the width grows: the error shrinks at every width, and 8 bits is within 1 %."""
    torch.manual_seed(seed)
    cache = random_cache([31, 20], num_kv_heads=2, head_dim=32)
    layer, page_table, seq_lens = cache.step_inputs()
    q = torch.randn(2, 8, 32)
    sel_heads = 8 if selection == "q_head" else 2
    shortlisted = reference.valid_pages(seq_lens, 4, page_table.shape[1])[:, None].expand(2, sel_heads, -1)

    def scores(key_bits):
        policy = make_policy("quest-rerank", 8, page_size=4, shortlist=64, selection=selection,
                             group_reduction=reduction, key_bits=key_bits)
        return policy.rerank_scores(q, layer, page_table, seq_lens, shortlisted)

    exact = scores(None)
    finite = torch.isfinite(exact)
    assert torch.equal(finite, shortlisted)
    errors = {}
    for bits in KEY_BITS:
        coded = scores(bits)
        assert torch.equal(torch.isfinite(coded), finite)
        errors[bits] = ((coded[finite] - exact[finite]).norm() / exact[finite].norm()).item()
    assert errors[1] > errors[2] > errors[4] > errors[8], errors
    assert errors[8] < 1e-2, errors


@pytest.mark.parametrize("key_bits", [None, 8])
@pytest.mark.parametrize("selection, reduction", RERANK_MODES)
def test_mass_ranks_first_the_page_holding_the_mass_without_the_best_logit(cache_of, key_bits, selection, reduction):
    """Page 0 holds the best logit (one key at 6 on the query's axis, the rest at -10), page 1 the mass (eight
    keys at 5: 8 e^5 > e^6 at sm_scale 1), page 2 little of either, page 3 is the current page: "mass" ranks
    page 1 first and selects it with a budget of two pages, "max" ranks page 0 first and selects that."""
    gen = torch.Generator().manual_seed(0)
    page_size, head_dim, noise = 8, 16, 0.01
    keys = torch.randn(3 * page_size + 2, 1, head_dim, generator=gen)
    keys[:, 0, 0] = -10.0
    keys[3, 0, 0] = 6.0
    keys[page_size:2 * page_size, 0, 0] = 5.0
    keys[2 * page_size:3 * page_size, 0, 0] = torch.rand(page_size, generator=gen) - 2.0
    cache = cache_of([keys], [torch.randn(keys.shape, generator=gen)], page_size)
    layer, page_table, seq_lens = cache.step_inputs()
    q = noise * torch.randn(1, 2, head_dim, generator=gen)
    q[:, :, 0] = 1.0 + noise * torch.rand(1, 2, generator=gen)
    for rerank, best in (("mass", 1), ("max", 0)):
        policy = make_policy("quest-rerank", 2 * page_size, page_size, shortlist=2, rerank=rerank, key_bits=key_bits,
                             selection=selection, group_reduction=reduction)
        shortlisted = policy.shortlist_pages(q, layer, page_table, seq_lens)
        assert (shortlisted[0] == torch.arange(4, dtype=torch.int32)).all()  # the shortlist covers every page
        every_page = torch.ones(shortlisted.shape[:2] + page_table.shape[1:], dtype=torch.bool)
        scores = policy.rerank_scores(q, layer, page_table, seq_lens, every_page, sm_scale=1.0)
        assert (scores[0, :, :3].argmax(-1) == best).all(), (rerank, scores)
        pages = policy.select(q, layer, page_table, seq_lens, sm_scale=1.0).pages
        assert (pages[0] == torch.tensor([best, 3], dtype=torch.int32)).all(), (rerank, pages)
