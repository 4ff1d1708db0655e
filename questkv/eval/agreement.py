"""Teacher-forced top-1 agreement with dense attention over real text: the ``agreement_*`` tasks (engine only).

A fidelity measure that needs no answer key. For each of ``samples`` windows of ``length`` tokens of a text
(:func:`window_starts`: evenly spaced from its start to its end, overlapping where the text is short), the
context is the window's first ``length - tokens - 1`` tokens. Dense attention prefills it and greedily decodes
``tokens + 1`` tokens (the first comes from the prefill); every setting then decodes the same tokens fed back
(``SamplingParams.forced_token_ids``) and is scored at the ``tokens`` positions its decode steps predict
(:func:`score`): the fraction where its argmax is dense's token, and the perplexity of dense's tokens under it.
``full`` scores itself against its own greedy run: 100 % up to the arithmetic of batching.

==================  =======================================================================================
task                text
==================  =======================================================================================
``agreement_book``  Newton's *Opticks* (:mod:`questkv.eval.book`, the ``ppl`` task's ``book:newton-opticks``)
``agreement_code``  questkv's own Python source at a recorded commit (:mod:`questkv.eval.code`)
==================  =======================================================================================
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional, Sequence

from questkv.eval import book, code
from questkv.validation import check_int

TASKS: tuple[str, ...] = ("agreement_book", "agreement_code")


def load_text(task: str, code_commit: Optional[str] = None) -> tuple[str, dict]:
    """The task's text and what a result records about it (source, SHA-256, characters; the code's commit
    and origin)."""
    if task == "agreement_book":
        text = book.text()
        return text, {"source": book.SOURCE, "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
                      "characters": len(text)}
    if task == "agreement_code":
        loaded = code.load(code_commit)
        return loaded.text, loaded.record()
    raise ValueError(f"task must be one of {', '.join(map(repr, TASKS))}; got {task!r}")


def window_starts(num_tokens: int, length: int, count: int) -> list[int]:
    """``count`` window starts over a text of ``num_tokens`` tokens, evenly spaced from 0 to
    ``num_tokens - length`` (one window: 0).

    Raises:
        ValueError: the text is shorter than one window.
    """
    check_int("length", length, minimum=2)
    check_int("count", count, minimum=1)
    if num_tokens < length:
        raise ValueError(f"the text has {num_tokens} tokens, fewer than one window of {length}")
    last = num_tokens - length
    return [0] if count == 1 else [round(i * last / (count - 1)) for i in range(count)]


def contexts(tokenizer, text: str, length: int, count: int, tokens: int) -> list[list[int]]:
    """The contexts of ``count`` windows (:func:`window_starts`): each window's first ``length - tokens - 1``
    tokens (at least one)."""
    check_int("tokens", tokens, minimum=1, maximum=length - 2)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return [ids[start : start + length - tokens - 1] for start in window_starts(len(ids), length, count)]


def score(choices: Sequence[int], logprobs: Sequence[float], reference: Sequence[int]) -> tuple[float, list[float]]:
    """``(agreement, nll)`` of one window: the fraction of positions ``1..`` where ``choices`` (the setting's
    ``forced_choices``) equal ``reference`` (dense's greedy tokens, the forced ones), and the negative
    log-likelihoods of the reference tokens there (from ``forced_logprobs``). Position 0 is skipped: the dense
    prefill predicts it for every setting."""
    if not len(choices) == len(logprobs) == len(reference) or len(reference) < 2:
        raise ValueError(f"score needs as many choices, logprobs and reference tokens (at least 2), got "
                         f"{len(choices)}, {len(logprobs)} and {len(reference)}")
    same = sum(int(c == r) for c, r in zip(choices[1:], reference[1:]))
    return same / (len(reference) - 1), [-float(lp) for lp in logprobs[1:]]


def perplexity(nll: Sequence[float]) -> float:
    """``exp(mean(nll))``."""
    return math.exp(sum(nll) / len(nll))
