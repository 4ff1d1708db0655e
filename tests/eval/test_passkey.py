import pytest

from questkv.eval import passkey


@pytest.mark.parametrize("length", [100, 300, 1000])
@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_prompt_has_the_requested_length_and_one_key(word_tokenizer, length, depth):
    text = passkey.build_prompt(word_tokenizer, length, depth, key=31337)
    assert abs(len(word_tokenizer(text).input_ids) - length) <= 4
    assert text.count(passkey.KEY_LINE.format(key=31337)) == 1
    assert text.count("31337") == 2  # twice inside the key line, nowhere else
    assert text.startswith(passkey.HEADER) and text.endswith(passkey.QUESTION)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_key_sits_at_the_requested_depth(depth):
    text = passkey.passkey_prompt(10_000, depth, key=7)
    line = passkey.KEY_LINE.format(key=7)
    start = text.index(line)
    before = start - len(passkey.HEADER)
    after = len(text) - start - len(line) - len(passkey.QUESTION)
    assert before / (before + after) == pytest.approx(depth, abs=0.01)


def test_prompt_rejects_bad_arguments(word_tokenizer):
    with pytest.raises(ValueError, match="depth must be in"):
        passkey.passkey_prompt(100, 1.5, 1)
    with pytest.raises(ValueError, match="length must be >= 64"):
        passkey.build_prompt(word_tokenizer, 10, 0.5, 1)


def test_split_tail_keeps_the_tokenization(word_tokenizer):
    text = passkey.build_prompt(word_tokenizer, 500, 0.5, key=123)
    context, tail = passkey.split_tail(word_tokenizer, text, tail_chars=400)
    assert context + tail == word_tokenizer(text).input_ids
    assert 0 < len(tail) < 200
    assert word_tokenizer.decode(tail).endswith("The pass key is")


@pytest.mark.parametrize(
    "output,key,correct",
    [
        (" 12345. Remember it.", 12345, True),
        ("12345", 12345, True),
        (" 123456.", 12345, False),
        (" 1234 and then 12345", 12345, False),
        (" a special key", 12345, False),
        ("", 1, False),
    ],
)
def test_scorer_takes_the_first_integer(output, key, correct):
    assert passkey.is_correct(output, key) is correct


def test_depths_keys_and_order():
    assert passkey.trial_depths(5) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert passkey.trial_depths(1) == [0.5]
    assert passkey.spread_order(5) == [0, 4, 2, 1, 3]
    assert sorted(passkey.spread_order(10)) == list(range(10))
    keys = {passkey.trial_key(0, 1024, t) for t in range(20)}
    assert len(keys) > 15 and all(1 <= k <= passkey.MAX_KEY for k in keys)
    assert passkey.trial_key(0, 1024, 3) == passkey.trial_key(0, 1024, 3)
