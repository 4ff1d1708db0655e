"""ModelRunner: the page pool it plans, the logits of its steps (Quest at full budget == dense), which decode path
each layer takes (spied on ``QuestDecodeStep.sparse`` / ``.dense``) and the per-request budgets it hands them.

The model is a tiny random transformers Llama (3 layers, GQA 4 q / 2 KV heads, llama3 rope) saved with
``save_pretrained`` once per module; prompts are fresh random token ids in every test.
"""

import dataclasses
import math
import random

import pytest
import torch

from questkv import QuestConfig
from questkv.decode.step import QuestDecodeStep
from questkv.engine.engine_config import EngineConfig
from questkv.engine.llm import LLM
from questkv.engine.kv_pool import plan_cache
from questkv.engine.sampling_params import SamplingParams
from questkv.layers.attention import Attention
from questkv.models.llama import ModelSpec
from tests.helpers import greedy_params, save_tiny_model

VOCAB, PAGE, MAX_LEN, LAYERS = 96, 4, 128, 3
FULL = QuestConfig(token_budget=MAX_LEN, page_size=PAGE, dense_layers=1)  # covers every context
SMALL = QuestConfig(token_budget=12, page_size=PAGE, dense_layers=1, dense_context_ratio=1.0)  # Quest from tiny contexts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), VOCAB, seed=random.randrange(1 << 16))


def make_llm(model_dir, quest=None, **kwargs) -> LLM:
    kwargs = {"device": "cpu", "dtype": "float32", "max_model_len": MAX_LEN, "kv_cache_memory": 1 << 20, **kwargs}
    return LLM(str(model_dir), quest=quest, **kwargs)


def prompt(n: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,)).tolist()


greedy = greedy_params


def record_logits(monkeypatch, llm) -> list[torch.Tensor]:
    """Every ``[batch, vocab]`` logits tensor the runner computes, in step order (prefill, then decodes)."""
    model, calls = llm.engine.runner.model, []
    compute = model.compute_logits

    def spy(hidden, out=None):
        logits = compute(hidden, out)
        calls.append(logits.clone())
        return logits

    monkeypatch.setattr(model, "compute_logits", spy)
    return calls


def record_decode_paths(monkeypatch, llm) -> list[tuple]:
    """``(path, layer_idx, selected or None, budgets or None)`` of every decode attention call, in call order."""
    layer_of = {id(m.pages): m.layer_idx for m in llm.engine.runner.model.modules() if isinstance(m, Attention)}
    calls = []
    dense, sparse = QuestDecodeStep.dense, QuestDecodeStep.sparse

    def spy_dense(self, q, layer, *args, **kwargs):
        calls.append(("dense", layer_of[id(layer)], None, None))
        return dense(self, q, layer, *args, **kwargs)

    def spy_sparse(self, q, layer, page_table, seq_lens, sm_scale=None, budgets=None, active=None, selected=None,
                   selecting=True):
        out = sparse(self, q, layer, page_table, seq_lens, sm_scale, budgets, active, selected, selecting)
        got = None if budgets is None else budgets.clone()
        calls.append(("sparse", layer_of[id(layer)], (self.selected if selected is None else selected).clone(), got))
        return out

    monkeypatch.setattr(QuestDecodeStep, "dense", spy_dense)
    monkeypatch.setattr(QuestDecodeStep, "sparse", spy_sparse)
    return calls


def page_bytes(spec: ModelSpec, page_size: int, element: int = 4) -> int:
    """K and V of ``page_size`` tokens plus the page's min and max key, in every layer."""
    return spec.num_layers * (2 * page_size + 2) * spec.num_kv_heads * spec.head_dim * element


# ---------------------------------------------------------------------------------------------------------------
# The page pool
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quest", [None, FULL], ids=["dense", "quest"])
def test_the_pool_holds_the_pages_that_fit_kv_cache_memory_and_the_runner_keeps_one_scratch_page(model_dir, quest):
    page_size = 16 if quest is None else quest.page_size
    probe = make_llm(model_dir, quest)
    size = page_bytes(probe.engine.spec, page_size)
    pages = random.randint(math.ceil(MAX_LEN / page_size) + 1, 80)
    llm = make_llm(model_dir, quest, kv_cache_memory=pages * size + random.randrange(size))
    runner, cache = llm.engine.runner, llm.engine.cache
    assert cache.num_pages == runner.cache_spec.num_pages == pages and cache.page_size == page_size
    assert runner.cache_spec.max_pages_per_seq == cache.max_pages_per_seq == math.ceil(MAX_LEN / page_size)
    assert cache.sequences == [runner.scratch_seq] and len(cache.pages_of(runner.scratch_seq)) == 1
    assert cache.num_free_pages == pages - 1
    assert cache.max_seqs == llm.config.max_num_seqs + 1  # the scratch sequence beside max_num_seqs requests
    spec = llm.cache_spec  # what the LLM reports
    assert spec.kv_tokens == (pages - 1) * page_size and spec.page_bytes == size and spec.page_size == page_size
    model = llm.engine.runner.model
    assert spec.weight_bytes == sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert f"{spec.kv_tokens:,} tokens of KV" in spec.describe() and f"{pages} pages of {page_size}" in spec.describe()


def test_plan_cache_takes_one_gib_on_cpu_by_default_and_refuses_a_budget_below_one_sequence(model_dir):
    spec = make_llm(model_dir).engine.spec
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32")
    plan = plan_cache(config, spec, MAX_LEN, torch.device("cpu"))
    assert plan.num_pages == (1 << 30) // page_bytes(spec, 16)
    assert plan.max_pages_per_seq == MAX_LEN // 16 and plan.max_model_len == MAX_LEN
    small = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", kv_cache_memory=page_bytes(spec, 16) * 8)
    with pytest.raises(ValueError, match=r"fewer than one sequence of max_model_len=128 tokens needs \(9 with the "
                                         r"scratch page\); raise kv_cache_memory"):
        plan_cache(small, spec, MAX_LEN, torch.device("cpu"))


def test_a_cpu_runner_never_captures_graphs_and_decodes_at_the_batchs_own_width(model_dir):
    llm = make_llm(model_dir, FULL, enforce_eager=False)
    runner = llm.engine.runner
    assert runner.graphs.batch_sizes == ()
    llm.generate([prompt(9), prompt(30)], greedy(4), use_tqdm=False)
    assert len(runner.graphs) == 0
    assert runner.graphs.width(3) == 3  # no padding of the page table without graphs


def test_every_rank_prepares_its_startup_graphs_then_prefill_launches(model_dir, monkeypatch):
    """``graph_capture="startup"``'s work is the runner's (:meth:`ModelRunner.prepare_startup`): rank 0 runs it at
    start, and a rank other than 0 when rank 0's capture message comes, so that no rank compiles a prefill
    attention launch inside a serving step."""
    from questkv.engine import model_runner
    from questkv.engine.step_data import StepMessage

    runner = make_llm(model_dir, FULL).engine.runner
    calls = []
    monkeypatch.setattr(runner, "capture_decode_graphs", lambda progress=False: calls.append("graphs") or 0)
    monkeypatch.setattr(model_runner, "prepare_prefill",
                        lambda model, cache: calls.append(("prefill", model is runner.model, cache is runner.cache)))
    runner.run_step(StepMessage((), capture=True))
    assert calls == ["graphs", ("prefill", True, True)]


# ---------------------------------------------------------------------------------------------------------------
# Logits: Quest with a budget covering the context == dense
# ---------------------------------------------------------------------------------------------------------------


def test_quest_with_a_budget_covering_the_context_gives_the_dense_logits_on_prefill_and_every_decode_step(
    model_dir, monkeypatch
):
    prompts = [prompt(n) for n in (random.randint(1, 8), random.randint(9, 40), random.randint(41, 90))]
    runs = {}
    for name, quest in (("dense", None), ("dense page 4", QuestConfig(page_size=PAGE)), ("quest", FULL)):
        llm = make_llm(model_dir, quest)
        logits = record_logits(monkeypatch, llm)
        outputs = llm.generate(prompts, greedy(12), use_tqdm=False)
        runs[name] = (logits, [out.token_ids for out in outputs])
    dense_logits, dense_tokens = runs["dense"]
    assert len(dense_logits) == 12  # one prefill of the three prompts, then eleven decode steps
    for name in ("dense page 4", "quest"):
        logits, tokens = runs[name]
        assert tokens == dense_tokens, name
        assert len(logits) == len(dense_logits)
        for step, (got, want) in enumerate(zip(logits, dense_logits)):
            assert got.shape == want.shape == (3, VOCAB)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{name}, step {step}")


def test_a_small_budget_selects_only_its_pages_and_changes_the_logits(model_dir, monkeypatch):
    prompts = [prompt(random.randint(30, 60))]
    dense = make_llm(model_dir)
    dense_logits = record_logits(monkeypatch, dense)
    dense.generate(prompts, greedy(6), use_tqdm=False)
    llm = make_llm(model_dir, SMALL)
    logits = record_logits(monkeypatch, llm)
    calls = record_decode_paths(monkeypatch, llm)
    llm.generate(prompts, greedy(6), use_tqdm=False)
    sparse = [selected for path, _, selected, _ in calls if path == "sparse"]
    assert len(sparse) == 5 * (LAYERS - SMALL.dense_layers)
    context_pages = math.ceil(len(prompts[0]) / PAGE)
    for selected in sparse:  # [batch, num_kv_heads, budget_pages]
        assert selected.shape == (1, 2, SMALL.budget_pages)
        assert (selected >= 0).sum(-1).eq(SMALL.budget_pages).all()  # 3 of the context's 8 to 17 pages
        assert context_pages > SMALL.budget_pages
    torch.testing.assert_close(logits[0], dense_logits[0], rtol=1e-5, atol=1e-5)  # prefill is dense attention
    assert not torch.allclose(logits[1], dense_logits[1], rtol=1e-4, atol=1e-4)  # the first sparse decode step


# ---------------------------------------------------------------------------------------------------------------
# Which decode path each layer takes
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dense_layers", [0, 1, 2])
def test_sparse_layers_decode_through_sparse_and_the_layers_below_dense_layers_through_dense(
    model_dir, monkeypatch, dense_layers
):
    quest = QuestConfig(token_budget=16, page_size=PAGE, dense_layers=dense_layers, dense_context_ratio=1.0)
    llm = make_llm(model_dir, quest)
    calls = record_decode_paths(monkeypatch, llm)
    # contexts past the budget: every decode step is routed to Quest (a covered one would run its sparse layers dense)
    llm.generate([prompt(random.randint(17, 40)), prompt(random.randint(17, 40))], greedy(5), use_tqdm=False)
    expected = [("dense" if i < dense_layers else "sparse", i) for i in range(LAYERS)]
    assert [(path, layer) for path, layer, _, _ in calls] == expected * 4  # four decode steps, none in prefill


@pytest.mark.parametrize("quest", [None, QuestConfig(page_size=PAGE)], ids=["quest None", "dense QuestConfig"])
def test_a_dense_engine_never_calls_sparse(model_dir, monkeypatch, quest):
    llm = make_llm(model_dir, quest)
    calls = record_decode_paths(monkeypatch, llm)
    llm.generate([prompt(random.randint(1, 40)) for _ in range(3)], greedy(4), use_tqdm=False)
    assert [(path, layer) for path, layer, _, _ in calls] == [("dense", i) for i in range(LAYERS)] * 3


def test_per_request_budgets_reach_every_sparse_layer_as_per_row_page_counts(model_dir, monkeypatch):
    quest = QuestConfig(token_budget=32, page_size=PAGE, dense_layers=1, dense_context_ratio=1.0)
    llm = make_llm(model_dir, quest)
    calls = record_decode_paths(monkeypatch, llm)
    budgets = [8, None, 16, 4, 32]
    params = [greedy(4, token_budget=b) for b in budgets]
    llm.generate([prompt(random.randint(40, 80)) for _ in budgets], params, use_tqdm=False)
    rows = torch.tensor([b or quest.token_budget for b in budgets], dtype=torch.int32)
    sparse = [(selected, got) for path, _, selected, got in calls if path == "sparse"]
    assert len(sparse) == 3 * (LAYERS - 1)
    for selected, got in sparse:
        assert torch.equal(got, rows)
        assert torch.equal((selected >= 0).sum(-1), (rows // PAGE)[:, None].expand(-1, 2))  # [batch, num_kv_heads]


# ---------------------------------------------------------------------------------------------------------------
# Execute and seeds
# ---------------------------------------------------------------------------------------------------------------


def test_execute_samples_one_token_per_sequence_in_batch_order(model_dir):
    llm = make_llm(model_dir, FULL)
    engine = llm.engine
    prompts = [prompt(random.randint(1, 30)) for _ in range(3)]
    alone = [llm.generate([p], greedy(2), use_tqdm=False)[0].token_ids for p in prompts]
    for p in reversed(prompts):
        engine.add_request(p, greedy(2))
    batch = engine.scheduler.schedule()
    assert not batch.num_decodes and [list(seq.prompt_token_ids) for seq in batch.seqs] == prompts[::-1]
    tokens = engine.runner.execute(batch).token_ids()
    assert isinstance(tokens, list) and all(type(t) is int for t in tokens)
    assert tokens == [a[0] for a in alone[::-1]]
    engine.scheduler.update(batch, tokens)
    batch = engine.scheduler.schedule()
    assert not batch.num_prefills and engine.runner.execute(batch).token_ids() == [a[1] for a in alone[::-1]]
    engine.scheduler.update(batch, [a[1] for a in alone[::-1]])
    assert not engine.has_unfinished_requests()


def test_a_decode_step_scheduled_before_the_last_update_reads_the_token_in_flight(model_dir):
    llm = make_llm(model_dir, FULL)
    engine = llm.engine
    prompts = [prompt(random.randint(1, 30)) for _ in range(3)]
    alone = [llm.generate([p], greedy(3), use_tqdm=False)[0].token_ids for p in prompts]
    for p in prompts:
        engine.add_request(p, greedy(3))
    prefill = engine.scheduler.schedule()
    first = engine.runner.execute(prefill)
    decode = engine.scheduler.schedule()  # before the prefill's tokens are appended: they are in flight
    assert not decode.num_prefills and all(seq.num_in_flight == 2 for seq in decode.seqs)
    assert decode.seq_lens == tuple(len(p) + 1 for p in prompts)
    second = engine.runner.execute(decode)
    engine.scheduler.update(prefill, first.token_ids())
    engine.scheduler.update(decode, second.token_ids())
    assert [list(seq.output_token_ids) for seq in decode.seqs] == [list(a[:2]) for a in alone]


def test_a_requests_own_seed_wins_and_others_derive_theirs_from_the_engine_seed_and_request_id(model_dir):
    def queued(engine, request_id, seed=None):
        engine.add_request(prompt(3), SamplingParams(seed=seed), request_id=request_id)
        return engine.scheduler.waiting[-1]

    first, second = (make_llm(model_dir).engine for _ in range(2))
    a, b = queued(first, "r1"), queued(second, "r1")
    assert a.sampling_seed(7) == b.sampling_seed(7) != a.sampling_seed(8)
    assert queued(first, "r2").sampling_seed(7) != a.sampling_seed(7)
    assert queued(first, "r3", seed=123).sampling_seed(7) == 123
    assert 0 <= a.sampling_seed(7) < 1 << 63


def test_a_bfloat16_engine_keeps_its_pool_in_bfloat16_and_samples_from_float32_logits(model_dir, monkeypatch):
    llm = make_llm(model_dir, SMALL, dtype="bfloat16")
    assert llm.engine.cache.dtype is torch.bfloat16
    assert all(p.dtype is torch.bfloat16 for p in llm.engine.runner.model.parameters())
    logits = record_logits(monkeypatch, llm)
    (out,) = llm.generate([prompt(random.randint(20, 60))], greedy(5), use_tqdm=False)
    assert len(out.token_ids) == 5 and all(0 <= t < VOCAB for t in out.token_ids)
    assert all(step.dtype is torch.float32 and torch.isfinite(step).all() for step in logits)


@pytest.mark.parametrize("quest", [None, SMALL, dataclasses.replace(SMALL, selection_interval=3)],
                         ids=["dense", "quest", "quest with selection reuse"])
def test_the_decode_rows_of_a_mixed_step_get_the_logits_of_a_decode_only_step(model_dir, quest):
    torch.manual_seed(11)
    first, joining = [prompt(21), prompt(30)], prompt(13)
    logits = []
    for joins in (False, True):
        engine = make_llm(model_dir, quest, max_num_seqs=4).engine
        for p in first:
            engine.add_request(p, greedy_params(8))
        for _ in range(3):  # the prefill, then decode steps (the second reuses its selection with interval 3)
            engine.step()
        if joins:
            engine.add_request(joining, greedy_params(4))
        batch = engine.scheduler.schedule()
        assert (batch.num_decodes, batch.num_prefills) == (2, int(joins))
        with torch.inference_mode():
            rows = engine.runner._prefill(batch) if joins else engine.runner._decode(batch)
        assert rows.shape[0] == 2 + joins  # the decode rows, then the prefill row that samples
        logits.append(rows[:2])
    # The same attention maths; only the linear layers see more rows (float rounding of the matrix products).
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_decode_and_verify_bodies_writing_one_shared_logits_buffer_give_the_same_tokens(model_dir, monkeypatch):
    """On CUDA every graph body writes its logits into one buffer of the runner (a graph's own output, kept per batch
    size, width, route and verify length, held GBs): here, on the CPU, the bodies run eagerly into such a buffer, and
    lossless rounds (draft and verify steps) with dense requests beside them give the tokens of the runner that
    allocates each step's logits."""
    spec = {"method": "quest", "num_speculative_tokens": 3, "adaptive": False}
    prompts = [prompt(random.randint(20, 60)) for _ in range(4)]
    params = [greedy(random.randint(12, 16)) for _ in range(3)] + [greedy(4, dense=True)]  # verifies alone at the end
    want = [out.token_ids for out in make_llm(model_dir, SMALL, speculative_config=spec).generate(
        prompts, params, use_tqdm=False)]
    llm = make_llm(model_dir, SMALL, speculative_config=spec)
    runner = llm.engine.runner
    assert runner._graph_logits is None  # (no graphs on the CPU)
    shared = runner._graph_logits = torch.full((llm.engine.config.max_num_seqs * 4, VOCAB), float("nan"))
    written = []
    compute = runner.model.compute_logits

    def spy(hidden, out=None):
        written.append(out is not None and out.data_ptr() == shared.data_ptr())
        return compute(hidden, out)

    bodies = {"_decode_body": 0, "_verify_body": 0}

    def counted(name):
        body = getattr(runner, name)

        def run(*key):
            bodies[name] += 1
            return body(*key)
        return run

    monkeypatch.setattr(runner.model, "compute_logits", spy)
    for name in bodies:
        monkeypatch.setattr(runner, name, counted(name))
    assert [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)] == want
    assert bodies["_decode_body"] and bodies["_verify_body"]  # both kinds of graph body ran, each into the buffer
    assert sum(written) == sum(bodies.values())
