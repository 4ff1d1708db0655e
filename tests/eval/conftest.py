"""Fixtures of the eval tests: a word tokenizer covering the passkey prompt and a tiny random Llama."""

import re

import pytest

from questkv.eval import passkey
from tests.helpers import tiny_llama, word_tokenizer as build_word_tokenizer


@pytest.fixture(scope="session")
def word_tokenizer():
    """A word-level tokenizer (offline, instant) covering the passkey prompt: one token per word,
    digit and punctuation mark."""
    words = set(re.findall(r"\w+|[^\w\s]", " ".join([passkey.HEADER, passkey.FILLER, passkey.KEY_LINE, passkey.QUESTION])))
    return build_word_tokenizer(words | set("0123456789"), split_digits=True)


@pytest.fixture()
def tiny_model(word_tokenizer):
    return tiny_llama(len(word_tokenizer))
