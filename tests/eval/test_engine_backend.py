"""The engine backend of ``questkv eval`` (questkv.eval.engine_backend) on CPU: the HF path's answers and scores
where both run the same setting, selection reuse (engine only), the backend each setting takes, the agreement
tasks, and the command line. A tiny random Llama and the passkey word tokenizer, saved as an HF folder that
both paths load; fp32, so tokens match exactly."""

import dataclasses
import json
import math
import random
import re

import pytest
import torch

from questkv import cli
from questkv.decode.step import sparse_tokens_attended
from questkv.eval import agreement, engine_backend, harness, report, sweep
from questkv.eval.harness import Setting
from tests.helpers import tiny_llama

PAGE = 8
LENGTH = 96
COVERING = 128  # a budget holding every token a sample ever has: Quest attends what dense attention does
PAGE_BYTES = 3 * (2 * PAGE + 2) * 2 * 8 * 4  # one page of the tiny model: 3 layers, K, V and bounds, 2 KV heads of 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, word_tokenizer):
    path = tmp_path_factory.mktemp("tiny-eval")
    tiny_llama(len(word_tokenizer), seed=random.randrange(1 << 16)).save_pretrained(path)
    word_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from questkv.models import load_model

    return load_model(str(model_dir), dtype="float32")[0]


def source(model_dir, pages: int = 4096) -> engine_backend.EngineSource:
    """Engines on the CPU with a pool of ``pages`` pages (few: requests go in several waves)."""
    return engine_backend.EngineSource(str(model_dir), {"device": "cpu", "dtype": "float32",
                                                        "kv_cache_memory": pages * PAGE_BYTES})


def make_spec(**changes):
    kwargs = dict(tasks=["passkey", "ppl"], lengths=[LENGTH], policies=["full", "quest"], budgets=[COVERING],
                  samples=3, page_size=PAGE, dense_layers=1, seed=random.randrange(10**6), score_tokens=8,
                  text_file="book:newton-opticks", agreement_tokens=8)
    return sweep.SweepSpec(**{**kwargs, **changes})


def by_key(cells):
    return {sweep.cell_key(cell): cell for cell in cells}


def test_the_engine_gives_the_hf_paths_answers_and_scores_where_both_run(model_dir, hf_model, word_tokenizer):
    """At a budget covering the context (Quest is then dense attention; both paths run the torch reference ops on the
    CPU). Below it, the two paths' scores differ in float rounding (batched vs one row), which may flip a near-tied
    page of a random model: the GPU runs compare those cells within one sample."""
    spec = make_spec(budgets=[COVERING])
    hf = by_key(sweep.run_sweep(hf_model, word_tokenizer, dataclasses.replace(spec, eval_backend="hf"),
                                progress=False))
    recorder = OutputRecorder(**dataclasses.asdict(source(model_dir, pages=40)))
    engine = by_key(sweep.run_sweep(None, word_tokenizer, spec, progress=False, engine=recorder))
    assert hf.keys() == engine.keys() and len(engine) == 4
    for key, cell in engine.items():
        assert cell["backend"] == "engine" and hf[key]["backend"] == "hf" and cell["preemptions"] == 0
        if cell["metric"] == "accuracy":
            assert cell["outputs"] == hf[key]["outputs"] and cell["scores"] == hf[key]["scores"]
            assert cell["value"] == hf[key]["value"]
        else:
            assert cell["value"] == pytest.approx(hf[key]["value"], rel=1e-4)
            assert cell["scores"] == pytest.approx(hf[key]["scores"], rel=1e-3)
        if cell["policy"] == "full":
            assert cell["mean_tokens_attended"] is None and cell["kv_bytes_fraction"] == 1.0
        elif cell["metric"] == "ppl":  # the same accounting: every page up to the budget, counted whole
            assert cell["mean_tokens_attended"] == pytest.approx(hf[key]["mean_tokens_attended"])
            assert cell["kv_bytes_per_step"] == pytest.approx(hf[key]["kv_bytes_per_step"])
        else:  # the HF batch keeps stepping (and charging) rows that finished while others decode; a request stops
            assert cell["mean_tokens_attended"] == pytest.approx(recorder.mean_attended(COVERING))
            assert hf[key]["mean_tokens_attended"] == pytest.approx(recorder.mean_attended(COVERING, batched=True))


class OutputRecorder(engine_backend.EngineSource):
    """Builds the engines of :class:`~questkv.eval.engine_backend.EngineSource` and records each request's
    output with its sampling parameters."""

    def __init__(self, **fields):
        super().__init__(**fields)
        object.__setattr__(self, "outputs", [])

    def build(self, quest, max_model_len, max_num_seqs):
        llm = super().build(quest, max_model_len, max_num_seqs)
        generate = llm.generate

        def record(prompts, params, **kwargs):
            outputs = generate(prompts, params, **kwargs)
            self.outputs.extend(zip(outputs, params))
            return outputs

        llm.generate = record
        return llm

    def mean_attended(self, budget: int, batched: bool = False) -> float:
        """The recorded Quest requests of the accuracy tasks (those that stop at EOS): the mean over those that
        output a token past the prefill's of their mean tokens attended per decode step. A step feeds output
        token ``j`` at ``len(prompt) + j + 1`` tokens, counted by :func:`sparse_tokens_attended` (every select covers
        the context here); a request's last token (a stop token too) is never fed.
        ``batched``: the HF path's accounting instead, every row stepped as long as the longest."""
        requests = [out for out, params in self.outputs if not params.dense and params.stop_token_ids]
        steps = [len(out.token_ids) - 1 for out in requests]
        if batched:
            steps = [max(steps)] * len(steps)
        means = []
        for out, n in zip(requests, steps):
            if n:
                seq_lens = len(out.prompt_token_ids) + torch.arange(1, n + 1)
                means.append(float(sparse_tokens_attended(seq_lens, torch.full_like(seq_lens, budget), PAGE).mean()))
        return sum(means) / len(means)


class PrefillCounter(engine_backend.EngineSource):
    """Builds the engines of :class:`~questkv.eval.engine_backend.EngineSource` and records the prompts each
    ``generate`` call submits and the tokens each prefill step computes (the model's inputs in that step)."""

    def __init__(self, model, engine_kwargs):
        super().__init__(model, engine_kwargs)
        object.__setattr__(self, "prompts", [])
        object.__setattr__(self, "computed", [])

    def build(self, quest, max_model_len, max_num_seqs):
        llm = super().build(quest, max_model_len, max_num_seqs)
        runner, generate = llm.engine.runner, llm.generate
        steps, execute = [], runner.execute

        def count(module, args):
            decodes = steps.pop(0)
            if decodes is not None:  # a step with prefill rows, after its decode rows
                self.computed.append(args[0].numel() - decodes)

        def record(batch):
            steps.append(batch.num_decodes if batch.num_prefills else None)
            return execute(batch)

        runner.execute = record
        runner.model.register_forward_pre_hook(count)
        llm.generate = lambda prompts, *args, **kw: self.prompts.append(prompts) or generate(prompts, *args, **kw)
        return llm


def test_a_prompt_sent_with_several_settings_is_prefilled_once_chunked_or_not(model_dir, word_tokenizer):
    """The engines' defaults (chunked prefill, prefix caching): each sample's first request prefills its prompt,
    here in chunks of 40 tokens, and the other settings' copies compute the tokens past its full pages only; the
    cells are those of a run whose prompts fit one step (up to the float rounding of the chunks' attention)."""
    spec = make_spec(tasks=["ppl"], policies=["full", "quest"], budgets=[16, COVERING])
    base = source(model_dir)
    chunked = PrefillCounter(base.model, {**base.engine_kwargs, "max_num_batched_tokens": 40})
    cells = by_key(sweep.run_sweep(None, word_tokenizer, spec, progress=False, engine=chunked))
    whole = by_key(sweep.run_sweep(None, word_tokenizer, spec, progress=False, engine=base))
    (wave,) = chunked.prompts  # one wave: the 3 settings of each sample, sample after sample
    prompts = wave[::3]
    assert len(wave) == 9 and all(wave[i] == wave[i - i % 3] for i in range(9))
    tails = [len(p) - (len(p) - 1) // PAGE * PAGE for p in prompts]
    assert max(chunked.computed) <= 40 and sum(chunked.computed) == sum(map(len, prompts)) + 2 * sum(tails)
    assert cells.keys() == whole.keys() and all(cell["preemptions"] == 0 for cell in cells.values())
    for key, cell in cells.items():
        assert cell["value"] == pytest.approx(whole[key]["value"], rel=1e-5)
        assert cell["scores"] == pytest.approx(whole[key]["scores"], rel=1e-5)


def test_selection_reuse_runs_on_the_engine_only(model_dir, word_tokenizer, capsys):
    spec = make_spec(policies=["full", "quest", "quest:selection_interval=3"], budgets=[16])
    cells = by_key(sweep.run_sweep(None, word_tokenizer, spec, progress=False, engine=source(model_dir)))
    assert cells[("passkey", LENGTH, "quest:selection_interval=3", 16)]["samples"] == 3
    reuse, every = cells[("ppl", LENGTH, "quest:selection_interval=3", 16)], cells[("ppl", LENGTH, "quest", 16)]
    assert reuse["backend"] == "engine" and reuse["value"] != every["value"]
    # A reusing step attends its old selection plus the pages begun since, and reads the bounds one step in 3.
    assert every["mean_tokens_attended"] == 16 <= reuse["mean_tokens_attended"] <= 16 + PAGE
    assert reuse["kv_bytes_per_step"] < every["kv_bytes_per_step"] + 2 * 3 * PAGE * 8 * 4
    with pytest.raises(ValueError, match=re.escape("policy 'quest:selection_interval=3' reuses page selections "
                                                   "(selection_interval=3), which only the engine runs")):
        dataclasses.replace(spec, eval_backend="hf")
    with pytest.raises(ValueError, match="reuses page selections"):
        harness.enable_setting(None, Setting("quest", 16, (("selection_interval", 2),), ":selection_interval=2"), 8, 1)
    with pytest.raises(SystemExit):
        cli.main(["eval", "passkey", "--policies", "quest:selection_interval=2", "--eval-backend", "hf",
                  "--budgets", "16", "--page-size", "8"])
    assert "only the engine runs" in capsys.readouterr().err


def test_progress_shows_the_cells_and_each_waves_requests_on_stderr(model_dir, word_tokenizer, capsys):
    spec = make_spec(tasks=["ppl"], budgets=[16], samples=2)
    cells = sweep.run_sweep(None, word_tokenizer, spec, engine=source(model_dir))
    out, err = capsys.readouterr()
    assert len(cells) == 2 and out == ""
    assert "eval: 100%" in err.split("\r")[-1] and "2/2" in err  # the bar over the cells, left at the end
    assert "length=96 task=ppl: full, quest@16" in err  # its postfix: what runs
    assert re.search(r"generate: +0%.* 0/\d+ .*req/s", err)  # a bar over each wave of requests, erased when done


def test_auto_runs_full_and_quest_on_the_engine_and_the_other_policies_on_the_hf_path(
        model_dir, hf_model, word_tokenizer):
    spec = make_spec(tasks=["passkey"], policies=["full", "quest:selection=q_head", "streaming"], budgets=[16],
                     samples=2)
    assert {s.name: spec.backend(s) for s in spec.settings()} == {
        "full": "engine", "quest:selection=q_head": "engine", "streaming": "hf"}
    loads = []
    cells = sweep.run_sweep(lambda: loads.append(1) or hf_model, word_tokenizer, spec, progress=False,
                            engine=source(model_dir))
    assert {c["policy"]: c["backend"] for c in cells} == {
        "full": "engine", "quest:selection=q_head": "engine", "streaming": "hf"}
    assert loads == [1]  # the HF model is loaded once, after the engine's cells
    assert [c["backend"] for c in cells] == ["engine", "engine", "hf"]
    document = sweep.document("tiny", spec, cells, [{"command": "test"}])
    assert "Backend: engine (full, quest:selection=q_head); hf (streaming)" in report.markdown(document)
    with pytest.raises(ValueError, match="policy 'streaming' runs on the HF path only"):
        dataclasses.replace(spec, eval_backend="engine")
    with pytest.raises(ValueError, match="no engine was given"):
        sweep.run_sweep(hf_model, word_tokenizer, spec, progress=False)


def test_engine_configs_group_settings_by_page_selection_with_their_largest_budget_and_interval():
    spec = make_spec(policies=["full", "quest", "quest:selection_interval=4", "quest:selection=q_head",
                               "quest:page_size=4"], budgets=[16, 32])
    groups = engine_backend.engine_configs(spec.settings(), PAGE, 1)
    assert [[s.label for s in group] for _, group in groups] == [
        ["full", "quest@16", "quest@32", "quest:selection_interval=4@16", "quest:selection_interval=4@32"],
        ["quest:selection=q_head@16", "quest:selection=q_head@32"], ["quest:page_size=4@16", "quest:page_size=4@32"]]
    first, q_head, page4 = (quest for quest, _ in groups)
    assert (first.token_budget, first.selection_interval, first.page_size, first.dense_layers) == (32, 4, PAGE, 1)
    assert q_head.selection == "q_head" and q_head.selection_interval == 1 and page4.page_size == 4
    assert engine_backend.engine_configs([Setting("full", None)], PAGE, 1) == [(None, [Setting("full", None)])]


def test_agreement_is_full_for_dense_and_quest_at_a_covering_budget_and_its_perplexity_is_the_models(
        model_dir, hf_model, word_tokenizer):
    spec = make_spec(tasks=["agreement_book"], policies=["full", "quest"], budgets=[16, COVERING], samples=2)
    cells = by_key(sweep.run_sweep(None, word_tokenizer, spec, progress=False, engine=source(model_dir)))
    full = cells[("agreement_book", LENGTH, "full", None)]
    assert full["metric"] == "agreement" and full["value"] == 1.0 and full["scores"] == [1.0, 1.0]
    assert cells[("agreement_book", LENGTH, "quest", COVERING)]["value"] == 1.0
    small = cells[("agreement_book", LENGTH, "quest", 16)]
    assert 0 <= small["value"] <= 1 and small["ppl"] >= 1 and small["mean_tokens_attended"] == 16
    # The perplexity of dense's tokens: a forward of the HF model over context + tokens.
    text, _ = agreement.load_text("agreement_book")
    contexts = agreement.contexts(word_tokenizer, text, LENGTH, 2, 8)
    nll = []
    for context in contexts:
        ids = list(context)
        with torch.no_grad():
            for _ in range(9):  # dense's greedy tokens, the first from the prefill
                ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
            log_probs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
        targets = torch.tensor(ids[len(context) + 1:])
        nll += (-log_probs[len(context):-1].gather(1, targets[:, None])[:, 0]).tolist()
    assert full["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-4)
    with pytest.raises(ValueError, match="task 'agreement_book' runs on the engine backend only, and policy "
                                         "'streaming' on the HF path"):
        make_spec(tasks=["agreement_book", "passkey"], policies=["full", "streaming"], budgets=[16])
    with pytest.raises(ValueError, match="SweepSpec.agreement_tokens must be <= 94"):
        make_spec(tasks=["agreement_code"], agreement_tokens=95)


def test_agreement_windows_are_evenly_spaced_and_the_code_text_is_recorded():
    assert agreement.window_starts(100, 40, 1) == [0]
    assert agreement.window_starts(100, 40, 4) == [0, 20, 40, 60]
    assert agreement.window_starts(50, 40, 3) == [0, 5, 10]  # overlapping where the text is short
    with pytest.raises(ValueError, match="fewer than one window of 40"):
        agreement.window_starts(39, 40, 2)
    assert agreement.score([5, 1, 2, 9], [-0.5, -1.0, -2.0, -3.0], [5, 1, 3, 9]) == (2 / 3, [1.0, 2.0, 3.0])
    text, record = agreement.load_text("agreement_code")
    assert record["source"] == "code:questkv" and record["files"] > 50 and record["characters"] == len(text)
    assert "# file: questkv/eval/sweep.py\n" in text and record["origin"] in ("git", "tree")


def test_the_cli_runs_the_engine_backend_and_resumes(model_dir, tmp_path):
    path = tmp_path / "sweep.json"
    argv = ["eval", "sweep", "--model", str(model_dir), "--tasks", "passkey,agreement_code", "--lengths", "64",
            "--policies", "full,quest,quest:selection_interval=2", "--budgets", "16", "--samples", "2",
            "--page-size", "8", "--dense-layers", "1", "--agreement-tokens", "6", "--dtype", "float32",
            "--kv-cache-memory", str(4096 * PAGE_BYTES), "--json", str(path), "--no-plot"]
    assert cli.main(argv) == 0
    document = json.loads(path.read_text())
    assert document["spec"]["eval_backend"] == "auto" and document["agreement_texts"]["agreement_code"]["sha256"]
    assert {(c["task"], c["policy"], c["backend"]) for c in document["cells"]} == {
        (task, policy, "engine") for task in ("passkey", "agreement_code")
        for policy in ("full", "quest", "quest:selection_interval=2")}
    assert "Backend: engine" in path.with_suffix(".md").read_text()
    assert "Perplexity of dense's greedy tokens" in path.with_suffix(".md").read_text()
    assert cli.main(argv) == 0  # resumed: nothing to do, nothing loaded
    assert json.loads(path.read_text())["runs"] == document["runs"]


def test_quantization_reaches_the_engine_and_is_refused_for_the_hf_path(model_dir, word_tokenizer):
    built = []

    class Spy(engine_backend.EngineSource):
        def build(self, quest, max_model_len, max_num_seqs):
            built.append((self.engine_kwargs.get("quantization"), self.engine_kwargs.get("quantize_lm_head")))
            return super().build(quest, max_model_len, max_num_seqs)

    base = source(model_dir)
    spec = make_spec(tasks=["ppl"], quantization="int8")
    quantized = by_key(sweep.run_sweep(None, word_tokenizer, spec, progress=False,
                                       engine=Spy(base.model, base.engine_kwargs)))
    plain = by_key(sweep.run_sweep(None, word_tokenizer, dataclasses.replace(spec, quantization=None), progress=False,
                                   engine=base))
    assert built and set(built) == {("int8", False)}
    head = by_key(sweep.run_sweep(None, word_tokenizer, dataclasses.replace(spec, quantize_lm_head=True),
                                  progress=False, engine=Spy(base.model, base.engine_kwargs)))
    assert set(built) == {("int8", False), ("int8", True)}
    assert all(head[key]["value"] != cell["value"] for key, cell in quantized.items())  # the head rounded too
    assert quantized.keys() == plain.keys()
    for key, cell in plain.items():  # int8 rounding moves the perplexity a little, not a lot
        assert quantized[key]["value"] != cell["value"]
        assert quantized[key]["value"] == pytest.approx(cell["value"], rel=0.05)
    with pytest.raises(ValueError, match="SweepSpec.quantization='int8' runs on the engine backend only, and policy "
                                         "'streaming' on the HF path"):
        dataclasses.replace(spec, policies=["full", "streaming"])
    with pytest.raises(ValueError, match="SweepSpec.quantization"):
        dataclasses.replace(spec, quantization="int3")
    with pytest.raises(ValueError, match=r"SweepSpec.quantize_lm_head=True needs quantization one of \('int4', "
                                         r"'int8'\), got None"):
        dataclasses.replace(spec, quantization=None, quantize_lm_head=True)


def test_a_selection_interval_shares_plain_quests_engine_and_reports_its_selection_rate(model_dir, word_tokenizer):
    fixed = "quest:selection_interval=3"
    spec = make_spec(tasks=["ppl"], policies=["quest", fixed], budgets=[16])
    ((quest, group),) = engine_backend.engine_configs(spec.settings(), PAGE, 1)
    assert (quest.selection_interval, len(group)) == (3, 2)  # each request brings its own interval
    cells = by_key(sweep.run_sweep(None, word_tokenizer, spec, progress=False, engine=source(model_dir)))
    cell = {policy: cells[("ppl", LENGTH, policy, 16)] for policy in ("quest", fixed)}
    # 8 scored tokens: 8 decode steps, of which outputs 0, 3 and 6 select with an interval of 3
    assert cell[fixed]["selection_rate"] == 3 / 8 and cell["quest"]["selection_rate"] == 1.0
    assert cell[fixed]["kv_bytes_per_step"] < cell["quest"]["kv_bytes_per_step"]  # bounds read 3 steps in 8
    document = sweep.document("tiny", spec, list(cells.values()), [{"command": "test"}])
    assert "Selection rate:" in report.markdown(document)
    with pytest.raises(ValueError, match="policy 'quest' takes no option 'reselect_similarity'"):  # removed
        harness.parse_policy("quest:reselect_similarity=0.9:selection_interval=8")


def test_the_kv_cache_dtype_reaches_the_engine_and_is_refused_for_the_hf_path(model_dir, word_tokenizer):
    built = []

    class Spy(engine_backend.EngineSource):
        def build(self, quest, max_model_len, max_num_seqs):
            built.append(self.engine_kwargs.get("kv_cache_dtype"))
            return super().build(quest, max_model_len, max_num_seqs)

    base = source(model_dir)
    spec = make_spec(tasks=["ppl"], kv_cache_dtype="fp8")
    fp8 = by_key(sweep.run_sweep(None, word_tokenizer, spec, progress=False, engine=Spy(base.model, base.engine_kwargs)))
    plain = by_key(sweep.run_sweep(None, word_tokenizer, dataclasses.replace(spec, kv_cache_dtype="auto"),
                                   progress=False, engine=base))
    assert built and set(built) == {"fp8"}
    assert fp8.keys() == plain.keys()
    for key, cell in plain.items():  # e4m3 rounding of K/V moves the perplexity a little, not a lot
        assert fp8[key]["value"] != cell["value"] and fp8[key]["value"] == pytest.approx(cell["value"], rel=0.1)
    with pytest.raises(ValueError, match="SweepSpec.kv_cache_dtype='fp8' runs on the engine backend only, and policy "
                                         "'streaming' on the HF path"):
        dataclasses.replace(spec, policies=["full", "streaming"])
    with pytest.raises(ValueError, match="SweepSpec.kv_cache_dtype must be one of"):
        dataclasses.replace(spec, kv_cache_dtype="int8")


def test_on_fp8_pages_the_agreement_reference_is_dense_on_model_dtype_pages(model_dir, word_tokenizer):
    """fp8's ``full`` is scored against the model dtype's dense tokens: a reference engine without
    ``kv_cache_dtype`` decodes them first, the same tokens a model-dtype sweep forces."""
    built = []

    class Spy(engine_backend.EngineSource):
        def build(self, quest, max_model_len, max_num_seqs):
            built.append((quest is None, self.engine_kwargs.get("kv_cache_dtype", "auto")))
            return super().build(quest, max_model_len, max_num_seqs)

    base = source(model_dir)
    fp8 = Spy(base.model, {**base.engine_kwargs, "kv_cache_dtype": "fp8"})
    todo = [("agreement_book", Setting("full", None))]
    found = {}
    for name, engine in (("fp8", fp8), ("auto", base)):
        inputs = engine_backend.Inputs(word_tokenizer, LENGTH, 2, random.randrange(10**6), 8, 8,
                                       agreement_texts={"agreement_book": agreement.load_text("agreement_book")[0]})
        cells = []
        engine_backend.run_length(engine, inputs, todo, PAGE, 1, lambda *args: cells.append(args[2]),
                                  word_tokenizer.eos_token_id)
        found[name] = (inputs.references["agreement_book"], cells[0])
    assert built == [(True, "auto"), (True, "fp8")]  # the reference's engine, then the cell's
    assert found["fp8"][0] == found["auto"][0]
    assert found["auto"][1]["value"] == 1.0
    assert found["fp8"][1]["ppl"] != found["auto"][1]["ppl"]  # fp8 pages scored the same tokens, not the same logits
