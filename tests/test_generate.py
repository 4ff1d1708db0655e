import pytest

from questkv import QuestConfig, cli
from questkv.generate import generate_text
from tests.helpers import tiny_llama, word_tokenizer


@pytest.fixture()
def tiny(monkeypatch):
    tokenizer = word_tokenizer([f"w{i}" for i in range(30)])
    model = tiny_llama(len(tokenizer), eos_token_id=1)
    monkeypatch.setattr("questkv.models.load_model", lambda *args, **kwargs: (model, tokenizer))
    return model


def test_generate_streams_and_reports_speed(tiny, capsys):
    stats = generate_text(" ".join(f"w{i % 30}" for i in range(60)), QuestConfig(token_budget=32), max_new_tokens=8)
    assert stats.prompt_tokens == 60 and 1 <= stats.new_tokens <= 8
    assert stats.prefill_tokens_per_s > 0
    assert capsys.readouterr().out.strip()


def test_generate_cli(tiny, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("w1 w2 w3 w4")
    assert cli.main(["generate", "--prompt-file", str(prompt), "--budget", "full", "--max-new-tokens", "4",
                     "--temperature", "0.8", "--top-p", "0.9"]) == 0
    assert "prefill: 4 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--budget", "24"], "multiple of page_size"),
    (["--budget", "64,128"], "one value"),
    (["--temperature", "-1"], "temperature must be in [0, inf], got -1.0"),
    (["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1, got 0"),
    (["--selection", "page"], "invalid choice: 'page'"),
    (["--sink-pages", "-1"], "sink-pages '-1' is not a non-negative integer"),
    (["--budget", "32", "--sink-pages", "1", "--recent-pages", "1"], "fewer than the 3 always-kept pages"),
])
def test_generate_cli_errors(tiny, argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "w1"] + argv)
    assert message in capsys.readouterr().err
