"""RULER-style task generators and the string_match_all scorer."""

import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from questkv.eval import ruler


class WhitespaceTokenizer:
    def encode(self, text):
        return text.split()


class CharTokenizer:
    def encode(self, text):
        return list(text)


TOKENIZERS = [(WhitespaceTokenizer(), 1500), (CharTokenizer(), 12000)]


@pytest.mark.parametrize("task", list(ruler.TASKS))
@pytest.mark.parametrize("tokenizer, length", TOKENIZERS, ids=["words", "chars"])
def test_length_fits_the_target(task, tokenizer, length):
    sample = ruler.generate(task, tokenizer, length, seed=7)
    assert sample.task == task and sample.prompt == sample.context + sample.tail
    assert sample.num_tokens == len(tokenizer.encode(sample.prompt))
    assert 0.97 * length <= sample.num_tokens <= length  # within one filler unit
    assert sample.context.endswith("\n") and sample.tail.strip() and sample.max_new_tokens > 0


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_deterministic_under_a_seed(task):
    tokenizer = WhitespaceTokenizer()
    first, again = (ruler.generate(task, tokenizer, 1500, seed=3) for _ in range(2))
    assert first == again
    other = ruler.generate(task, tokenizer, 1500, seed=4)
    assert other.prompt != first.prompt and other.answers != first.answers


def needles(text):
    return re.findall(r"One of the special magic (\w+) for (\S+) is: (\S+)\.", text)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), length=st.integers(300, 3000), task=st.sampled_from(["niah_single", "niah_multikey", "niah_uuid"]))
def test_niah_has_exactly_one_needle_for_the_queried_key(seed, length, task):
    sample = ruler.generate(task, WhitespaceTokenizer(), length, seed=seed)
    (value,) = sample.answers
    key = re.search(r"magic \w+ for (\S+) mentioned", sample.tail).group(1)
    found = needles(sample.context)
    assert [v for _, k, v in found if k == key] == [value]
    assert value not in sample.tail
    if task == "niah_single":
        assert len(found) == 1 and "The grass is green." in sample.context
    else:  # the haystack is made of distractor needles
        assert len(found) > 10 and "The grass is green." not in sample.context
        assert all(v != value for _, k, v in found if k != key)
    if task == "niah_uuid":
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", value)
    else:
        assert re.fullmatch(r"\d{7}", value) and re.fullmatch(r"[a-z]+-[a-z]+", key)


def test_niah_depth_varies_with_the_seed():
    depths = set()
    for seed in range(8):
        sample = ruler.generate("niah_single", WhitespaceTokenizer(), 2000, seed=seed)
        depths.add(round(sample.context.index("One of the special magic") / len(sample.context), 1))
    assert len(depths) >= 4


def test_vt_chain_is_complete_and_in_order():
    sample = ruler.generate("vt", WhitespaceTokenizer(), 2000, seed=11)
    value = re.search(r"assigned the value (\d{5}) in the text", sample.tail).group(1)
    names = sample.answers
    assert len(names) == ruler.VT_HOPS + 1 and len(set(names)) == len(names)
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    positions = [sample.context.index(s) for s in statements]
    assert positions == sorted(positions)
    assert len(re.findall(r"VAR [A-Z]{5} =", sample.context)) == len(statements)


def test_cwe_common_words_are_the_most_common():
    sample = ruler.generate("cwe", WhitespaceTokenizer(), 3000, seed=2)
    listing = sample.context.splitlines()[1]
    words = re.findall(r"\d+\. (\w+)", listing)
    counts = Counter(words)
    assert len(sample.answers) == ruler.CWE_COMMON
    assert all(counts[w] == ruler.CWE_COMMON_FREQ for w in sample.answers)
    assert {c for w, c in counts.items() if w not in sample.answers} == {ruler.CWE_RARE_FREQ}
    assert [int(n) for n in re.findall(r"(\d+)\. ", listing)] == list(range(1, len(words) + 1))


def test_fwe_answers_are_the_three_most_frequent_words():
    sample = ruler.generate("fwe", WhitespaceTokenizer(), 3000, seed=5)
    words = sample.context.splitlines()[1].split()
    counts = Counter(words)
    assert len(sample.answers) == 3 and all(re.fullmatch(r"[a-z]{6}", w) for w in words)
    third = min(counts[w] for w in sample.answers)
    assert all(counts[w] <= third for w in counts if w not in sample.answers)
    # Zipf(2): the top word holds about 1/zeta(2) = 61% of the draws.
    assert 0.5 < counts.most_common(1)[0][1] / len(words) < 0.72


def test_string_match_all():
    refs = ["ABCDE", "fghij", "12345"]
    assert ruler.string_match_all("abcde, FGHIJ and 12345", refs) == 1.0
    assert ruler.string_match_all("only abcde here", refs) == pytest.approx(1 / 3)
    assert ruler.string_match_all("", refs) == 0.0
    with pytest.raises(ValueError, match="at least one reference"):
        ruler.string_match_all("x", [])


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_a_perfect_answer_scores_one(task):
    sample = ruler.generate(task, WhitespaceTokenizer(), 1500, seed=1)
    assert ruler.string_match_all(" " + ", ".join(sample.answers).upper(), sample.answers) == 1.0


@pytest.mark.parametrize(
    "task, length, message",
    [
        ("niah_multi", 100, "RULER task must be one of 'niah_single', .*; got 'niah_multi'"),
        ("niah_single", 10, "shorter than its smallest prompt"),
        ("cwe", 500, "shorter than its smallest prompt"),
        ("cwe", 10**6, "needs more than its"),
        ("vt", 0, "length must be >= 1, got 0"),
        ("vt", 1.5, "length must be an int, got 1.5"),
        ("vt", True, "length must be an int, got True"),
    ],
)
def test_bad_requests_raise(task, length, message):
    with pytest.raises(ValueError, match=message):
        ruler.generate(task, WhitespaceTokenizer(), length)
