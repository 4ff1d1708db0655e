"""Passkey retrieval (landmark-attention format) under Quest's evaluation protocol.

The context is prefilled densely; the question tail (the prompt's last ``tail_chars`` characters)
is then fed one token at a time through sparse decode, and up to ``answer_tokens`` tokens are
generated greedily. A trial is correct when the first integer of the answer equals the key.

One dense prefill per (length, trial) is shared by every budget and selection: the paged cache is
snapshotted after the prefill and each configuration decodes from its own copy.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import re
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch

from questkv.config import QuestConfig

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
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if filler_chars < 0:
        raise ValueError(f"filler_chars must be >= 0, got {filler_chars}")
    filler = FILLER * (filler_chars // len(FILLER) + 1)
    split = round(depth * filler_chars)
    prefix, suffix = filler[:split].strip(), filler[split:filler_chars].strip()
    return "\n".join([HEADER, prefix, KEY_LINE.format(key=key), suffix, QUESTION])


def build_prompt(tokenizer, length: int, depth: float, key: int) -> str:
    """A passkey prompt of ``length`` tokens (within a few) under ``tokenizer``, key at ``depth``.

    The filler size is fitted by measuring the tokenized prompt and rescaling (the filler
    tokenizes almost linearly).
    """
    if length < 64:
        raise ValueError(f"passkey length must be >= 64 tokens, got {length}")

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


def first_integer(text: str) -> Optional[int]:
    """The first integer in ``text`` (``None`` if there is none)."""
    match = re.search(r"\d+", text)
    return int(match.group()) if match else None


def is_correct(output: str, key: int) -> bool:
    """Passkey score: the output's first integer equals the key."""
    return first_integer(output) == key


def trial_depths(trials: int) -> list[float]:
    """Key depths spread evenly over 0–100%: ``i / (trials - 1)`` (one trial: 50%)."""
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
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


@dataclasses.dataclass(frozen=True)
class PasskeySetting:
    """One decode configuration: ``budget=None`` is full (dense) attention, with no selection."""

    budget: Optional[int]
    selection: Optional[str]

    @property
    def label(self) -> str:
        return "full" if self.budget is None else f"{self.budget}/{self.selection}"


def settings(budgets: Sequence[Optional[int]], selections: Sequence[str]) -> list[PasskeySetting]:
    """Budgets × selections, with full attention (``None``) once."""
    out = []
    for budget in budgets:
        if budget is None:
            out.append(PasskeySetting(None, None))
        else:
            out.extend(PasskeySetting(budget, selection) for selection in selections)
    return out


def quest_configs(
    budgets: Sequence[Optional[int]], selections: Sequence[str], page_size: int, dense_layers: int
) -> dict[PasskeySetting, QuestConfig]:
    """The :class:`QuestConfig` of every setting (raises ``ValueError`` for an invalid one)."""
    return {
        s: QuestConfig(token_budget=s.budget, page_size=page_size, dense_layers=dense_layers, selection=s.selection or "kv_head")
        for s in settings(budgets, selections)
    }


def _cache_kwargs(model, cache) -> dict:
    from questkv.integrations.hf import cache_argument

    return {cache_argument(model): cache, "use_cache": True}


@torch.inference_mode()
def decode_answer(model, tokenizer, cache, tail_ids: Sequence[int], answer_tokens: int = ANSWER_TOKENS) -> str:
    """Feed ``tail_ids`` one token at a time into ``cache``, then greedy-decode up to ``answer_tokens``.

    Every forward here is a decode step (one new token over a non-empty cache), so with
    :func:`questkv.enable` each one runs Quest selection. Stops early at the EOS token.
    """
    device = model.device
    kwargs = _cache_kwargs(model, cache)
    no_logits = torch.empty(0, dtype=torch.long, device=device)  # only the cache matters until the last tail token
    logits = None
    for index, token in enumerate(tail_ids):
        keep = 1 if index == len(tail_ids) - 1 else no_logits
        logits = model(input_ids=torch.tensor([[token]], device=device), logits_to_keep=keep, **kwargs).logits
    answer = []
    for _ in range(answer_tokens):
        token = int(logits[0, -1].argmax())
        if token == tokenizer.eos_token_id:
            break
        answer.append(token)
        logits = model(input_ids=torch.tensor([[token]], device=device), **kwargs).logits
    return tokenizer.decode(answer, skip_special_tokens=True)


@torch.inference_mode()
def prefill(model, context_ids: Sequence[int], page_size: int, cache=None):
    """Dense prefill of ``context_ids`` into ``cache``, an empty
    :class:`~questkv.integrations.hf.QuestCache` (default: a new one); returns the cache."""
    from questkv.integrations.hf import QuestCache

    if cache is None:
        cache = QuestCache(model.config, page_size)
    model(input_ids=torch.tensor([list(context_ids)], device=model.device), logits_to_keep=1, **_cache_kwargs(model, cache))
    return cache


def run_passkey(
    model,
    tokenizer,
    lengths: Sequence[int],
    budgets: Sequence[Optional[int]],
    selections: Sequence[str] = ("kv_head",),
    trials: int = 10,
    page_size: int = 16,
    dense_layers: int = 2,
    seed: int = 0,
    done: Iterable[dict] = (),
    on_record: Optional[Callable[[dict], None]] = None,
    progress: bool = True,
) -> list[dict]:
    """Run the passkey grid; returns per-trial records (``done`` ones included, not rerun).

    Args:
        model: a causal LM of a family :func:`questkv.enable` supports (enabled here).
        lengths: prompt lengths in tokens. budgets: token budgets, ``None`` = full attention.
        selections: Quest selection modes to run for every finite budget.
        done: records of an earlier, interrupted run with the same settings; skipped.
        on_record: called with every new record as soon as it exists (e.g. to save progress).

    Returns:
        Records ``{"length", "budget", "selection", "trial", "depth", "key", "output",
        "correct", "seconds"}``; ``seconds`` is the decode time plus this trial's share of the
        prefill.
    """
    from tqdm.auto import tqdm

    from questkv.integrations.hf import enable

    configs = quest_configs(budgets, selections, page_size, dense_layers)
    grid = list(configs)
    records = list(done)
    finished = {(r["length"], r["budget"], r["selection"], r["trial"]) for r in records}
    depths = trial_depths(trials)
    todo = [
        (length, trial, [s for s in grid if (length, s.budget, s.selection, trial) not in finished])
        for length in lengths
        for trial in spread_order(trials)
    ]
    todo = [item for item in todo if item[2]]
    bar = tqdm(total=sum(len(item[2]) for item in todo), desc="passkey", unit="run", disable=not progress)
    for length, trial, pending in todo:
        key = trial_key(seed, length, trial)
        context_ids, tail_ids = split_tail(tokenizer, build_prompt(tokenizer, length, depths[trial], key))
        start = time.perf_counter()
        enable(model, configs[pending[0]])
        prefilled = prefill(model, context_ids, page_size)
        prefill_share = (time.perf_counter() - start) / len(pending)
        for setting in pending:
            bar.set_postfix_str(f"len={length} trial={trial} {setting.label}")
            start = time.perf_counter()
            enable(model, configs[setting])
            output = decode_answer(model, tokenizer, copy.deepcopy(prefilled), tail_ids)
            record = {
                "length": length,
                "budget": setting.budget,
                "selection": setting.selection,
                "trial": trial,
                "depth": depths[trial],
                "key": key,
                "output": output,
                "correct": is_correct(output, key),
                "seconds": round(time.perf_counter() - start + prefill_share, 3),
            }
            records.append(record)
            if on_record is not None:
                on_record(record)
            bar.update(1)
    bar.close()
    return records


def summarize(records: Iterable[dict]) -> list[dict]:
    """Accuracy per (length, budget, selection), in first-seen order."""
    groups: dict[tuple, list[bool]] = {}
    for r in records:
        groups.setdefault((r["length"], r["budget"], r["selection"]), []).append(bool(r["correct"]))
    return [
        {
            "length": length,
            "budget": budget,
            "selection": selection,
            "correct": sum(hits),
            "trials": len(hits),
            "accuracy": sum(hits) / len(hits),
        }
        for (length, budget, selection), hits in groups.items()
    ]


def format_table(results: Sequence[dict]) -> str:
    """Markdown table: a row per (length, selection), a column per budget, cells ``correct/trials``.

    Full attention has no selection; its cell is repeated on every row of its length.
    """
    budgets = sorted({r["budget"] for r in results}, key=lambda b: (b is None, b or 0))
    selections = sorted({r["selection"] for r in results if r["selection"] is not None}) or [None]
    lengths = sorted({r["length"] for r in results})
    cell = {(r["length"], r["budget"], r["selection"]): r for r in results}
    header = ["length", "selection"] + ["full" if b is None else str(b) for b in budgets]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for length in lengths:
        for selection in selections:
            row = [str(length), "-" if selection is None else selection]
            for budget in budgets:
                r = cell.get((length, budget, None if budget is None else selection))
                row.append("" if r is None else f"{r['correct']}/{r['trials']}")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def report(model_name: str, config: dict, records: list[dict]) -> dict:
    """The JSON document: ``{"model", "config", "results", "trials"}``."""
    return {"model": model_name, "config": config, "results": summarize(records), "trials": records}


def load_report(path: Path, model_name: str, config: dict) -> list[dict]:
    """Trial records of an earlier run at ``path`` to resume; ``[]`` if the file does not exist.

    Raises ``ValueError`` if that run used another model or settings.
    """
    if not path.exists():
        return []
    with open(path) as handle:
        previous = json.load(handle)
    if previous.get("model") != model_name or previous.get("config") != config:
        raise ValueError(
            f"{path} holds a run with other settings (model={previous.get('model')!r}, config={previous.get('config')}); "
            "use another --json path or drop --resume"
        )
    return previous["trials"]


def save_report(path: Path, document: dict) -> None:
    """Write the JSON atomically (a partial file never replaces a good one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as handle:
        json.dump(document, handle, indent=1)
    tmp.replace(path)
