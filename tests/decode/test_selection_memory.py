"""Selection reuse at the step level (fp32, CPU, torch reference backend): a reusing row attends exactly the pages
its layer selected last plus the pages begun since, composed here by hand from the reference ops, and the memory
keeps each cache slot's selection whatever order the slots come in."""

import random

import pytest
import torch

from questkv.config import QuestConfig
from questkv.decode.selection_memory import SelectionMemory, is_due, selection_seq_len
from questkv.decode.step import QuestDecodeStep
from questkv.ops import reference
from tests.helpers import random_cache

PAGE, Q_HEADS, KV_HEADS, HEAD_DIM = 4, 4, 2, 8


def config(interval: int, budget: int = 12, selection: str = "kv_head") -> QuestConfig:
    return QuestConfig(token_budget=budget, page_size=PAGE, dense_layers=0, selection=selection,
                       selection_interval=interval, backend="torch")


def expected_selection(q, layer, page_table, seq_lens, cfg: QuestConfig) -> torch.Tensor:
    """The reference ops' selection ``[batch, heads, budget_pages]`` of ``q``."""
    scores = reference.page_scores(q, layer.kmin, layer.kmax, page_table, seq_lens, PAGE, cfg.selection,
                                   cfg.group_reduction)
    return reference.select_pages(scores, seq_lens, PAGE, cfg.budget_pages)


def with_pages_begun_since(selected: torch.Tensor, made_at: list[int], seq_lens: torch.Tensor) -> torch.Tensor:
    """``selected`` (the selection made at sequence lengths ``made_at``) plus the pages begun since, per row."""
    rows = []
    for b, at in enumerate(made_at):
        first, last = -(-at // PAGE), -(-int(seq_lens[b]) // PAGE)
        extra = torch.arange(first, last, dtype=torch.int32)[None].expand(selected.shape[1], -1)
        rows.append(torch.cat([selected[b], extra], dim=1))
    width = max(row.shape[1] for row in rows)
    return torch.stack([torch.nn.functional.pad(row, (0, width - row.shape[1]), value=-1) for row in rows])


@pytest.mark.parametrize("selection", ["kv_head", "q_head"])
@pytest.mark.parametrize("interval", [2, 5, 9])  # 9 > page_size + 1: two pages may begin between selections
def test_a_reusing_row_attends_its_last_selection_plus_the_pages_begun_since(selection, interval):
    cfg = config(interval, selection=selection)
    lens = [random.randint(1, 6), random.randint(20, 40), random.randint(41, 60)]
    data = random_cache(lens, KV_HEADS, HEAD_DIM, PAGE, extra_tokens=3 * interval)
    batch = len(lens)
    heads = Q_HEADS if selection == "q_head" else KV_HEADS
    memory = SelectionMemory(cfg, num_layers=1, num_sel_heads=heads, max_seqs=batch + 1, device="cpu")
    width = data.cache.max_pages_per_seq
    step = QuestDecodeStep(cfg, batch, Q_HEADS, KV_HEADS, HEAD_DIM, width, torch.float32, "cpu")
    rows_of = list(range(batch))[::-1]  # rows in another order than the slots
    slots = torch.tensor([data.ids[i] for i in rows_of], dtype=torch.int64)
    made_at, last_selection = None, None
    for t in range(2 * interval + 1):
        page_table, seq_lens = data.cache.batch([data.ids[i] for i in rows_of], max_pages=width)
        layer = data.cache.layer(0)
        q = torch.randn(batch, Q_HEADS, HEAD_DIM)
        due = torch.full((batch,), int(t % interval == 0))
        rows = memory.rows(slots, due, seq_lens)
        assert rows.active.tolist() == [int(t % interval == 0)] * batch
        out = step.sparse(q, layer, page_table, seq_lens, None, None, rows.active, rows.selected[0]).clone()
        if t % interval:  # what the engine launches when no row selects: the attend alone, the same output
            skipped = step.sparse(q, layer, page_table, seq_lens, None, None, rows.active, rows.selected[0],
                                  selecting=False)
            torch.testing.assert_close(skipped, out, rtol=0, atol=0)
        memory.store(slots, rows)
        if t % interval == 0:
            made_at, last_selection = seq_lens.tolist(), expected_selection(q, layer, page_table, seq_lens, cfg)
            assert torch.equal(rows.selected[0][..., :cfg.budget_pages], last_selection)
            assert (rows.selected[0][..., cfg.budget_pages:] == -1).all()
        attended = with_pages_begun_since(last_selection, made_at, seq_lens)
        expected = reference.paged_decode_attention(q, layer.k_pages, layer.v_pages, page_table, seq_lens, attended)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        data.append_token(torch.randn(batch, KV_HEADS, HEAD_DIM), torch.randn(batch, KV_HEADS, HEAD_DIM))


def test_a_step_without_selection_needs_reuse_and_launches_no_estimate_or_select(monkeypatch):
    cfg = config(3)
    data = random_cache([random.randint(9, 30)], KV_HEADS, HEAD_DIM, PAGE)
    step = QuestDecodeStep(cfg, 1, Q_HEADS, KV_HEADS, HEAD_DIM, data.cache.max_pages_per_seq, torch.float32, "cpu")
    page_table, seq_lens = data.cache.batch(data.ids, max_pages=data.cache.max_pages_per_seq)
    q, layer = torch.randn(1, Q_HEADS, HEAD_DIM), data.cache.layer(0)
    with pytest.raises(ValueError, match="selecting=False needs selected"):
        step.sparse(q, layer, page_table, seq_lens, selecting=False)
    monkeypatch.setattr(reference, "page_scores_into", lambda *a, **k: pytest.fail("estimate launched"))
    monkeypatch.setattr(reference, "select_pages_into", lambda *a, **k: pytest.fail("select launched"))
    selected = torch.full((1, KV_HEADS, cfg.budget_pages + cfg.reuse_extra_pages), -1, dtype=torch.int32)
    selected[..., 0] = 0
    out = step.sparse(q, layer, page_table, seq_lens, active=torch.zeros(1, dtype=torch.int32), selected=selected,
                      selecting=False)
    expected = reference.paged_decode_attention(q, layer.k_pages, layer.v_pages, page_table, seq_lens, selected)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_a_slot_without_a_selection_or_with_more_new_pages_than_columns_selects_whatever_its_phase():
    cfg = config(3)  # one extra column
    memory = SelectionMemory(cfg, num_layers=2, num_sel_heads=KV_HEADS, max_seqs=4, device="cpu")
    slots = torch.tensor([2, 0, 3])
    lens = torch.tensor([9, 17, 30], dtype=torch.int32)
    first = memory.rows(slots, torch.zeros(3), lens)
    assert first.active.tolist() == [1, 1, 1]  # nothing kept yet
    memory.store(slots, first)
    assert memory.rows(slots, torch.zeros(3), lens + 1).active.tolist() == [0, 0, 0]
    assert memory.rows(slots, torch.tensor([0, 1, 0]), lens + 1).active.tolist() == [0, 1, 0]
    assert memory.rows(slots, torch.zeros(3), lens + torch.tensor([1, 8, 7], dtype=torch.int32)).active.tolist() == [0, 1, 1]
    memory.forget(torch.tensor([0]))
    assert memory.rows(slots, torch.zeros(3), lens + 1).active.tolist() == [0, 1, 0]


def test_the_phase_counts_each_sequences_own_outputs():
    prompt_len, interval = random.randint(1, 50), random.randint(2, 6)
    # The first decode step's input is output 0: the sequence then holds prompt_len + 1 tokens.
    dues = [is_due(prompt_len + 1 + k, prompt_len, interval) for k in range(3 * interval)]
    assert dues == [k % interval == 0 for k in range(3 * interval)]
    assert [selection_seq_len(prompt_len + 1 + k, prompt_len, interval) for k in range(interval + 1)] == (
        [prompt_len + 1] * interval + [prompt_len + 1 + interval])


def test_a_memory_needs_a_sparse_config_with_reuse_and_reports_its_bytes():
    with pytest.raises(ValueError, match="selection_interval >= 2"):
        SelectionMemory(config(1), 2, KV_HEADS, 4, "cpu")
    with pytest.raises(ValueError, match="selection_interval >= 2"):
        SelectionMemory(QuestConfig(page_size=PAGE, selection_interval=2), 2, KV_HEADS, 4, "cpu")
    cfg = QuestConfig(token_budget=16, page_size=PAGE, dense_layers=1, selection_interval=6)  # 2 extra columns
    memory = SelectionMemory(cfg, 3, KV_HEADS, 5, "cpu")
    assert memory.pages.shape == (2, 5, KV_HEADS, 4 + 2)
    assert SelectionMemory.nbytes(cfg, 3, KV_HEADS, 5) == sum(
        t.nbytes for t in (memory.pages, memory.selected_at, memory.selections, memory.steps, memory.last_selections,
                           memory._one))
    assert SelectionMemory.nbytes(config(1), 3, KV_HEADS, 5) == 0
    with pytest.raises(ValueError, match="QuestConfig.selection_interval must be >= 1"):
        QuestConfig(selection_interval=0)


def test_the_selection_rate_counts_each_slots_selecting_layer_heads_and_restarts_with_a_prefill():
    cfg = config(3)
    memory = SelectionMemory(cfg, num_layers=2, num_sel_heads=KV_HEADS, max_seqs=4, device="cpu")
    slots = torch.tensor([2, 0])
    lens = torch.tensor([9, 17], dtype=torch.int32)
    assert memory.selection_rate(2) is None
    memory.store(slots, memory.rows(slots, torch.zeros(2), lens))  # nothing kept yet: every (layer, head) selects
    rows = memory.rows(slots, torch.zeros(2), lens + 4)  # one page more: still reusable
    assert rows.active.tolist() == [0, 0]
    memory.store(slots, rows)
    assert memory.selection_rate(2) == 4 / 8 and memory.selection_rate(0) == 4 / 8
    assert memory.selected_at.tolist() == [5, -1, 3, -1]  # the page counts of the selections kept
    memory.count_dense_step(torch.tensor([0]))  # a step that decoded densely: no selection, none kept
    assert memory.selection_rate(0) == 4 / 12 and memory.selected_at[0] == -1
    assert memory.selection_rate(0, discard_last=True) == 4 / 8  # without the dense step
    memory.forget_where(slots, torch.tensor([True, False]))
    assert memory.selected_at.tolist() == [-1, -1, -1, -1]
    assert memory.selection_rate(2, discard_last=True) == 4 / 4
    memory.restart(torch.tensor([0]))
    assert memory.selection_rate(0) is None and memory.selection_rate(2) == 4 / 8
    assert SelectionMemory.nbytes(cfg, 2, KV_HEADS, 4) == sum(
        t.nbytes for t in (memory.pages, memory.selected_at, memory.selections, memory.steps, memory.last_selections,
                           memory._one))
