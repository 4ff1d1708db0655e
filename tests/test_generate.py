"""``questkv generate`` on the engine: streaming, statistics, chat template, Quest and engine flags, bad values.

A tiny random Llama (3 layers, llama3 rope) is saved with a word tokenizer (token ``i >= 2`` is the word ``x{i:02d}``)
and a chat template once per module; prompts are fresh random words in every test, fp32 on the CPU.
"""

import random
import re

import pytest
import torch

from questkv import QuestConfig, cli
from questkv.engine.llm import LLM
from questkv.engine.sampling_params import SamplingParams
from questkv.generate import GenerationStats, generate_text, kv_read, mean_decode_context
from tests.helpers import save_tiny_model

VOCAB = 96
CHAT_TEMPLATE = ("{% for m in messages %}x03 {{ m['content'] }} x04 {% endfor %}"
                 "{% if add_generation_prompt %}x05{% endif %}")
ENGINE = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "128"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    path = save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), VOCAB, seed=random.randrange(1 << 16))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def words(n: int) -> str:
    return " ".join(f"x{t:02d}" for t in torch.randint(2, VOCAB, (n,)).tolist())


def reference(model_dir, prompt, max_tokens, quest=None):
    """The engine's own greedy output for ``prompt`` (what the command must stream)."""
    llm = LLM(str(model_dir), quest=quest, device="cpu", dtype="float32", max_model_len=128)
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]


def long_answer(model_dir, length, max_tokens, quest=None, least=4):
    """A fresh prompt of ``length`` words whose greedy answer has at least ``least`` tokens (the random model may
    emit its end-of-sequence token early), and that answer."""
    for _ in range(50):
        prompt = words(length)
        out = reference(model_dir, prompt, max_tokens, quest)
        if len(out.token_ids) >= least:
            return prompt, out
    raise AssertionError("the tiny model kept stopping early")


def test_generate_streams_the_engines_greedy_text_then_prints_the_statistics(model_dir, tmp_path, capsys):
    prompt, ref = long_answer(model_dir, random.randint(5, 40), 12)
    path = tmp_path / "prompt.txt"
    path.write_text(prompt)
    assert cli.main(["generate", "--model", str(model_dir), "--prompt-file", str(path), "--max-new-tokens", "12",
                     *ENGINE]) == 0
    out, err = capsys.readouterr()
    assert out == ref.text + "\n"
    n = len(ref.prompt_token_ids)
    assert f"prompt: {n} tokens" in err and f"decode: {len(ref.token_ids)} tokens" in err
    assert re.search(r"prefill: [0-9.]+ tok/s \([0-9.]+ s to the first token\)", err)
    assert re.search(r"decode: \d+ tokens, [0-9.]+ tok/s", err)
    assert "attended: " in err and "(100.0% of the KV cache)" in err  # dense reads every token


def test_generate_with_quest_attends_the_budget_in_the_sparse_layers(model_dir, capsys):
    # Quest at every step (dense_context_ratio 1): the default's cost model routes contexts up to 64 tokens dense
    quest = QuestConfig(token_budget=16, page_size=4, dense_layers=1, dense_context_ratio=1.0)
    prompt, ref = long_answer(model_dir, random.randint(60, 90), 10, quest)
    stream = []

    class Sink:
        def write(self, text):
            stream.append(text)

        def flush(self):
            pass

    stats = generate_text(prompt, quest, model=str(model_dir), max_new_tokens=10, stream=Sink(), device="cpu",
                          dtype="float32", max_model_len=128)
    assert "".join(stream) == ref.text + "\n" and len(stream) > 2  # piece by piece, then the newline
    assert stats.new_tokens == len(ref.token_ids) and stats.prompt_tokens == len(ref.prompt_token_ids)
    assert stats.mean_tokens_attended == pytest.approx(ref.metrics.mean_tokens_attended)
    dense_layer, sparse_layers = stats.mean_context, 2 * 16  # the context always exceeds the budget here
    assert stats.mean_tokens_attended == pytest.approx((dense_layer + sparse_layers) / 3)
    assert stats.kv_fraction == pytest.approx(stats.mean_tokens_attended / stats.mean_context)
    assert stats.kv_fraction < 0.6
    assert stats.prefill_tokens_per_s > 0 and stats.decode_tokens_per_s > 0
    assert cli.main(["generate", "--model", str(model_dir), "--prompt", prompt, "--budget", "16", "--page-size", "4",
                     "--dense-layers", "1", "--dense-context-ratio", "1", "--max-new-tokens", "10", *ENGINE]) == 0
    out, err = capsys.readouterr()
    assert out == ref.text + "\n" and f"({stats.kv_fraction:.1%} of the KV cache)" in err


def test_a_budget_larger_than_the_context_reads_the_whole_context_and_no_more(model_dir, capsys):
    """``--budget 64`` on a short prompt: the share of the KV cache read is 100 %, never more."""
    quest = QuestConfig(token_budget=64, page_size=16, dense_layers=1)
    prompt, ref = long_answer(model_dir, random.randint(3, 12), 8, quest)
    stats = generate_text(prompt, quest, model=str(model_dir), max_new_tokens=8, stream=None, device="cpu",
                          dtype="float32", max_model_len=128)
    assert stats.mean_tokens_attended == pytest.approx(stats.mean_context) and stats.kv_fraction == pytest.approx(1)
    assert cli.main(["generate", "--model", str(model_dir), "--prompt", prompt, "--budget", "64", "--page-size", "16",
                     "--max-new-tokens", "8", *ENGINE]) == 0
    assert "(100.0% of the KV cache)" in capsys.readouterr().err


def test_generate_with_a_speculative_config_streams_the_dense_text_and_reports_the_drafts_kept(model_dir, capsys):
    """Lossless Quest: Quest drafts, dense attention verifies; the text is the dense engine's."""
    prompt, ref = long_answer(model_dir, random.randint(60, 90), 10)  # dense; the context exceeds the budget
    quest = QuestConfig(token_budget=16, page_size=4, dense_layers=1, dense_context_ratio=1.0)
    stats = generate_text(prompt, quest, model=str(model_dir), max_new_tokens=10, stream=None, device="cpu",
                          dtype="float32", max_model_len=128,
                          speculative_config={"method": "quest", "num_speculative_tokens": 3})
    assert stats.new_tokens == len(ref.token_ids)
    assert 0 <= stats.acceptance_rate <= 1 and 1 <= stats.mean_tokens_per_verify <= 3 + 1
    assert 1 <= len(stats.acceptance_by_position) <= 3 and all(0 <= rate <= 1 for rate in stats.acceptance_by_position)
    assert cli.main(["generate", "--model", str(model_dir), "--prompt", prompt, "--budget", "16", "--page-size", "4",
                     "--dense-layers", "1", "--dense-context-ratio", "1", "--max-new-tokens", "10", *ENGINE,
                     "--speculative-config", '{"method": "quest", "num_speculative_tokens": 3}']) == 0
    out, err = capsys.readouterr()
    assert out == ref.text + "\n"
    assert re.search(r"\| lossless: [0-9.]+% of the drafts kept \([0-9]+%( / [0-9]+%){0,2} by position\), "
                     r"[0-9.]+ tokens per verify step", err)


def test_a_speculative_config_needs_a_budget_and_is_refused_before_the_model_loads(capsys, monkeypatch):
    monkeypatch.setattr("questkv.engine.llm_engine.LLMEngine", None)  # loading a model would fail the test
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--prompt", "x02", *ENGINE, "--speculative-config", '{"method": "quest"}'])
    assert exit_info.value.code == 2
    assert "EngineConfig.speculative_config drafts with Quest's sparse attention" in capsys.readouterr().err


def test_kv_read_caps_the_pages_counted_in_full_at_the_context():
    """Quest's accounting counts every selected page in full, the current, partial one too: 2 pages of 16 for a
    context of 20 tokens count 32; a step reads at most its context."""
    context = mean_decode_context(prompt_tokens=15, new_tokens=10)
    assert context == 20
    assert kv_read(32.0, context) == (20, 1.0)
    assert kv_read(5.0, context) == (5.0, 0.25)
    assert kv_read(None, context) == (None, None)
    stats = GenerationStats(prompt_tokens=15, new_tokens=10, prefill_seconds=0.5, decode_tokens_per_s=3.0,
                            mean_tokens_attended=32.0, finish_reason="length")
    assert stats.kv_fraction == 1.0


def test_the_prefill_progress_goes_to_stderr_and_the_text_alone_to_stdout(model_dir, capsys):
    prompt, ref = long_answer(model_dir, random.randint(20, 40), 6)
    stats = generate_text(prompt, model=str(model_dir), max_new_tokens=6, device="cpu", dtype="float32",
                          max_model_len=128, enable_chunked_prefill=True, max_num_batched_tokens=8)
    out, err = capsys.readouterr()
    assert out == ref.text + "\n" and "prefill" in err and "tok" in err  # a bar over the prompt's chunks of 8
    assert stats.prompt_tokens == len(ref.prompt_token_ids)
    generate_text(prompt, model=str(model_dir), max_new_tokens=6, device="cpu", dtype="float32", max_model_len=128,
                  progress=False)
    assert capsys.readouterr().err == ""


def test_chat_renders_the_prompt_with_the_tokenizers_template(model_dir, capsys):
    message = words(random.randint(3, 10))
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=128)
    ids = llm.tokenizer(f"x03 {message} x04 x05")["input_ids"]
    (ref,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert cli.main(["generate", "--model", str(model_dir), "--prompt", message, "--chat", "--max-new-tokens", "5",
                     *ENGINE]) == 0
    out, err = capsys.readouterr()
    assert out == ref.text + "\n" and f"prompt: {len(ids)} tokens" in err


def test_sampling_with_a_seed_reproduces(model_dir, capsys):
    argv = ["generate", "--model", str(model_dir), "--prompt", words(8), "--temperature", "0.9", "--top-p", "0.8",
            "--max-new-tokens", "8", "--seed", str(random.randrange(1000)), *ENGINE]
    outputs = []
    for _ in range(2):
        assert cli.main(argv) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]


def test_stats_without_a_decode_step_report_no_decode_speed():
    stats = GenerationStats(prompt_tokens=10, new_tokens=1, prefill_seconds=0.5, decode_tokens_per_s=None,
                            mean_tokens_attended=None, finish_reason="length")
    assert stats.prefill_tokens_per_s == 20 and stats.kv_fraction is None
    assert "decode: 1 tokens, n/a" in stats.summary() and "attended" not in stats.summary()


@pytest.mark.parametrize("argv,message", [
    (["--budget", "20"], "multiple of page_size=8"),  # the default page size is the demo's
    (["--budget", "64,128"], "one value"),
    (["--temperature", "-1"], "SamplingParams.temperature must be in [0.0, inf], got -1.0"),
    (["--top-p", "0"], "SamplingParams.top_p must be in (0.0, 1.0], got 0.0"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: '0' is not an integer >= 1"),
    (["--selection", "page"], "invalid choice: 'page'"),
    (["--sink-pages", "-1"], "sink-pages '-1' is not a non-negative integer"),
    (["--budget", "16", "--sink-pages", "1", "--recent-pages", "1"], "fewer than the 3 always-kept pages"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--max-model-len", "1"], "argument --max-model-len: '1' is not an integer >= 2"),
    (["--seed", "-3"], "argument --seed: '-3' is not an integer >= 0"),
    (["--seed", "x"], "argument --seed: 'x' is not an integer >= 0"),
    (["--speculative-config", "quest"], "argument --speculative-config: 'quest' is not JSON"),
    (["--speculative-config", '{"method": "medusa"}'], "argument --speculative-config: SpeculativeConfig.method"),
])
def test_bad_values_exit_with_an_error_naming_them_before_the_model_loads(argv, message, capsys, monkeypatch):
    monkeypatch.setattr("questkv.engine.llm.LLM", None)  # loading a model would fail the test
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--prompt", "x02"] + argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_chat_without_a_template_is_an_error(model_dir, tmp_path, capsys):
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(model_dir, plain)
    config = plain / "tokenizer_config.json"
    import json

    data = json.loads(config.read_text())
    data.pop("chat_template", None)
    config.write_text(json.dumps(data))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--model", str(plain), "--prompt", "x02", "--chat", *ENGINE])
    assert exit_info.value.code == 2 and "--chat needs a tokenizer with a chat template" in capsys.readouterr().err
