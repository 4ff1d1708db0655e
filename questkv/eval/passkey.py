"""Passkey retrieval prompts (landmark-attention format) and their scorer.

Under Quest's protocol (:mod:`questkv.eval.tasks`, run by ``questkv eval passkey``) the context is
prefilled densely, the question tail (the prompt's last :data:`TAIL_CHARS` characters) is fed one
token at a time through sparse decode, and :data:`ANSWER_TOKENS` tokens are generated greedily. A
trial is correct when the first integer of the answer equals the key.

:func:`build_prompt` fills the prompt with the repeated :data:`FILLER` (the landmark-attention
original, task ``passkey``); :func:`build_essay_prompt` with words of a public-domain book
(:mod:`questkv.eval.book`), the key line between two of its sentences (task ``passkey_essay``).
"""

from __future__ import annotations

import functools
import random
import re
from typing import Optional

from questkv.eval import book, ruler
from questkv.validation import check_float, check_int

HEADER = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
MAX_KEY = 50000
TAIL_CHARS = 400
ANSWER_TOKENS = 10


def passkey_prompt(filler_chars: int, depth: float, key: int) -> str:
    """The prompt text with ``filler_chars`` characters of filler, the key line at ``depth`` of it.

    Args:
        filler_chars: total characters of filler (prefix + suffix), cut from the repeated sentence.
        depth: 0.0 puts the key line right after the header, 1.0 right before the question.
        key: the pass key.
    """
    check_float("depth", depth, low=0, high=1)
    check_int("filler_chars", filler_chars, minimum=0)
    filler = FILLER * (filler_chars // len(FILLER) + 1)
    split = round(depth * filler_chars)
    prefix, suffix = filler[:split].strip(), filler[split:filler_chars].strip()
    return "\n".join([HEADER, prefix, KEY_LINE.format(key=key), suffix, QUESTION])


def build_prompt(tokenizer, length: int, depth: float, key: int) -> str:
    """A passkey prompt of ``length`` tokens (within a few) under ``tokenizer``, key at ``depth``.

    The filler size is fitted by measuring the tokenized prompt and rescaling (the filler
    tokenizes almost linearly).
    """
    check_int("passkey length", length, minimum=64)

    def count(filler_chars: int) -> int:
        return len(tokenizer(passkey_prompt(filler_chars, depth, key)).input_ids)

    fixed = count(0)
    if fixed >= length:
        raise ValueError(f"passkey length {length} is shorter than the prompt without filler ({fixed} tokens)")
    chars_per_token = len(FILLER) * 50 / (count(len(FILLER) * 50) - fixed)
    filler_chars = round((length - fixed) * chars_per_token)
    for _ in range(3):
        error = length - count(filler_chars)
        if error == 0:
            break
        filler_chars += round(error * chars_per_token)
    return passkey_prompt(filler_chars, depth, key)


def build_essay_prompt(tokenizer, length: int, depth: float, key: int, start: int) -> str:
    """A passkey prompt of at most ``length`` tokens under ``tokenizer`` (within one word of it): the
    :data:`HEADER`, words of the book from sentence ``start`` on with the key line between two
    sentences at ``depth``, the :data:`QUESTION`.

    Raises:
        ValueError: ``length < 64``, or too short for the prompt without filler.
    """
    check_int("passkey length", length, minimum=64)
    check_float("depth", depth, low=0, high=1)
    key_line = KEY_LINE.format(key=key)

    def render(words: int) -> str:
        return "\n".join([HEADER, book.haystack(start, words, depth, key_line), QUESTION])

    @functools.lru_cache(maxsize=None)
    def count(words: int) -> int:
        return len(tokenizer(render(words)).input_ids)

    return render(ruler.fit_units("passkey_essay", count, length))


def essay_start(seed: int, length: int, trial: int) -> int:
    """The book sentence a ``passkey_essay`` trial's filler starts at, reproducible from ``(seed, length, trial)``."""
    return random.Random(f"essay-{seed}-{length}-{trial}").randrange(len(book.sentences()))


def first_integer(text: str) -> Optional[int]:
    """The first integer in ``text`` (``None`` if there is none)."""
    match = re.search(r"\d+", text)
    return int(match.group()) if match else None


def is_correct(output: str, key: int) -> bool:
    """Passkey score: the output's first integer equals the key."""
    return first_integer(output) == key


def trial_depths(trials: int) -> list[float]:
    """Key depths spread evenly over 0–100%: ``i / (trials - 1)`` (one trial: 50%)."""
    check_int("trials", trials, minimum=1)
    if trials == 1:
        return [0.5]
    return [i / (trials - 1) for i in range(trials)]


def spread_order(n: int) -> list[int]:
    """``range(n)`` reordered so that every prefix spreads over the range (bisection order):
    an interrupted run still covers shallow and deep keys. ``spread_order(5) == [0, 4, 2, 1, 3]``."""
    order, seen = [], set()
    level = 1
    while len(order) < n:
        for i in range(level + 1):
            index = round(i * (n - 1) / level) if n > 1 else 0
            if index not in seen:
                seen.add(index)
                order.append(index)
        level *= 2
    return order


def trial_key(seed: int, length: int, trial: int) -> int:
    """The pass key of one trial, 1..50000, reproducible from ``(seed, length, trial)``."""
    return random.Random(f"{seed}-{length}-{trial}").randint(1, MAX_KEY)


def split_tail(tokenizer, text: str, tail_chars: int = TAIL_CHARS) -> tuple[list[int], list[int]]:
    """Token ids of the prompt, split where the last ``tail_chars`` characters begin.

    The whole prompt is tokenized once and split at the first token starting at or after
    ``len(text) - tail_chars``, so the two parts concatenate to the prompt's own tokenization.

    Returns:
        ``(context_ids, tail_ids)``; the tail holds at least one token.
    """
    encoding = tokenizer(text, return_offsets_mapping=True)
    ids, offsets = encoding.input_ids, encoding.offset_mapping
    boundary = len(text) - tail_chars
    split = next((i for i, (start, end) in enumerate(offsets) if start >= boundary and end > start), len(ids) - 1)
    split = max(1, min(split, len(ids) - 1))
    return ids[:split], ids[split:]
