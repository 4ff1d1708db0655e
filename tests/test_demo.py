"""The demos: ``questkv demo`` (a passkey prompt answered by the engine dense and with Quest, what ``make demo``
runs on smollm2-135m) on a tiny random model, its report, and ``questkv demo-tensors`` (random tensors)."""

import json
import random

import pytest

from questkv.cli import main
from questkv.demo import PAGE_NOTE, format_passkey_demo, run_passkey_demo
from questkv.eval import passkey
from tests.helpers import tiny_config, tiny_hf_model, word_tokenizer

VOCAB = 96


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama (3 layers) whose word tokenizer knows every word of the passkey prompts, one token
    per digit."""
    from tokenizers import pre_tokenizers

    path = tmp_path_factory.mktemp("tiny-passkey")
    text = passkey.passkey_prompt(len(passkey.FILLER) * 2, 0.5, 0)
    vocab = {word for word, _ in pre_tokenizers.Whitespace().pre_tokenize_str(text)} | set("0123456789")
    tokenizer = word_tokenizer(sorted(vocab), split_digits=True)
    assert len(tokenizer) <= VOCAB
    tiny_hf_model(tiny_config("llama3", vocab_size=VOCAB), seed=random.randrange(1 << 16)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_the_passkey_demo_answers_with_a_dense_and_a_quest_engine(model_dir):
    length, budget, max_tokens = random.randint(120, 160), 16, random.randint(3, 6)
    lines = []
    result = run_passkey_demo(str(model_dir), length=length, depth=random.random(), budgets=[budget, None],
                              page_size=4, max_tokens=max_tokens, seed=random.randrange(100), log=lines.append,
                              device="cpu", dtype="float32")
    assert abs(result["prompt_tokens"] - length) <= 4 and 1 <= result["key"] <= passkey.MAX_KEY
    assert result["num_layers"] == 3 and result["dense_layers"] == 2 and result["page_size"] == 4
    dense, quest = result["runs"]  # None in the budgets is the dense run, which always comes first
    assert (dense["name"], dense["token_budget"], quest["name"], quest["token_budget"]) == ("dense", None, "quest", 16)
    for run in result["runs"]:
        assert run["found"] == passkey.is_correct(run["text"], result["key"])
        assert run["prefill_seconds"] > 0 and 1 <= run["new_tokens"] <= max_tokens
    if dense["kv_fraction"] is not None:  # the random model may end at once (no decode step)
        assert dense["kv_fraction"] == pytest.approx(1.0)
    if quest["kv_fraction"] is not None:  # 2 dense layers read the context, 1 sparse layer the budget
        context = quest["mean_tokens_attended"] / quest["kv_fraction"]
        assert quest["mean_tokens_attended"] == pytest.approx((2 * context + budget) / 3)
    assert any("building the dense engine" in line for line in lines)
    assert any("quest (budget 16)" in line for line in lines)


def test_the_passkey_demo_report_names_the_key_each_answer_and_the_page_size_note():
    result = {"model": "m", "prompt_tokens": 3000, "depth": 0.5, "key": 4242, "page_size": 8, "dense_layers": 2,
              "num_layers": 30, "runs": [
                  dict(name="dense", token_budget=None, text=" 4242.", new_tokens=10, found=True,
                       decode_tokens_per_s=4.25, mean_tokens_attended=3005.0, kv_fraction=1.0, prefill_seconds=10.0),
                  dict(name="quest", token_budget=256, text=" 4243.", new_tokens=10, found=False,
                       decode_tokens_per_s=8.0, mean_tokens_attended=439.3, kv_fraction=0.1462, prefill_seconds=10.0),
                  dict(name="quest", token_budget=512, text="", new_tokens=1, found=False, decode_tokens_per_s=None,
                       mean_tokens_attended=None, kv_fraction=None, prefill_seconds=10.0),
              ]}
    report = format_passkey_demo(result)
    assert "pass key 4242 at 50% depth" in report and " ".join(report.split()).endswith(PAGE_NOTE)
    dense, quest, empty = (line for line in report.splitlines() if line.startswith(("dense ", "quest,")))
    assert "' 4242.'" in dense and " yes " in dense and "4.2" in dense and "100.0% (all 3005 tokens)" in dense
    assert "' 4243.'" in quest and " no " in quest and "14.6% (439 tokens of 3005: 256 in each of 28 sparse" in quest
    assert "n/a" in empty
    assert "page 16 did not" in PAGE_NOTE
    # the decode speed of 9 steps is noisy, and the report says so (the answer without a decode step has none)
    assert "decode tok/s is timed over 9 decode steps per answer, too few to time steadily: noisy on a shared CPU" \
        in " ".join(report.split())
    two = {**result, "runs": [{**result["runs"][0], "new_tokens": 4}, result["runs"][1]]}
    assert "timed over 3 to 9 decode steps per answer" in " ".join(format_passkey_demo(two).split())
    silent = {**result, "runs": [result["runs"][2]]}
    assert "decode tok/s is timed" not in format_passkey_demo(silent)


def test_the_demo_command_prints_the_report_and_writes_json(model_dir, tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert main(["demo", "--model", str(model_dir), "--length", "100", "--budgets", "16", "--page-size", "4",
                 "--max-tokens", "3", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert [run["token_budget"] for run in result["runs"]] == [None, 16]
    out, err = capsys.readouterr()
    assert "key found" in out and "quest, budget 16" in out and "building the dense engine" in err


@pytest.mark.parametrize("argv,message", [
    (["--length", "10"], "argument --length: '10' is not an integer >= 64"),
    (["--depth", "1.5"], "argument --depth: '1.5' is not a number in [0, 1]"),
    (["--max-tokens", "0"], "argument --max-tokens: '0' is not an integer >= 1"),
    (["--budgets", "64,abc"], "budget 'abc' is not a positive integer or 'full'"),
    (["--budgets", "12"], "multiple of page_size"),
    (["--device", "gpu"], "argument --device: invalid choice: 'gpu'"),
])
def test_bad_demo_values_exit_with_an_error_naming_them(argv, message, capsys, monkeypatch):
    monkeypatch.setattr("questkv.engine.llm.LLM", None)  # building an engine would fail the test
    with pytest.raises(SystemExit) as exit_info:
        main(["demo"] + argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_tensors_finds_the_planted_pages_and_full_budget_is_exact(tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert main(["demo-tensors", "--context", "1024", "--budgets", "256,full", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    sparse, full = rows
    assert full["budget"] is None and full["rel_error_vs_dense"] == 0.0
    assert sparse["kv_read"] == 0.25 and sparse["attention_mass"] > 0.9
    assert "budget" in capsys.readouterr().out


def test_demo_tensors_bad_budget_is_rejected(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["demo-tensors", "--budgets", "64,abc"])
    assert exit.value.code == 2
    assert "budget 'abc' is not a positive integer or 'full'" in capsys.readouterr().err
