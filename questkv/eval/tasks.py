"""The accuracy tasks of ``questkv eval``: samples as token ids, split for Quest's protocol, and scores.

Every task yields :class:`TaskSample` objects: ``context_ids`` are prefilled densely, ``tail_ids``
(the question) are decoded one token at a time through the policy under test, then up to
``max_new_tokens`` tokens are generated greedily and scored with :func:`score`.

=======================  ===============================================================  =====================
task                     prompt                                                           score
=======================  ===============================================================  =====================
``passkey``              landmark-attention passkey (:mod:`questkv.eval.passkey`); the    first integer == key
                         tail is the prompt's last 400 characters, key depths spread
                         evenly over 0-100 % across the samples
``passkey_essay``        as ``passkey``, the filler words of a public-domain book         first integer == key
                         (:mod:`questkv.eval.book`) from a seeded sentence on
``niah_single``,         RULER tasks (:mod:`questkv.eval.ruler`); the tail is the         ``string_match_all``
``niah_single_essay``,   question and answer prefix
``niah_multikey``,
``niah_uuid``,
``vt``, ``cwe``,
``fwe``
=======================  ===============================================================  =====================

Perplexity (``ppl``) is not a sampled task; see :mod:`questkv.eval.perplexity`.
"""

from __future__ import annotations

import dataclasses

from questkv.eval import passkey, ruler
from questkv.validation import check_choice, check_int

PASSKEY_TASKS: tuple[str, ...] = ("passkey", "passkey_essay")
TASKS: tuple[str, ...] = PASSKEY_TASKS + tuple(ruler.TASKS)


@dataclasses.dataclass(frozen=True)
class TaskSample:
    """One prompt of an accuracy task, tokenized.

    Attributes:
        task: the task name (a key of :data:`TASKS`).
        context_ids: token ids prefilled densely.
        tail_ids: token ids decoded one at a time before generation (at least one).
        answers: the reference strings (``passkey``: the key).
        max_new_tokens: tokens generated greedily after the tail.
    """

    task: str
    context_ids: tuple[int, ...]
    tail_ids: tuple[int, ...]
    answers: tuple[str, ...]
    max_new_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.context_ids) + len(self.tail_ids)


def make_samples(task: str, tokenizer, length: int, num_samples: int, seed: int = 0) -> list[TaskSample]:
    """``num_samples`` prompts of ``task`` with at most ``length`` tokens (passkey: within a few).

    The same ``(task, length, num_samples, seed)`` and tokenizer always give the same samples.

    Raises:
        ValueError: unknown task, ``num_samples < 1``, or a length the task cannot fill.
    """
    check_choice("task", task, TASKS)
    check_int("num_samples", num_samples, minimum=1)
    if task in PASSKEY_TASKS:
        samples = []
        for index, depth in enumerate(passkey.trial_depths(num_samples)):
            key = passkey.trial_key(seed, length, index)
            if task == "passkey":
                text = passkey.build_prompt(tokenizer, length, depth, key)
            else:
                text = passkey.build_essay_prompt(tokenizer, length, depth, key, passkey.essay_start(seed, length, index))
            context, tail = passkey.split_tail(tokenizer, text)
            samples.append(TaskSample(task, tuple(context), tuple(tail), (str(key),), passkey.ANSWER_TOKENS))
        return samples
    samples = []
    for index in range(num_samples):
        sample = ruler.generate(task, tokenizer, length, seed=seed * 1_000_003 + index)
        context, tail = passkey.split_tail(tokenizer, sample.prompt, tail_chars=len(sample.tail))
        samples.append(TaskSample(task, tuple(context), tuple(tail), sample.answers, sample.max_new_tokens))
    return samples


def score(task: str, output: str, answers: tuple[str, ...]) -> float:
    """The sample's score in ``[0, 1]``: passkey tasks 1.0 when the output's first integer is the key,
    the RULER tasks :func:`questkv.eval.ruler.string_match_all`."""
    if task in PASSKEY_TASKS:
        return float(passkey.is_correct(output, int(answers[0])))
    check_choice("task", task, TASKS)
    return ruler.string_match_all(output, answers)
