"""questkv.eval.book: the public-domain book behind the essay tasks, and those tasks' haystacks."""

import random
import re

import pytest

from questkv.eval import book, passkey, perplexity, ruler, tasks
from questkv.models import loader


class WordTokenizer:
    """One token per whitespace-separated word (``encode`` for RULER, ``__call__`` for passkey)."""

    def encode(self, text):
        return text.split()

    def __call__(self, text):
        return type("Encoding", (), {"input_ids": text.split()})()


class CharTokenizer:
    """One token per character."""

    def __call__(self, text):
        return type("Encoding", (), {"input_ids": list(text)})()


def sentences_of(haystack, needle):
    """The haystack's sentences around the needle (the last one may be cut short)."""
    before, after = haystack.split(needle)
    return re.split(r"(?<=[.!?]) (?=[A-Z])", " ".join(part.strip() for part in (before, after) if part.strip()))


def test_the_book_is_the_checked_text():
    assert loader.sha256_file(book.path()) == book.SHA256
    text = book.text()
    assert "OPTICKS" in text and "By Sir _ISAAC NEWTON_, Knt." in text
    assert perplexity.load_text(perplexity.BOOK_TEXT).text == text
    assert perplexity.load_text(perplexity.BOOK_TEXT).source == "book:newton-opticks"


def test_sentences_are_prose_of_the_book():
    found = book.sentences()
    assert len(found) > 1000
    flat = " ".join(book.text().replace("_", "").split())
    for sentence in random.Random(0).sample(found, 50):
        assert sentence in flat and sentence[0].isupper() and sentence[-1] in ".!?"
        assert len(sentence.split()) >= book.MIN_SENTENCE_WORDS and "_" not in sentence
    assert not any("pgdp.net" in s or s.startswith("[") for s in found)


def test_a_staged_copy_is_used_and_checked(monkeypatch, tmp_path):
    installed = book.path()
    monkeypatch.setenv("QUESTKV_CACHE_DIR", str(tmp_path))
    book.staged_path().parent.mkdir(parents=True)
    book.staged_path().write_bytes(installed.read_bytes())
    assert book.path() == tmp_path / "texts" / "Isaac.Newton-Opticks.txt"
    book.staged_path().write_text("not the book", encoding="utf-8")
    with pytest.raises(ValueError, match="SHA-256"):
        book.path()


def test_haystack_words_depth_and_wrap_around():
    last = len(book.sentences()) - 1
    hay = book.haystack(last, 300, 0.5, "NEEDLE HERE.")
    assert hay.count("NEEDLE HERE.") == 1 and len(hay.split()) == 300 + 2
    assert hay.startswith(book.sentences()[last]) and book.sentences()[0] in hay  # wrapped to the start
    assert book.haystack(0, 40, 0.0, "N.").startswith("N. " + book.sentences()[0][:20])
    assert book.haystack(0, 0, 1.0, "N.") == "N."
    with pytest.raises(ValueError, match="start must be <="):
        book.haystack(last + 1, 10, 0.5, "N.")
    with pytest.raises(ValueError, match="depth"):
        book.haystack(0, 10, 1.5, "N.")


@pytest.mark.parametrize("length", [500, 3000])
def test_niah_single_essay(length):
    tokenizer, needle = WordTokenizer(), re.compile(r"One of the special magic numbers for (\S+) is: (\d{7})\.")
    samples = [ruler.generate("niah_single_essay", tokenizer, length, seed=seed) for seed in range(4)]
    for sample in samples:
        assert length - 1 <= sample.num_tokens <= length
        (found,) = needle.findall(sample.context)  # present once
        assert found[1] == sample.answers[0] and found[0] in sample.tail
        haystack = sample.context.split("\n")[1]
        complete = sentences_of(haystack, needle.search(haystack).group())[:-1]
        assert complete and all(s in book.sentences() for s in complete)  # the haystack is the book's
        assert ruler.NOISE.split(".")[0] not in sample.context
    assert len({s.prompt for s in samples}) == 4 and len({s.context.split("\n")[1][:80] for s in samples}) == 4
    assert ruler.generate("niah_single_essay", tokenizer, length, seed=2) == samples[2]


def test_passkey_essay():
    tokenizer, length = WordTokenizer(), 2000
    prompts = []
    for trial, depth in enumerate(passkey.trial_depths(3)):
        key = passkey.trial_key(1, length, trial)
        start = passkey.essay_start(1, length, trial)
        text = passkey.build_essay_prompt(tokenizer, length, depth, key, start)
        assert length - 1 <= len(text.split()) <= length
        key_line = passkey.KEY_LINE.format(key=key)
        assert text.count(key_line) == 1 and text.count(str(key)) == 2
        header, haystack, question = text.split("\n")
        assert (header, question) == (passkey.HEADER, passkey.QUESTION)
        assert haystack.startswith(key_line) if depth == 0 else haystack.startswith(book.sentences()[start])
        complete = sentences_of(haystack, key_line)[:-1]
        assert complete and all(s in book.sentences() for s in complete)
        prompts.append(text)
        assert passkey.build_essay_prompt(tokenizer, length, depth, key, start) == text
    assert len({passkey.essay_start(seed, length, 0) for seed in range(5)}) == 5
    with pytest.raises(ValueError, match="passkey length must be >= 64"):
        passkey.build_essay_prompt(tokenizer, 10, 0.5, 1, 0)
    with pytest.raises(ValueError, match="passkey_essay: length=70 tokens is shorter than its smallest prompt"):
        passkey.build_essay_prompt(CharTokenizer(), 70, 0.5, 1, 0)


def test_essay_tasks_are_registered():
    assert {"passkey_essay", "niah_single_essay"} <= set(tasks.TASKS)
