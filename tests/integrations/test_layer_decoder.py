"""LayerDecoder: per-layer routes decided once, the decode step objects it reuses, its budget
accounting (against the reference ops and the page policies), per-sequence budgets and the policy
state it keeps in a DecodeState (fp32, CPU, torch reference backend)."""

import copy
import subprocess
import sys

import pytest
import torch

from questkv.cache.paged import PagedKVCache
from questkv.config import QuestConfig
from questkv.decode.step import QuestDecodeStep
from questkv.integrations.layer_decoder import DecodeState, LayerDecoder
from questkv.ops import reference
from questkv.policies import make_policy

PAGE = 4
LAYERS = 4
Q_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
LENGTHS = [5, 37, 20]  # 2, 10 and 5 pages: the first row holds fewer pages than the budget below
SCALE = 0.3


def seed() -> int:
    return int(torch.randint(0, 10**6, ()))


def filled_pool(lengths=LENGTHS, generator=None) -> tuple[PagedKVCache, list[int]]:
    """A page pool of ``LAYERS`` layers holding random keys/values for sequences of ``lengths``."""
    generator = generator or torch.Generator().manual_seed(seed())
    pool = PagedKVCache(LAYERS, KV_HEADS, HEAD_DIM, num_pages=64, page_size=PAGE, max_seqs=4)
    ids = [pool.add_sequence() for _ in lengths]
    shape = (LAYERS, sum(lengths), KV_HEADS, HEAD_DIM)
    pool.append(ids, lengths, torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    return pool, ids


def add_token(pool: PagedKVCache, ids: list[int], generator: torch.Generator) -> None:
    shape = (LAYERS, len(ids), KV_HEADS, HEAD_DIM)
    pool.append(ids, [1] * len(ids), torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))


def queries(batch: int, generator: torch.Generator) -> torch.Tensor:
    return 3.0 * torch.randn(batch, Q_HEADS, HEAD_DIM, generator=generator)


def reference_quest(config: QuestConfig, q, layer, page_table, seq_lens, budgets=None):
    """Quest from the reference ops directly: ``(out, selected)``."""
    scores = reference.page_scores(
        q, layer.kmin, layer.kmax, page_table, seq_lens, PAGE, config.selection, config.group_reduction
    )
    selected = reference.select_pages(
        scores, seq_lens, PAGE, config.budget_pages, config.sink_pages, config.recent_pages, budgets
    )
    return reference.paged_decode_attention(q, layer.k_pages, layer.v_pages, page_table, seq_lens, selected, SCALE), selected


def charged(selected: torch.Tensor) -> torch.Tensor:
    """``[batch]`` float64 tokens a selection attends, mean over its selection heads."""
    return (selected >= 0).sum(-1).double().mean(1) * PAGE


# -- routes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("selection", ["kv_head", "q_head"])
def test_layers_below_dense_layers_are_dense_and_the_rest_are_quest(selection):
    generator = torch.Generator().manual_seed(seed())
    config = QuestConfig(token_budget=3 * PAGE, page_size=PAGE, dense_layers=2, selection=selection, backend="torch")
    decoder = LayerDecoder(config, LAYERS)
    assert decoder.routes == ("dense", "dense", "sparse", "sparse")
    pool, ids = filled_pool(generator=generator)
    page_table, seq_lens = pool.batch(ids)
    for layer_idx in range(LAYERS):
        q = queries(len(ids), generator)
        layer = pool.layer(layer_idx)
        out = decoder.decode(layer_idx, q, layer, page_table, seq_lens, SCALE).clone()
        if layer_idx < 2:
            expected = reference.paged_decode_attention(q, layer.k_pages, layer.v_pages, page_table, seq_lens, None, SCALE)
        else:
            expected, _ = reference_quest(config, q, layer, page_table, seq_lens)
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    # Not vacuous: on a sparse layer Quest differs from dense attention.
    dense = reference.paged_decode_attention(q, layer.k_pages, layer.v_pages, page_table, seq_lens, None, SCALE)
    assert (out - dense).abs().max() > 1e-3


def test_dense_config_decodes_every_layer_densely_and_charges_nothing():
    decoder = LayerDecoder(QuestConfig(token_budget=None, page_size=PAGE, dense_layers=1), LAYERS)
    assert decoder.routes == ("dense",) * LAYERS
    generator = torch.Generator().manual_seed(seed())
    pool, ids = filled_pool(generator=generator)
    page_table, seq_lens = pool.batch(ids)
    state = DecodeState()
    for layer_idx in range(LAYERS):
        q = queries(len(ids), generator)
        layer = pool.layer(layer_idx)
        out = decoder.decode(layer_idx, q, layer, page_table, seq_lens, SCALE, state=state)
        expected = reference.paged_decode_attention(q, layer.k_pages, layer.v_pages, page_table, seq_lens, None, SCALE)
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    assert state.sparse_steps == 0 and state.mean_tokens_attended is None
    with pytest.raises(ValueError, match="needs a sparse QuestConfig"):
        decoder.tokens_attended(seq_lens)


def test_a_policy_takes_the_layers_from_dense_layers_on():
    policy = make_policy("quest", 3 * PAGE, page_size=PAGE)
    decoder = LayerDecoder(QuestConfig(token_budget=None, page_size=PAGE, dense_layers=1), LAYERS, policy)
    assert decoder.routes == ("dense", "policy", "policy", "policy")


def test_routes_are_decided_once_not_per_decode_step(monkeypatch):
    config = QuestConfig(token_budget=3 * PAGE, page_size=PAGE, dense_layers=2)
    decoder = LayerDecoder(config, LAYERS)
    built = []
    original = QuestConfig.__post_init__
    monkeypatch.setattr(QuestConfig, "__post_init__", lambda self: built.append(self) or original(self))
    generator = torch.Generator().manual_seed(seed())
    pool, ids = filled_pool(generator=generator)
    for _ in range(3):
        add_token(pool, ids, generator)
        page_table, seq_lens = pool.batch(ids)
        for layer_idx in range(LAYERS):
            decoder.decode(layer_idx, queries(len(ids), generator), pool.layer(layer_idx), page_table, seq_lens)
    assert built == []  # no QuestConfig is built or re-validated per layer or step


# -- the step objects --------------------------------------------------------------------------------


def test_one_step_per_decode_shape_is_built_and_reused(monkeypatch):
    decoder = LayerDecoder(QuestConfig(token_budget=3 * PAGE, page_size=PAGE, dense_layers=2), LAYERS, max_cached_steps=2)
    used = []
    original_dense, original_sparse = QuestDecodeStep.dense, QuestDecodeStep.sparse
    monkeypatch.setattr(QuestDecodeStep, "dense", lambda self, *a, **k: used.append(self) or original_dense(self, *a, **k))
    monkeypatch.setattr(QuestDecodeStep, "sparse", lambda self, *a, **k: used.append(self) or original_sparse(self, *a, **k))
    generator = torch.Generator().manual_seed(seed())
    pool, ids = filled_pool(generator=generator)
    page_table, seq_lens = pool.batch(ids)
    for _ in range(2):
        for layer_idx in range(LAYERS):
            decoder.decode(layer_idx, queries(len(ids), generator), pool.layer(layer_idx), page_table, seq_lens)
    assert len(used) == 2 * LAYERS and all(step is used[0] for step in used)  # one step serves every layer
    assert (used[0].batch, used[0].max_pages) == (len(ids), page_table.shape[1])
    step = decoder.step(len(ids), Q_HEADS, KV_HEADS, HEAD_DIM, page_table.shape[1], torch.float32, "cpu")
    assert step is used[0]
    wider = decoder.step(len(ids), Q_HEADS, KV_HEADS, HEAD_DIM, page_table.shape[1] + 1, torch.float32, "cpu")
    assert wider is not step and wider.max_pages == page_table.shape[1] + 1
    smaller = decoder.step(1, Q_HEADS, KV_HEADS, HEAD_DIM, page_table.shape[1], torch.float32, "cpu")
    assert smaller.batch == 1
    # max_cached_steps=2: the least recently used shape (the first) was dropped and is rebuilt.
    assert decoder.step(len(ids), Q_HEADS, KV_HEADS, HEAD_DIM, page_table.shape[1], torch.float32, "cpu") is not step


def test_a_deep_copy_shares_the_decoder():
    decoder = LayerDecoder(QuestConfig(token_budget=3 * PAGE, page_size=PAGE), LAYERS)
    assert copy.deepcopy(decoder) is decoder
    assert copy.deepcopy({"decoder": decoder})["decoder"] is decoder


# -- accounting --------------------------------------------------------------------------------------


@pytest.mark.parametrize("selection", ["kv_head", "q_head"])
def test_quest_accounting_equals_the_reference_selection_and_the_quest_policy(selection):
    generator = torch.Generator().manual_seed(seed())
    budget = 3 * PAGE
    config = QuestConfig(token_budget=budget, page_size=PAGE, dense_layers=1, selection=selection)
    decoder = LayerDecoder(config, LAYERS)
    policy_decoder = LayerDecoder(
        QuestConfig(token_budget=None, page_size=PAGE, dense_layers=1), LAYERS,
        make_policy("quest", budget, page_size=PAGE, selection=selection),
    )
    pool, ids = filled_pool(generator=generator)
    state, policy_state = DecodeState(), DecodeState()
    expected = torch.zeros(len(ids), dtype=torch.float64)
    steps = 3
    for _ in range(steps):
        add_token(pool, ids, generator)
        page_table, seq_lens = pool.batch(ids)
        for layer_idx in range(LAYERS):
            q, layer = queries(len(ids), generator), pool.layer(layer_idx)
            out = decoder.decode(layer_idx, q, layer, page_table, seq_lens, SCALE, state=state).clone()
            by_policy = policy_decoder.decode(layer_idx, q, layer, page_table, seq_lens, SCALE, state=policy_state)
            torch.testing.assert_close(out, by_policy, atol=1e-6, rtol=0)
            if layer_idx >= 1:
                expected += charged(reference_quest(config, q, layer, page_table, seq_lens)[1])
    sparse_steps = steps * (LAYERS - 1)
    assert state.sparse_steps == policy_state.sparse_steps == sparse_steps
    torch.testing.assert_close(state.tokens_attended_sum, expected, atol=0, rtol=0)
    torch.testing.assert_close(policy_state.tokens_attended_sum, expected, atol=0, rtol=0)
    per_sequence = state.mean_tokens_attended_per_sequence
    # Rows shorter than the budget are charged their pages, the others the budget.
    pages = [[-(-(n + t) // PAGE) for t in range(1, steps + 1)] for n in LENGTHS]
    manual = torch.tensor([sum(min(p, budget // PAGE) * PAGE for p in row) / steps for row in pages], dtype=torch.float64)
    torch.testing.assert_close(per_sequence, manual, atol=0, rtol=0)
    assert state.mean_tokens_attended == pytest.approx(float(manual.mean()))
    assert per_sequence[0] < budget and per_sequence[1] == budget  # not vacuous: both cases occur


@pytest.mark.parametrize("sink_pages,recent_pages", [(0, 0), (1, 0)])
def test_per_sequence_budgets_select_and_charge_each_sequence_its_own(sink_pages, recent_pages):
    generator = torch.Generator().manual_seed(seed())
    config = QuestConfig(token_budget=4 * PAGE, page_size=PAGE, dense_layers=1, sink_pages=sink_pages,
                         recent_pages=recent_pages)
    decoder = LayerDecoder(config, LAYERS)
    pool, ids = filled_pool(lengths=[30, 37, 20, 5], generator=generator)
    page_table, seq_lens = pool.batch(ids)
    budgets = torch.tensor([2 * PAGE, 4 * PAGE, 3 * PAGE, 4 * PAGE], dtype=torch.int32)
    state = DecodeState()
    expected = torch.zeros(len(ids), dtype=torch.float64)
    for layer_idx in range(1, LAYERS):
        q, layer = queries(len(ids), generator), pool.layer(layer_idx)
        out = decoder.decode(layer_idx, q, layer, page_table, seq_lens, SCALE, budgets=budgets, state=state).clone()
        reference_out, selected = reference_quest(config, q, layer, page_table, seq_lens, budgets)
        torch.testing.assert_close(out, reference_out, atol=1e-6, rtol=0)
        expected += charged(selected)
        # Not vacuous: the first row's own budget changed its output from the shared budget's.
        shared_out, _ = reference_quest(config, q, layer, page_table, seq_lens)
        assert (out[0] - shared_out[0]).abs().max() > 1e-4
        torch.testing.assert_close(out[1], shared_out[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(state.tokens_attended_sum, expected, atol=0, rtol=0)
    assert state.mean_tokens_attended_per_sequence.tolist() == [2 * PAGE, 4 * PAGE, 3 * PAGE, 2 * PAGE]
    single = decoder.tokens_attended(seq_lens, budgets)
    assert single.dtype == torch.float64 and single.tolist() == [2 * PAGE, 4 * PAGE, 3 * PAGE, 2 * PAGE]


# -- policy state ------------------------------------------------------------------------------------


def test_policy_state_is_created_once_per_policy_layer_with_its_prefill_scores():
    generator = torch.Generator().manual_seed(seed())
    budget = 10
    policy = make_policy("h2o", budget, page_size=PAGE)
    decoder = LayerDecoder(QuestConfig(token_budget=None, page_size=PAGE, dense_layers=2), LAYERS, policy)
    assert decoder.uses_prefill_attention
    pool, ids = filled_pool(generator=generator)
    asked = []

    def prefill_scores(layer_idx):
        asked.append(layer_idx)
        return torch.rand(len(ids), KV_HEADS, max(LENGTHS), generator=generator)

    state = DecodeState()
    steps = 3
    for _ in range(steps):
        add_token(pool, ids, generator)
        page_table, seq_lens = pool.batch(ids)
        for layer_idx in range(LAYERS):
            decoder.decode(layer_idx, queries(len(ids), generator), pool.layer(layer_idx), page_table, seq_lens,
                           SCALE, state=state, prefill_scores=prefill_scores)
    assert asked == [2, 3]  # the policy layers, once each, at their first decode step
    assert set(state.policy_states) == {2, 3} and state.policy_key == repr(policy) and state.holds_policy_state
    assert state.sparse_steps == steps * 2
    # Eviction charges the tokens kept: the first row holds fewer than the budget.
    expected = [sum(min(n + t, budget) for t in range(1, steps + 1)) / steps for n in LENGTHS]
    assert state.mean_tokens_attended_per_sequence.tolist() == pytest.approx(expected)


def test_an_eviction_state_cannot_continue_under_another_setting_nor_a_multi_token_forward():
    generator = torch.Generator().manual_seed(seed())
    h2o = make_policy("h2o", 10, page_size=PAGE)
    dense_config = QuestConfig(token_budget=None, page_size=PAGE, dense_layers=1)
    decoder = LayerDecoder(dense_config, LAYERS, h2o)
    pool, ids = filled_pool(generator=generator)
    state = DecodeState()
    decoder.prepare(state, 1)
    add_token(pool, ids, generator)
    page_table, seq_lens = pool.batch(ids)
    for layer_idx in range(LAYERS):
        decoder.decode(layer_idx, queries(len(ids), generator), pool.layer(layer_idx), page_table, seq_lens, state=state)
    decoder.prepare(state, 1)  # the same setting continues
    with pytest.raises(ValueError, match="dropped tokens for good"):
        decoder.prepare(state, 3)
    for other in (
        LayerDecoder(dense_config, LAYERS, make_policy("h2o", 12, page_size=PAGE)),
        LayerDecoder(dense_config, LAYERS, make_policy("streaming", 10, page_size=PAGE)),
        LayerDecoder(QuestConfig(token_budget=2 * PAGE, page_size=PAGE), LAYERS),
    ):
        with pytest.raises(ValueError, match="cannot continue under"):
            other.prepare(state, 1)
    assert set(state.policy_states) == {1, 2, 3}  # refusals change nothing


def test_stateless_policy_states_start_afresh_under_another_setting():
    generator = torch.Generator().manual_seed(seed())
    dense_config = QuestConfig(token_budget=None, page_size=PAGE, dense_layers=1)
    decoder = LayerDecoder(dense_config, LAYERS, make_policy("quest", 2 * PAGE, page_size=PAGE))
    pool, ids = filled_pool(generator=generator)
    page_table, seq_lens = pool.batch(ids)
    state = DecodeState()
    for layer_idx in range(LAYERS):
        decoder.decode(layer_idx, queries(len(ids), generator), pool.layer(layer_idx), page_table, seq_lens, state=state)
    assert state.policy_states == {1: None, 2: None, 3: None} and not state.holds_policy_state
    decoder.prepare(state, 5)  # stateless: any forward may follow
    assert set(state.policy_states) == {1, 2, 3}
    LayerDecoder(dense_config, LAYERS, make_policy("oracle", 2 * PAGE, page_size=PAGE)).prepare(state, 1)
    assert state.policy_states == {}


# -- errors ------------------------------------------------------------------------------------------


def test_bad_arguments_are_rejected():
    config = QuestConfig(token_budget=2 * PAGE, page_size=PAGE)
    dense = QuestConfig(token_budget=None, page_size=PAGE)
    with pytest.raises(ValueError, match="LayerDecoder.config must be a questkv.QuestConfig, got dict"):
        LayerDecoder({"token_budget": 8}, LAYERS)
    with pytest.raises(ValueError, match="LayerDecoder.num_layers must be >= 1, got 0"):
        LayerDecoder(config, 0)
    with pytest.raises(ValueError, match="LayerDecoder.num_layers must be an int"):
        LayerDecoder(config, True)
    with pytest.raises(ValueError, match="LayerDecoder.max_cached_steps must be >= 1"):
        LayerDecoder(config, LAYERS, max_cached_steps=0)
    with pytest.raises(ValueError, match="LayerDecoder.policy must be a questkv.policies.DecodePolicy, got str"):
        LayerDecoder(dense, LAYERS, "h2o")
    with pytest.raises(ValueError, match="token_budget must be None with a policy"):
        LayerDecoder(config, LAYERS, make_policy("h2o", 10, page_size=PAGE))
    with pytest.raises(ValueError, match="policy.page_size=16 differs from QuestConfig.page_size=4"):
        LayerDecoder(dense, LAYERS, make_policy("h2o", 10, page_size=16))
    decoder = LayerDecoder(QuestConfig(token_budget=None, page_size=PAGE, dense_layers=1), LAYERS,
                           make_policy("h2o", 10, page_size=PAGE))
    pool, ids = filled_pool()
    page_table, seq_lens = pool.batch(ids)
    q = torch.randn(len(ids), Q_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="policy layer 1 needs a DecodeState"):
        decoder.decode(1, q, pool.layer(1), page_table, seq_lens)
    with pytest.raises(ValueError, match="per-sequence budgets are for Quest layers"):
        decoder.decode(1, q, pool.layer(1), page_table, seq_lens, state=DecodeState(),
                       budgets=torch.full((len(ids),), 8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"layer_idx must be in \[0, 4\), got 4"):
        decoder.decode(LAYERS, q, pool.layer(0), page_table, seq_lens, state=DecodeState())


def test_the_decoder_is_framework_free():
    code = (
        "import sys, questkv.integrations.layer_decoder, questkv.integrations.forward_state; "
        "sys.exit(int('transformers' in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_a_dropped_decoder_is_freed_without_the_garbage_collector():
    import gc
    import weakref

    decoder = LayerDecoder(QuestConfig(token_budget=3 * PAGE, page_size=PAGE, dense_layers=1), LAYERS)
    pool, ids = filled_pool()
    page_table, seq_lens = pool.batch(ids)
    for layer_idx in range(LAYERS):
        decoder.decode(layer_idx, torch.randn(len(ids), Q_HEADS, HEAD_DIM), pool.layer(layer_idx), page_table, seq_lens)
    ref = weakref.ref(decoder)
    gc.disable()
    try:
        del decoder
        assert ref() is None  # its step buffers go with it: no reference cycle
    finally:
        gc.enable()
