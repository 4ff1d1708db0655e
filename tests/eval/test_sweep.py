"""questkv.eval.sweep and `questkv eval`: the grid, a complete and resumable run on a tiny random
Llama with a word-level tokenizer, the JSON document and the command line."""

import copy
import dataclasses
import json
import math
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from questkv import QuestConfig, cli
from questkv.eval import passkey, perplexity, sweep, tasks
from tests.helpers import tiny_llama

PAGE = 8
LENGTH = 96
SAMPLES = 2
SCORE_TOKENS = 8
POLICIES = ["full", "quest", "streaming", "h2o", "quest-topp"]
BUDGETS = [16, 32]
CELL_KEYS = {"task", "length", "policy", "budget", "metric", "value", "samples", "scores", "mean_tokens_attended",
             "kv_bytes_per_step", "kv_bytes_fraction", "seconds", "backend"}


def filler_text(path, rng: random.Random, words: int = 2 * LENGTH + 40) -> str:
    """A UTF-8 file of random passkey filler words (the word tokenizer covers them, no period)."""
    vocab = re.findall(r"\w+|[^\w\s]", passkey.FILLER)
    path.write_text(" ".join(rng.choice(vocab) for _ in range(words)), encoding="utf-8")
    return str(path)


def make_spec(text_file, **changes):
    kwargs = dict(
        tasks=["passkey", "ppl"], lengths=[LENGTH], policies=POLICIES, budgets=BUDGETS, samples=SAMPLES,
        page_size=PAGE, dense_layers=1, seed=random.randrange(10**6), score_tokens=SCORE_TOKENS, text_file=text_file,
        eval_backend="hf",
    )
    return sweep.SweepSpec(**{**kwargs, **changes})


def without_seconds(cell):
    return {k: v for k, v in cell.items() if k != "seconds"}


@pytest.fixture(scope="module")
def first_run(word_tokenizer, tmp_path_factory):
    """One complete sweep: ``(model, unpatched copy, spec, cells, cells seen by on_cell)``."""
    text_file = filler_text(tmp_path_factory.mktemp("text") / "filler.txt", random.Random())
    model = tiny_llama(len(word_tokenizer))
    unpatched = copy.deepcopy(model)
    spec = make_spec(text_file)
    seen = []
    cells = sweep.run_sweep(model, word_tokenizer, spec, on_cell=seen.append, progress=False)
    return model, unpatched, spec, cells, seen


# -- the grid ----------------------------------------------------------------------------------------


def test_settings_of_a_spec(tmp_path):
    spec = make_spec(None, policies=["full", "quest", "quest-topp", "h2o"], top_p=0.7, selection="q_head", recent_pages=1)
    labels = [s.label for s in spec.settings()]
    assert labels == ["full", "quest@16", "quest@32", "quest-topp@16", "quest-topp@32", "h2o@16", "h2o@32"]
    by_label = {s.label: s for s in spec.settings()}
    forced = {"sink_pages": 0, "recent_pages": 1}
    page = {"selection": "q_head", "group_reduction": "sum", **forced}
    assert dict(by_label["quest-topp@32"].options) == {"top_p": 0.7, **page}
    assert dict(by_label["quest@16"].options) == page
    assert by_label["h2o@16"].options == ()
    assert isinstance(spec.tasks, tuple) and isinstance(spec.budgets, tuple)


def test_policy_strings_give_settings_their_own_options():
    spec = make_spec(None, policies=["full", "quest:selection=q_head", "quest:page_size=4",
                                     "quest-topp:top_p=0.5:min_budget=16", "quest-rerank:shortlist=2"],
                     top_p=0.7, recent_pages=1, budgets=[32])
    page = {"selection": "kv_head", "group_reduction": "sum", "sink_pages": 0, "recent_pages": 1}
    by_label = {s.label: s for s in spec.settings()}
    assert list(by_label) == ["full", "quest:selection=q_head@32", "quest:page_size=4@32",
                              "quest-topp:min_budget=16:top_p=0.5@32", "quest-rerank:shortlist=2@32"]
    assert dict(by_label["quest:selection=q_head@32"].options) == {**page, "selection": "q_head"}
    paged = by_label["quest:page_size=4@32"]
    assert dict(paged.options) == page and paged.page_size == 4 and paged.build(PAGE, 1).page_size == 4
    assert dict(by_label["quest-topp:min_budget=16:top_p=0.5@32"].options) == {**page, "top_p": 0.5, "min_budget": 16}
    rerank = by_label["quest-rerank:shortlist=2@32"]
    assert dict(rerank.options) == {**page, "shortlist": 2} and rerank.build(PAGE, 1).shortlist == 2
    assert sweep.harness.parse_policy("quest-rerank:shortlist=4:rerank=mass") == (
        "quest-rerank", (("rerank", "mass"), ("shortlist", 4)))
    assert sweep.harness.format_policy("quest-rerank", (("rerank", "mass"), ("shortlist", 4))) == (
        "quest-rerank:rerank=mass:shortlist=4")


@pytest.mark.parametrize(
    "policy, message",
    [
        ("quest:top_p=0.5", r"policy 'quest' takes no option 'top_p'; its options: page_size, selection"),
        ("full:page_size=4", "policy 'full' takes no option 'page_size'; its options: none"),
        ("quest:selection", "option 'selection' is not option=value"),
        ("quest:sink_pages=1:sink_pages=2", "option 'sink_pages' given twice"),
        ("quest-rerank:shortlist=0", "shortlist must be >= 1, got 0"),
        ("quest-topp:min_budget=12", "min_budget must be a multiple of page_size=8, got 12"),
        ("quest:page_size=6", "QuestConfig.page_size must be a power of two, got 6"),
        ("quest:page_size=64", "QuestConfig.token_budget must be a multiple of page_size=64"),
    ],
)
def test_bad_policy_strings(policy, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_spec(None, policies=[policy], budgets=[16, 32])


def test_a_sweep_of_policy_strings(word_tokenizer):
    """Variants are cells of their own; a page size of its own gets its own prefill and bytes."""
    model = tiny_llama(len(word_tokenizer))
    spec = make_spec(None, tasks=["passkey"], samples=1, budgets=[16],
                     policies=["quest", "quest:page_size=4", "quest-rerank:shortlist=2", "quest-topp:min_budget=16"])
    cells = sweep.run_sweep(model, word_tokenizer, spec, progress=False)
    by_policy = {cell["policy"]: cell for cell in cells}
    assert sorted(by_policy) == sorted(["quest", "quest:page_size=4", "quest-rerank:shortlist=2",
                                        "quest-topp:min_budget=16"])
    shape = sweep.model_shape(model)
    for name, page_size in [("quest", PAGE), ("quest:page_size=4", 4)]:
        setting = sweep.Setting("quest", 16)
        assert by_policy[name]["kv_bytes_per_step"] == sweep.kv_bytes(
            setting, LENGTH, page_size, 1, shape, by_policy[name]["mean_tokens_attended"])["kv_bytes_per_step"]
    assert by_policy["quest-rerank:shortlist=2"]["kv_bytes_per_step"] > by_policy["quest"]["kv_bytes_per_step"]
    # the floor is the cap here: quest-topp attends what quest does
    assert by_policy["quest-topp:min_budget=16"]["mean_tokens_attended"] == by_policy["quest"]["mean_tokens_attended"]
    assert sweep.pending_settings(spec, cells) == []


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(tasks=["passkey", "bogus"]), r"SweepSpec.tasks\[1\] must be one of 'passkey', .*; got 'bogus'"),
        (dict(tasks=[]), "SweepSpec.tasks is empty"),
        (dict(policies=["quest", "bogus"]), r"SweepSpec.policies\[1\] must be one of 'full', .*; got 'bogus'"),
        (dict(policies=[]), "SweepSpec.policies is empty"),
        (dict(budgets=[]), "need at least one budget"),
        (dict(budgets=[16, 0]), r"SweepSpec.budgets\[1\] must be >= 1, got 0"),
        (dict(budgets=[16, None]), r"SweepSpec.budgets\[1\] must be an int, got None"),
        (dict(lengths=[]), "SweepSpec.lengths is empty"),
        (dict(lengths=[96, -1]), r"SweepSpec.lengths\[1\] must be >= 1, got -1"),
        (dict(score_tokens=95), r"SweepSpec.score_tokens must be <= 94 \(the shortest length, 96, .*got 95"),
        (dict(score_tokens=0), "SweepSpec.score_tokens must be >= 1, got 0"),
        (dict(samples=0), "SweepSpec.samples must be >= 1, got 0"),
        (dict(samples=1.5), r"SweepSpec.samples must be an int, got 1.5 \(float\)"),
        (dict(samples=True), r"SweepSpec.samples must be an int, got True \(bool\)"),
        (dict(budgets=[16, 12]), "multiple of page_size=8"),
        (dict(policies=["oracle"], budgets=[20]), "multiple of page_size=8"),
        (dict(selection="page"), "QuestConfig.selection must be one of 'kv_head', 'q_head'; got 'page'"),
        (dict(group_reduction="mean"), "QuestConfig.group_reduction must be one of 'sum', 'max'; got 'mean'"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_spec_validation(changes, message):
    with pytest.raises(ValueError, match=message):
        make_spec(None, **changes)


def test_spec_takes_its_quest_settings_from_quest_config():
    spec = sweep.SweepSpec(tasks=["passkey"], lengths=[LENGTH], policies=["full"])
    defaults = {field.name: field.default for field in dataclasses.fields(QuestConfig)}
    assert sweep.QUEST_FIELDS == ("page_size", "dense_layers", "selection", "group_reduction", "sink_pages",
                                  "recent_pages")
    assert {name: getattr(spec, name) for name in sweep.QUEST_FIELDS} == {n: defaults[n] for n in sweep.QUEST_FIELDS}


def test_spec_accepts_valid_corner_cases():
    make_spec(None, policies=["full"], budgets=[])  # full needs no budget
    make_spec(None, policies=["streaming", "h2o", "tova"], budgets=[12])  # eviction budgets are free
    make_spec(None, tasks=["passkey"], score_tokens=10**6)  # score_tokens is only for ppl


# -- a complete run ----------------------------------------------------------------------------------


def test_every_cell_once_with_its_documented_keys(first_run, word_tokenizer):
    model, unpatched, spec, cells, seen = first_run
    expected = {(task, LENGTH, "full", None) for task in spec.tasks} | {
        (task, LENGTH, policy, budget) for task in spec.tasks for policy in POLICIES[1:] for budget in BUDGETS
    }
    keys = [sweep.cell_key(cell) for cell in cells]
    assert sorted(keys, key=repr) == sorted(expected, key=repr) and len(keys) == len(set(keys)) == 18
    assert seen == cells  # on_cell saw every new cell, in order
    samples = tasks.make_samples("passkey", word_tokenizer, LENGTH, SAMPLES, spec.seed)
    for cell in cells:
        accuracy = cell["task"] != "ppl"
        assert set(cell) == CELL_KEYS | ({"outputs"} if accuracy else set()), cell
        assert cell["samples"] == SAMPLES and len(cell["scores"]) == SAMPLES
        assert cell["seconds"] >= 0
        if cell["policy"] == "full":
            assert cell["mean_tokens_attended"] is None
        else:
            assert 0 < cell["mean_tokens_attended"] <= cell["budget"]
        if accuracy:
            assert cell["metric"] == "accuracy"
            assert cell["value"] == pytest.approx(sum(cell["scores"]) / SAMPLES)
            assert len(cell["outputs"]) == SAMPLES and all(isinstance(o, str) for o in cell["outputs"])
            rescored = [tasks.score("passkey", out, s.answers) for out, s in zip(cell["outputs"], samples)]
            assert cell["scores"] == rescored
        else:
            assert cell["metric"] == "ppl" and cell["value"] > 1
            geometric = math.exp(sum(math.log(s) for s in cell["scores"]) / SAMPLES)  # equal windows
            assert cell["value"] == pytest.approx(geometric, rel=1e-4)
    # KV bytes: the cost formula at the cell's length with the measured tokens attended; full reads it all.
    shape = sweep.model_shape(model)
    assert shape["num_layers"] == model.config.num_hidden_layers and shape["dtype_bytes"] == 4
    for cell in cells:
        setting = sweep.Setting(cell["policy"], cell["budget"], ())
        assert {k: cell[k] for k in ("kv_bytes_per_step", "kv_bytes_fraction")} == sweep.kv_bytes(
            setting, LENGTH, PAGE, spec.dense_layers, shape, cell["mean_tokens_attended"])
        assert (cell["kv_bytes_fraction"] == 1.0) == (cell["policy"] == "full")
        assert cell["kv_bytes_fraction"] > 0
    # Every page or eviction policy charges the whole budget once the context outgrows it.
    for cell in cells:
        if cell["task"] == "ppl" and cell["policy"] in ("quest", "streaming", "h2o"):
            assert cell["mean_tokens_attended"] == cell["budget"]


def test_full_perplexity_is_the_dense_models(first_run, word_tokenizer):
    model, unpatched, spec, cells, _ = first_run
    text = perplexity.load_text(spec.text_file).text
    windows = perplexity.windows(word_tokenizer, text, LENGTH, SAMPLES)
    with torch.no_grad():
        log_probs = torch.log_softmax(unpatched(windows, use_cache=False).logits.double(), -1)
    nll = -log_probs[:, :-1].gather(-1, windows[:, 1:, None])[..., 0][:, -SCORE_TOKENS:]  # the last tokens
    (full,) = [c for c in cells if c["task"] == "ppl" and c["policy"] == "full"]
    assert full["value"] == pytest.approx(math.exp(float(nll.mean())), rel=1e-4)
    assert full["scores"] == pytest.approx([math.exp(float(row.mean())) for row in nll], rel=1e-3)


def test_a_finished_run_computes_nothing(first_run, word_tokenizer):
    model, _, spec, cells, _ = first_run
    seen = []
    again = sweep.run_sweep(model, word_tokenizer, spec, done=cells, on_cell=seen.append, progress=False)
    assert seen == [] and again == cells
    assert sweep.pending_settings(spec, cells) == []


def test_a_resumed_run_computes_exactly_the_missing_cells(first_run, word_tokenizer):
    model, _, spec, cells, _ = first_run
    rng = random.Random()
    missing = rng.sample(range(len(cells)), 5)
    done = [cell for i, cell in enumerate(cells) if i not in missing]
    expected = {sweep.cell_key(cells[i]) for i in missing}
    assert {(task, length, s.policy, s.budget) for length, task, s in sweep.pending_settings(spec, done)} == expected
    seen = []
    resumed = sweep.run_sweep(model, word_tokenizer, spec, done=done, on_cell=seen.append, progress=False)
    assert resumed[: len(done)] == done and resumed[len(done):] == seen
    assert len(seen) == len(missing) and {sweep.cell_key(cell) for cell in seen} == expected
    first = {sweep.cell_key(cell): cell for cell in cells}
    for cell in seen:  # deterministic: the very same results
        assert without_seconds(cell) == without_seconds(first[sweep.cell_key(cell)])


# -- the document ------------------------------------------------------------------------------------


def test_document_round_trip_and_shared_settings(tmp_path, first_run):
    _, _, spec, cells, _ = first_run
    path = tmp_path / "out" / "sweep.json"
    assert sweep.load_document(path, "tiny", spec) is None
    runs = [{"command": "test"}]
    document = sweep.document("tiny", spec, cells, runs, {"source": spec.text_file})
    sweep.save(path, document)
    assert not path.with_suffix(".json.tmp").exists()
    loaded = sweep.load_document(path, "tiny", spec)
    assert loaded["cells"] == json.loads(json.dumps(cells)) and loaded["runs"] == runs and loaded["model"] == "tiny"
    # A grown grid (another budget, another policy, another length) resumes: only its new cells are pending.
    grown = dataclasses.replace(spec, budgets=BUDGETS + [48], policies=POLICIES + ["tova"], lengths=[LENGTH, 128])
    assert sweep.load_document(path, "tiny", grown) is not None
    pending = {(t, ln, s.policy, s.budget) for ln, t, s in sweep.pending_settings(grown, loaded["cells"])}
    assert all(ln == 128 or b == 48 or p == "tova" for t, ln, p, b in pending)
    assert ("ppl", LENGTH, "quest", 48) in pending and ("passkey", LENGTH, "tova", 16) in pending
    assert len(pending) == len(grown.settings()) * 2 * 2 - 18
    # Another shared setting, or another model, is refused with its name.
    for name, value in [("samples", 3), ("page_size", 16), ("dense_layers", 2), ("seed", spec.seed + 1),
                        ("score_tokens", 9), ("top_p", 0.5), ("selection", "q_head"), ("text_file", None),
                        ("recent_pages", 1), ("sink_pages", 1), ("group_reduction", "max"),
                        ("eval_backend", "auto"), ("agreement_tokens", 64), ("code_commit", "abc")]:
        with pytest.raises(ValueError, match=f"{name}="):
            sweep.load_document(path, "tiny", dataclasses.replace(spec, **{name: value}))
    # A document written before a shared setting existed reads it as its default (its backend: the HF path).
    del document["spec"]["sink_pages"], document["spec"]["recent_pages"], document["spec"]["group_reduction"]
    del document["spec"]["eval_backend"], document["spec"]["agreement_tokens"], document["spec"]["code_commit"]
    sweep.save(path, document)
    assert sweep.load_document(path, "tiny", spec) is not None
    with pytest.raises(ValueError, match="eval_backend='hf'"):
        sweep.load_document(path, "tiny", dataclasses.replace(spec, eval_backend="auto"))
    with pytest.raises(ValueError, match="model='tiny'"):
        sweep.load_document(path, "other", spec)


def test_resume_sweep_of_a_finished_document_loads_nothing(tmp_path, first_run):
    _, _, spec, cells, _ = first_run
    path = tmp_path / "sweep.json"
    runs = [{"command": "first"}]
    sweep.save(path, sweep.document("tiny", spec, [dict(cell, run=0) for cell in cells], runs, {"source": "x"}))

    def fail():
        raise AssertionError("called although every cell is done")

    saved = json.loads(path.read_text())
    assert json.loads(json.dumps(sweep.resume_sweep(path, "tiny", spec, fail, fail, progress=False))) == saved
    assert json.loads(path.read_text()) == saved  # not rewritten
    with pytest.raises(ValueError, match="samples=2"):
        sweep.resume_sweep(path, "tiny", dataclasses.replace(spec, samples=3), fail, fail, progress=False)
    with pytest.raises(ValueError, match="model='tiny'"):
        sweep.resume_sweep(path, "other", spec, fail, fail, progress=False)


# -- the command line --------------------------------------------------------------------------------


@pytest.fixture()
def patched_loader(monkeypatch, word_tokenizer):
    """``questkv.models.load_model`` returns a tiny model; ``calls`` counts the loads, ``fail`` makes it raise."""
    state = {"calls": 0, "fail": False}

    def load(*args, **kwargs):
        if state["fail"]:
            raise AssertionError("the model was loaded although every cell was done")
        state["calls"] += 1
        return tiny_llama(len(word_tokenizer)), word_tokenizer

    monkeypatch.setattr("questkv.models.load_model", load)
    monkeypatch.setattr("questkv.models.loader.load_tokenizer", lambda *args, **kwargs: word_tokenizer)
    return state


def test_cli_sweep_writes_json_md_png_and_resumes(tmp_path, patched_loader, capsys):
    text_file = filler_text(tmp_path / "text.txt", random.Random())
    path = tmp_path / "sweep.json"
    argv = ["eval", "sweep", "--tasks", "passkey,ppl", "--lengths", "80", "--policies", "full,streaming",
            "--budgets", "12", "--samples", "1", "--page-size", "8", "--dense-layers", "1", "--score-tokens", "6",
            "--text-file", text_file, "--json", str(path), "--eval-backend", "hf"]
    assert cli.main(argv) == 0
    assert patched_loader["calls"] == 1
    document = json.loads(path.read_text())
    assert document["model"] == "smollm2-135m"
    assert document["spec"]["budgets"] == [12] and document["spec"]["text_file"] == text_file
    assert document["text"]["source"] == text_file and len(document["text"]["sha256"]) == 64
    assert len(document["runs"]) == 1
    keys = {(c["task"], c["policy"], c["budget"]) for c in document["cells"]}
    assert keys == {("passkey", "full", None), ("passkey", "streaming", 12), ("ppl", "full", None), ("ppl", "streaming", 12)}
    assert all(c["run"] == 0 for c in document["cells"])
    png, md = path.with_suffix(".png"), path.with_suffix(".md")
    assert png.read_bytes().startswith(b"\x89PNG") and "sweep.png" in md.read_text()
    out, err = capsys.readouterr()
    assert "ppl" in out and "\r" not in out and "eval:" not in out  # the table alone on stdout
    assert "eval: 100%" in err.split("\r")[-1] and "4/4" in err  # the progress over the cells, on stderr
    assert re.search(r"decode: +0%.* 0/\d+ ", err)  # and over each setting's decode steps, erased when done
    # Rerun: everything is done, the model is never loaded, nothing changes.
    patched_loader["fail"] = True
    png.unlink()
    assert cli.main(argv) == 0
    again = json.loads(path.read_text())
    assert again["cells"] == document["cells"] and again["runs"] == document["runs"]
    assert png.read_bytes().startswith(b"\x89PNG")
    # `eval report` redraws the table and the plot from the JSON alone.
    png.unlink()
    md.unlink()
    assert cli.main(["eval", "report", str(path)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG") and md.read_text().startswith("# questkv eval: smollm2-135m")
    assert json.loads(path.read_text()) == document
    # A grown grid resumes: one load, only the new budget's cells, a second run recorded.
    patched_loader["fail"] = False
    assert cli.main(argv[: argv.index("--budgets") + 1] + ["12,16"] + argv[argv.index("--budgets") + 2:]) == 0
    grown = json.loads(path.read_text())
    assert patched_loader["calls"] == 2 and len(grown["runs"]) == 2
    assert grown["cells"][:4] == document["cells"]
    assert {(c["task"], c["policy"], c["budget"], c["run"]) for c in grown["cells"][4:]} == {
        ("passkey", "streaming", 16, 1), ("ppl", "streaming", 16, 1)
    }


@pytest.mark.parametrize(
    "argv,message",
    [
        (["eval", "sweep", "--tasks", "passkey", "--policies", "full,bogus"], "policy 'bogus' not known"),
        (["eval", "sweep", "--tasks", "passkey", "--policies", "full,quest:shortlist=2"],
         "policy 'quest' takes no option 'shortlist'"),
        (["eval", "sweep", "--tasks", "passkey,bogus"], "task 'bogus' not known"),
        (["eval", "sweep"], "--tasks"),
        (["eval", "passkey", "--lengths", "1k"], "positive integers"),
        (["eval", "passkey", "--budgets", "12", "--page-size", "8"], "questkv eval passkey: error: "),
        (["eval", "sweep", "--tasks", "ppl", "--lengths", "64", "--score-tokens", "63"],
         "SweepSpec.score_tokens must be <= 62"),
        (["eval", "sweep", "--tasks", "passkey", "--samples", "0"], "SweepSpec.samples must be >= 1, got 0"),
        (["eval", "report", "/nonexistent/sweep.json"], "is not a file"),
    ],
)
def test_cli_rejects_bad_flags(argv, message, capsys, patched_loader):
    patched_loader["fail"] = True
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_refuses_to_resume_other_settings(tmp_path, patched_loader, capsys):
    path = tmp_path / "sweep.json"
    spec = make_spec(None, tasks=["passkey"], samples=3)
    sweep.save(path, sweep.document("smollm2-135m", spec, [], []))
    patched_loader["fail"] = True
    argv = ["eval", "passkey", "--lengths", "96", "--samples", "2", "--seed", str(spec.seed), "--json", str(path),
            "--eval-backend", "hf"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert "samples=3" in capsys.readouterr().err


@settings(max_examples=60, deadline=None)
@given(tasks=st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=8),
       samples=st.integers(1, 30), length=st.integers(1, 64), limit=st.integers(1, 200_000))
def test_task_groups_keep_the_order_and_stay_under_the_prefill_limit(tasks, samples, length, limit):
    groups = sweep.task_groups(tasks, samples, length, limit)
    assert [t for group in groups for t in group] == tasks
    for group, following in zip(groups, groups[1:] + [None]):
        assert len(group) == 1 or len(group) * samples * length**2 <= limit
        if following is not None:  # greedy: the next task did not fit
            assert (len(group) + 1) * samples * length**2 > limit
