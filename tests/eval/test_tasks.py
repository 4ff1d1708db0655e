"""questkv.eval.tasks: samples of every task as token ids (context + tail), and the scores."""

import random
import re
import types

import pytest

from questkv.eval import passkey, ruler, tasks


class SpaceTokenizer:
    """A lossless word-level stub: every token is a word plus the whitespace after it (the text's
    leading whitespace is a token of its own); ids are assigned on first sight."""

    eos_token_id = None

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def _tokens(self, text):
        return [(m.group(), m.start(), m.end()) for m in re.finditer(r"^\s+|\S+\s*", text)]

    def _id(self, token):
        if token not in self.vocab:
            self.vocab[token] = len(self.words)
            self.words.append(token)
        return self.vocab[token]

    def encode(self, text):
        return [self._id(token) for token, _, _ in self._tokens(text)]

    def __call__(self, text, return_offsets_mapping=False, add_special_tokens=True):
        tokens = self._tokens(text)
        out = types.SimpleNamespace(input_ids=[self._id(token) for token, _, _ in tokens])
        if return_offsets_mapping:
            out.offset_mapping = [(start, end) for _, start, end in tokens]
        return out

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.words[i] for i in ids)


MAX_NEW_TOKENS = {"passkey": passkey.ANSWER_TOKENS, "passkey_essay": passkey.ANSWER_TOKENS, "niah_single": 128,
                  "niah_single_essay": 128, "niah_multikey": 128, "niah_uuid": 128, "vt": 30, "cwe": 120, "fwe": 50}
RULER_LENGTH = 900  # words: cwe's smallest prompt (10 common words x 30) is about 700


def test_every_task_is_listed():
    assert tasks.TASKS == ("passkey", "passkey_essay") + tuple(ruler.TASKS)
    assert set(MAX_NEW_TOKENS) == set(tasks.TASKS)


@pytest.mark.parametrize("length", [100, 257])
def test_passkey_samples(word_tokenizer, length):
    seed = random.randrange(10**6)
    samples = tasks.make_samples("passkey", word_tokenizer, length, 3, seed=seed)
    assert len(samples) == 3
    for index, (sample, depth) in enumerate(zip(samples, [0.0, 0.5, 1.0])):
        key = passkey.trial_key(seed, length, index)
        assert sample.task == "passkey" and sample.answers == (str(key),)
        assert sample.max_new_tokens == passkey.ANSWER_TOKENS
        assert abs(sample.num_tokens - length) <= 4
        assert len(sample.context_ids) >= 1 and len(sample.tail_ids) >= 1
        # context + tail is the tokenization of the prompt with this sample's key and depth
        text = passkey.build_prompt(word_tokenizer, length, depth, key)
        assert list(sample.context_ids + sample.tail_ids) == word_tokenizer(text).input_ids
        assert word_tokenizer.decode(list(sample.tail_ids)).endswith("The pass key is")
        # the key, one digit a token (short prompts are mostly tail: the last 400 characters)
        assert word_tokenizer.decode(list(sample.context_ids + sample.tail_ids)).count(" ".join(str(key))) == 2


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_ruler_samples(task):
    tokenizer = SpaceTokenizer()
    seed = random.randrange(10**6)
    samples = tasks.make_samples(task, tokenizer, RULER_LENGTH, 2, seed=seed)
    assert len(samples) == 2
    for index, sample in enumerate(samples):
        expected = ruler.generate(task, tokenizer, RULER_LENGTH, seed=seed * 1_000_003 + index)
        assert sample.task == task and sample.answers == expected.answers
        assert sample.max_new_tokens == MAX_NEW_TOKENS[task] == expected.max_new_tokens
        assert sample.num_tokens <= RULER_LENGTH and sample.num_tokens == expected.num_tokens
        assert tokenizer.decode(sample.context_ids + sample.tail_ids) == expected.prompt
        tail = tokenizer.decode(sample.tail_ids)
        assert tail.strip() == expected.tail.strip() and len(sample.tail_ids) >= 1
        context = tokenizer.decode(sample.context_ids)
        if task.startswith("niah"):
            (value,) = sample.answers
            assert f"is: {value}." in context and value not in tail
        elif task == "vt":
            assert all(f"VAR {name} =" in context for name in sample.answers)
        else:
            assert all(word in context for word in sample.answers)


@pytest.mark.parametrize("task", ["passkey", "passkey_essay", "niah_single", "niah_single_essay", "vt", "fwe"])
def test_samples_are_deterministic_under_a_seed(task, word_tokenizer):
    tokenizer, length = (word_tokenizer, 120) if task == "passkey" else (SpaceTokenizer(), RULER_LENGTH)
    seed = random.randrange(10**6)
    first = tasks.make_samples(task, tokenizer, length, 2, seed=seed)
    assert tasks.make_samples(task, tokenizer, length, 2, seed=seed) == first
    other = tasks.make_samples(task, tokenizer, length, 2, seed=seed + 1)
    assert [s.answers for s in other] != [s.answers for s in first]
    assert all(a.context_ids + a.tail_ids != b.context_ids + b.tail_ids for a, b in zip(other, first))
    assert first[0] != first[1]  # samples of one request differ too


def test_make_samples_rejects_bad_requests(word_tokenizer):
    with pytest.raises(ValueError, match="task must be one of 'passkey', .*; got 'ppl'"):
        tasks.make_samples("ppl", word_tokenizer, 100, 1)
    for bad, message in ((0, "must be >= 1, got 0"), (-1, "must be >= 1, got -1"), (1.5, "must be an int, got 1.5"),
                         (True, "must be an int, got True")):
        with pytest.raises(ValueError, match=f"num_samples {message}"):
            tasks.make_samples("passkey", word_tokenizer, 100, bad)
    with pytest.raises(ValueError, match="length must be >= 64"):
        tasks.make_samples("passkey", word_tokenizer, 10, 1)
    with pytest.raises(ValueError, match="shorter than its smallest prompt"):
        tasks.make_samples("cwe", SpaceTokenizer(), 100, 1)


@pytest.mark.parametrize(
    "output,key,expected",
    [(" 4711. Remember", 4711, 1.0), ("4711", 4711, 1.0), (" 47110", 4711, 0.0), (" 12 then 4711", 4711, 0.0),
     ("no number", 4711, 0.0), ("", 4711, 0.0), ("key=4711!", 4711, 1.0)],
)
def test_passkey_score_is_the_first_integer(output, key, expected):
    assert tasks.score("passkey", output, (str(key),)) == expected
    assert tasks.score("passkey_essay", output, (str(key),)) == expected


def test_passkey_essay_samples():
    tokenizer, length, seed = SpaceTokenizer(), 700, random.randrange(10**6)
    samples = tasks.make_samples("passkey_essay", tokenizer, length, 3, seed=seed)
    for index, (sample, depth) in enumerate(zip(samples, [0.0, 0.5, 1.0])):
        key = passkey.trial_key(seed, length, index)
        assert sample.answers == (str(key),) and sample.max_new_tokens == passkey.ANSWER_TOKENS
        text = passkey.build_essay_prompt(tokenizer, length, depth, key, passkey.essay_start(seed, length, index))
        assert tokenizer.decode(sample.context_ids + sample.tail_ids) == text
        assert length - 1 <= sample.num_tokens <= length  # one word is one token here: the fit is exact
        assert tokenizer.decode(sample.tail_ids).endswith(passkey.QUESTION)
        assert text.count(str(key)) == 2 and passkey.FILLER.strip() not in text


def test_ruler_score_is_string_match_all():
    answers = ("Alpha", "beta", "1234567")
    rng = random.Random()
    for _ in range(20):
        present = [a for a in answers if rng.random() < 0.5]
        noise = " ".join(rng.choice(["x", "gamma", "12", "alp"]) for _ in range(5))
        output = " ".join(p.upper() if rng.random() < 0.5 else p for p in present) + " " + noise
        for task in ruler.TASKS:
            assert tasks.score(task, output, answers) == pytest.approx(len(present) / 3)
    assert tasks.score("vt", "ABCDE, FGHIJ", ("abcde", "fghij")) == 1.0


def test_score_rejects_an_unknown_task():
    with pytest.raises(ValueError, match="task must be one of 'passkey', .*; got 'ppl'"):
        tasks.score("ppl", "1", ("1",))
