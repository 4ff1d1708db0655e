"""IncrementalDetokenizer: the text it builds a few tokens at a time equals decoding all tokens at once.

Tokenizers are trained here in a second on mixed-script text (byte-level BPE, whose tokens split multi-byte
characters, and a SentencePiece-style Metaspace BPE, whose decoding of a token depends on its position); token
sequences are random, fed one token or several at a time.
"""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from questkv.engine.detokenizer import IncrementalDetokenizer
from tests.helpers import word_tokenizer

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Über die Brücke gehen schöne Mädchen.",
    "東京は日本の首都です。", "Ελληνικά γράμματα και λέξεις.", "emoji 🎉🚀 and more 🙂 text", "numbers 12345 and 3.14",
    "Привет, как дела?", "naïve café résumé coöperate", "mixed 漢字 and ascii, 🎉 ok.",
]


@functools.lru_cache(maxsize=None)
def trained(kind: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>" if kind == "metaspace" else None))
    if kind == "byte-level":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Metaspace()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<eos>"], initial_alphabet=alphabet)
    backend.train_from_iterator(_CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")


TOKENIZERS = {
    "byte-level": lambda: trained("byte-level"),
    "metaspace": lambda: trained("metaspace"),
    "word-level": lambda: word_tokenizer(" ".join(_CORPUS).split()),
}


def decode_all(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_incremental_text_equals_decoding_everything(kind, data):
    tokenizer = TOKENIZERS[kind]()
    vocab = len(tokenizer)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=0, max_size=40))
    steps = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
    detok = IncrementalDetokenizer(tokenizer)
    texts, end = [], 0
    for size in steps:
        if end >= len(ids):
            break
        end = min(end + size, len(ids))
        texts.append(detok.update(ids[:end], final=end == len(ids)))
    final = texts[-1] if texts else detok.text
    assert final == decode_all(tokenizer, ids)
    assert all(final.startswith(text) for text in texts)  # what was streamed is never taken back


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_real_text_round_trips_token_by_token(kind):
    tokenizer = TOKENIZERS[kind]()
    text = random.choice(_CORPUS) + " " + random.choice(_CORPUS)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    for end in range(1, len(ids) + 1):
        streamed = detok.update(ids[:end], final=end == len(ids))
    assert streamed == decode_all(tokenizer, ids)


def test_a_character_split_over_tokens_waits_for_its_last_byte_until_the_end():
    tokenizer = trained("byte-level")
    ids = [i for i in range(len(tokenizer)) if decode_all(tokenizer, [i]) == "\ufffd"][:1]
    if not ids:
        pytest.skip("the trained vocabulary has no lone continuation byte")
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.update(ids) == ""
    assert detok.update(ids, final=True) == decode_all(tokenizer, ids)


def test_fewer_tokens_than_already_read_is_refused():
    detok = IncrementalDetokenizer(trained("byte-level"))
    detok.update([5, 6, 7])
    with pytest.raises(ValueError, match="update got 2 tokens, fewer than the 3 already read"):
        detok.update([5, 6])
