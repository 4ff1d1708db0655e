import re

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from questkv.eval import passkey


@pytest.fixture(scope="session")
def word_tokenizer():
    """A word-level tokenizer (offline, instant) covering the passkey prompt: one token per word,
    digit and punctuation mark."""
    words = set(re.findall(r"\w+|[^\w\s]", " ".join([passkey.HEADER, passkey.FILLER, passkey.KEY_LINE, passkey.QUESTION])))
    vocab = {"<unk>": 0, "<eos>": 1}
    for word in sorted(words | set("0123456789")):
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")


@pytest.fixture()
def tiny_model(word_tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(word_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    return LlamaForCausalLM(config).eval()
