import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from questkv import cli
from questkv.generate import generate_text


@pytest.fixture()
def tiny(monkeypatch):
    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(30)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=1)).eval()
    monkeypatch.setattr("questkv.models.load_model", lambda *args, **kwargs: (model, tokenizer))
    return model


def test_generate_streams_and_reports_speed(tiny, capsys):
    stats = generate_text(" ".join(f"w{i % 30}" for i in range(60)), budget=32, max_new_tokens=8)
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
    (["--temperature", "-1"], "temperature must be >= 0"),
])
def test_generate_cli_errors(tiny, argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "w1"] + argv)
    assert message in capsys.readouterr().err
