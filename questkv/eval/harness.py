"""Batched evaluation under Quest's protocol: one dense prefill, then every decode setting from a copy.

:func:`prefill` runs the contexts of a batch densely into a :class:`~questkv.integrations.hf.QuestCache`
(left-padded; pads are never stored). :func:`decode_greedy` then feeds every row its own token
stream one token per step (its tail, then its greedy answer), so rows with tails and answers of
different lengths share every forward without padding, and every decode step of every row goes
through the setting under test. :func:`score_tokens` does the same with teacher forcing for
perplexity. A :class:`Setting` names what decodes the sparse layers: ``full`` and ``quest`` run
questkv's production path (:class:`~questkv.QuestConfig`, the Triton kernels on CUDA), every other
policy its :mod:`questkv.policies` reference. This module is the HF path; ``full`` and ``quest`` also
run through the engine (:mod:`questkv.eval.engine_backend`, the same protocol), which
:meth:`Setting.backend` picks by default.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Optional, Sequence, Union

import torch

from questkv.config import PAGE_POLICY_OPTIONS, QuestConfig
from questkv.policies import POLICIES, DecodePolicy, make_policy
from questkv.validation import check_choice

EVAL_BACKENDS: tuple[str, ...] = ("auto", "engine", "hf")
"""What decodes a setting: ``engine`` (:class:`questkv.LLM`, ``full`` and ``quest`` only), ``hf`` (the HF
drop-in, every policy) or ``auto`` (the engine where it runs the setting, else HF)."""
ENGINE_POLICIES: tuple[str, ...] = ("full", "quest")
"""The policies the engine backend runs."""
ENGINE_OPTIONS: dict[str, tuple[str, ...]] = {"quest": ("selection_interval",)}
"""Policy options that only the engine backend runs (the HF drop-in selects pages every step)."""


def parse_policy(text: str, name: str = "policy") -> tuple[str, tuple[tuple[str, object], ...]]:
    """A policy string, ``NAME`` or ``NAME:option=value:option=value``, as ``(NAME, options)``.

    ``NAME`` is a key of :data:`questkv.policies.POLICIES`; the options are its own (see
    :func:`questkv.policies.make_policy`), ``page_size`` (the page size of that setting's cache,
    instead of the evaluation's) or, for ``quest``, ``selection_interval`` (decode steps per page
    selection, :attr:`questkv.QuestConfig.selection_interval`, engine backend only); ``full`` takes none. A value
    reads as an int, else a float, else stays a string: ``"quest-rerank:shortlist=4:rerank=mass"`` ->
    ``("quest-rerank", (("rerank", "mass"), ("shortlist", 4)))``, options sorted by name (:func:`format_policy`
    writes it back).

    Raises:
        ValueError: naming ``name`` (the argument's name in messages): an unknown policy, an option
            it does not take, a repeated option, or an item that is not ``option=value``.
    """
    policy, *items = text.split(":")
    check_choice(name, policy, POLICIES)
    allowed = () if policy == "full" else ("page_size",) + POLICIES[policy].options + ENGINE_OPTIONS.get(policy, ())
    options: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{name} {text!r}: option {item!r} is not option=value")
        if key not in allowed:
            raise ValueError(f"{name} {text!r}: policy {policy!r} takes no option {key!r}; "
                             f"its options: {', '.join(allowed) or 'none'}")
        if key in options:
            raise ValueError(f"{name} {text!r}: option {key!r} given twice")
        options[key] = _option_value(value)
    return policy, tuple(sorted(options.items()))


def format_policy(policy: str, options: Sequence[tuple[str, object]] = ()) -> str:
    """The policy string of ``policy`` with ``options`` (``(name, value)`` pairs): the inverse of
    :func:`parse_policy` for sorted options."""
    return policy + "".join(f":{key}={value}" for key, value in options)


def _option_value(text: str) -> object:
    """``"4"`` -> 4, ``"0.9"`` -> 0.9, anything else stays a string."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


@dataclasses.dataclass(frozen=True)
class Setting:
    """One decode configuration of an evaluation.

    Attributes:
        policy: a name of :data:`questkv.policies.POLICIES`.
        budget: tokens per decode step (``None`` for ``full`` only).
        options: the policy's options as ``(name, value)`` pairs (e.g. ``(("top_p", 0.9),)``).
        variant: the options its policy string names (``":selection=q_head"``, see
            :func:`parse_policy`), ``""`` for a plain name: what sets it apart from the policy's
            other settings in results (:attr:`name`).
        page_size: its cache's page size; ``None``: the evaluation's.
    """

    policy: str
    budget: Optional[int]
    options: tuple[tuple[str, object], ...] = ()
    variant: str = ""
    page_size: Optional[int] = None

    @property
    def name(self) -> str:
        """The policy string of the results (the ``policy`` of a sweep cell): policy + variant."""
        return self.policy + self.variant

    @property
    def label(self) -> str:
        return self.name if self.budget is None else f"{self.name}@{self.budget}"

    def build(self, page_size: int, dense_layers: int) -> Union[QuestConfig, DecodePolicy]:
        """What :func:`questkv.enable` takes for this setting (raises ``ValueError`` if invalid);
        ``page_size``: the evaluation's, unless the setting has its own."""
        check_choice("Setting.policy", self.policy, POLICIES)
        page_size = self.page_size or page_size
        options = dict(self.options)
        if self.policy in ("full", "quest"):
            if (self.policy == "full") != (self.budget is None):
                raise ValueError(f"policy {self.policy!r}: budget {self.budget!r} (full takes none, quest needs one)")
            unknown = sorted(set(options) - set(PAGE_POLICY_OPTIONS) - set(ENGINE_OPTIONS["quest"]))
            if unknown:
                raise ValueError(f"policy {self.policy!r} takes no option(s) {', '.join(unknown)}")
            # Quest's selection at every context: the route's cost model (dense_context_ratio) is a speed choice, and
            # an evaluation cell named quest must measure Quest's answers (the ratio 1 still routes a covering budget
            # dense, which changes no answer)
            return QuestConfig(token_budget=self.budget, page_size=page_size, dense_layers=dense_layers,
                               dense_context_ratio=1.0, **options)
        return make_policy(self.policy, self.budget, page_size, **options)

    @property
    def selection_interval(self) -> int:
        """Decode steps per page selection (1 unless the policy string sets ``selection_interval``)."""
        return dict(self.options).get("selection_interval", 1)

    def backend(self, eval_backend: str = "auto") -> str:
        """``"engine"`` or ``"hf"``: what runs this setting under ``eval_backend`` (:data:`EVAL_BACKENDS`).

        Raises:
            ValueError: ``engine`` for a policy the engine does not run, ``hf`` for a setting that reuses
                selections (``selection_interval`` > 1), or an unknown ``eval_backend``.
        """
        check_choice("eval backend", eval_backend, EVAL_BACKENDS)
        on_engine = self.policy in ENGINE_POLICIES
        if eval_backend == "auto":
            return "engine" if on_engine else "hf"
        if eval_backend == "engine" and not on_engine:
            raise ValueError(f"policy {self.name!r} runs on the HF path only (the engine runs "
                             f"{', '.join(ENGINE_POLICIES)}); use --eval-backend auto or hf")
        if eval_backend == "hf" and self.selection_interval > 1:
            raise ValueError(f"policy {self.name!r} reuses page selections (selection_interval="
                             f"{self.selection_interval}), which only the engine runs: the HF path selects every "
                             "decode step; use --eval-backend auto or engine")
        return eval_backend


def enable_setting(model, setting: Setting, page_size: int, dense_layers: int) -> None:
    """:func:`questkv.enable` the model with ``setting`` (``page_size``: as in :meth:`Setting.build`)."""
    from questkv.integrations.hf import enable

    setting.backend("hf")  # a setting that only the engine runs is refused here, with its name
    built = setting.build(page_size, dense_layers)
    if isinstance(built, QuestConfig):
        enable(model, built)
    else:
        enable(model, built, dense_layers=dense_layers)


def _forward(model, cache, input_ids: torch.Tensor, **kwargs):
    from questkv.integrations.hf import cache_argument

    return model(input_ids=input_ids, use_cache=True, **{cache_argument(model): cache}, **kwargs)


PREFILL_CHUNK_ELEMENTS = 2**33
"""The most ``rows x chunk x width`` elements of one prefill forward's attention mask (:func:`prefill`
splits longer prefills into chunks of columns): 8 GiB as bool, what a 20-row 16k prefill takes in one
forward; a 20-row 32k prefill runs in 3 chunks."""


def prefill_chunks(rows: int, width: int, max_elements: int = PREFILL_CHUNK_ELEMENTS) -> list[tuple[int, int]]:
    """``(start, end)`` column ranges of a prefill of ``rows`` x ``width`` tokens: as few chunks of
    near-equal width as keep ``rows x chunk x width <= max_elements``, each of at least 2 columns
    (a one-column forward over a non-empty cache would be a decode step); one chunk if ``width < 4``."""
    chunk = max(2, max_elements // max(1, rows * width))
    count = max(1, min(-(-width // chunk), width // 2))
    bounds = [round(i * width / count) for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


@torch.inference_mode()
def prefill(
    model, contexts: Sequence[Sequence[int]], page_size: int, collect_prefill_attention: bool = False, cache=None,
    max_elements: int = PREFILL_CHUNK_ELEMENTS,
):
    """Dense prefill of a batch of contexts (left-padded) into a QuestCache.

    The model must be :func:`questkv.enable`-d (any setting: prefill is dense under all of them).
    A batch whose ``rows x width**2`` exceeds ``max_elements`` is prefilled in chunks of columns
    (:func:`prefill_chunks`), each a dense forward over the tokens stored before it, so that the
    attention mask and activations of one forward stay bounded; the cache holds the same tokens.

    Args:
        contexts: token ids per row, each non-empty.
        collect_prefill_attention: record the prefill attention (needed by ``h2o``).
        cache: an empty QuestCache (or subclass) to fill; default a new one.
        max_elements: see above (:data:`PREFILL_CHUNK_ELEMENTS`).

    Returns:
        ``(cache, next_positions)``: the cache and ``[batch]`` int64, each row's token count (the
        position of its next token).
    """
    from questkv.integrations.hf import QuestCache

    if not contexts or any(len(ids) == 0 for ids in contexts):
        raise ValueError("prefill needs at least one row, and no empty context")
    device = model.device
    width = max(len(ids) for ids in contexts)
    input_ids = torch.zeros(len(contexts), width, dtype=torch.long)
    mask = torch.zeros(len(contexts), width, dtype=torch.long)
    for row, ids in enumerate(contexts):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        mask[row, width - len(ids):] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    if cache is None:
        cache = QuestCache(model.config, page_size, collect_prefill_attention=collect_prefill_attention)
    padded = not bool(mask.all())
    for start, end in prefill_chunks(len(contexts), width, max_elements):
        # Without padding, no mask: SDPA then takes its causal fast path instead of a materialised mask.
        _forward(model, cache, input_ids[:, start:end], attention_mask=mask[:, :end] if padded else None,
                 position_ids=positions[:, start:end], logits_to_keep=1)
    return cache, mask.sum(-1)


def _step(model, cache, tokens: torch.Tensor, positions: torch.Tensor, want_logits: bool) -> Optional[torch.Tensor]:
    """One decode step: ``tokens`` ``[batch]`` at ``positions`` ``[batch]``; ``[batch, vocab]`` float32 logits or None."""
    keep = 1 if want_logits else torch.empty(0, dtype=torch.long, device=tokens.device)
    logits = _forward(model, cache, tokens[:, None], position_ids=positions[:, None], logits_to_keep=keep).logits
    return logits[:, -1].float() if want_logits else None


@torch.inference_mode()
def decode_greedy(
    model, cache, next_positions: torch.Tensor, tails: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
    eos_token_id: Optional[int], progress: bool = False,
) -> list[list[int]]:
    """Feed each row its tail one token per step, then decode greedily; every step is a decode step.

    Row ``b`` consumes ``tails[b]`` (non-empty), then generates until EOS or ``max_new_tokens[b]``
    (>= 0) tokens. Rows that finish early keep receiving their last token (never read again) until
    every row is done. ``progress``: a tqdm bar on stderr over the steps (up to the longest row's), erased at
    the end.

    Returns:
        The generated token ids per row (EOS excluded).
    """
    batch = len(tails)
    if any(len(tail) == 0 for tail in tails) or any(n < 0 for n in max_new_tokens):
        raise ValueError("every row needs a non-empty tail and max_new_tokens >= 0")
    device = next_positions.device
    outputs: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    feed = [tail[0] for tail in tails]
    positions = next_positions.clone()
    step = 0
    most = max(len(tail) + max(n, 1) - 1 for tail, n in zip(tails, max_new_tokens))  # steps of the longest row
    with _steps_bar(most, progress) as bar:
        while not all(done):
            need_logits = any(not done[b] and step >= len(tails[b]) - 1 and max_new_tokens[b] > 0
                              for b in range(batch))
            logits = _step(model, cache, torch.tensor(feed, device=device), positions, need_logits)
            positions += 1
            step += 1
            bar.update(1)
            chosen = logits.argmax(-1).tolist() if need_logits else None
            for b in range(batch):
                if done[b]:
                    continue
                if step < len(tails[b]):
                    feed[b] = tails[b][step]
                    continue
                if max_new_tokens[b] == 0:
                    done[b] = True
                    continue
                token = chosen[b]
                if token == eos_token_id:
                    done[b] = True
                    continue
                outputs[b].append(token)
                feed[b] = token
                done[b] = len(outputs[b]) >= max_new_tokens[b]
    return outputs


def _steps_bar(total: int, progress: bool):
    """A tqdm bar on stderr over ``total`` decode steps, erased when closed (disabled without ``progress``)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="decode", unit="step", leave=False, disable=not progress)


@torch.inference_mode()
def score_tokens(model, cache, next_positions: torch.Tensor, targets: torch.Tensor,
                 progress: bool = False) -> torch.Tensor:
    """Teacher-forced negative log-likelihoods through decode steps.

    Args:
        targets: ``[batch, n + 1]`` token ids; ``targets[:, 0]`` is each row's next token after the
            prefilled context. Step ``i`` feeds ``targets[:, i]`` and scores ``targets[:, i + 1]``.
        progress: a tqdm bar on stderr over the ``n`` steps, erased at the end.

    Returns:
        ``[batch, n]`` float64 negative log-likelihoods (nats).
    """
    positions = next_positions.clone()
    nll = []
    with _steps_bar(targets.shape[1] - 1, progress) as bar:
        for i in range(targets.shape[1] - 1):
            logits = _step(model, cache, targets[:, i], positions, True)
            positions += 1
            log_probs = torch.log_softmax(logits, dim=-1)
            nll.append(-log_probs.gather(1, targets[:, i + 1 : i + 2]).squeeze(1).double())
            bar.update(1)
    return torch.stack(nll, dim=1)


def snapshot(cache):
    """An independent copy of a prefilled cache (each setting decodes from its own)."""
    return copy.deepcopy(cache)


def perplexity(nll: torch.Tensor) -> float:
    """``exp(mean(nll))`` over every scored token."""
    return math.exp(float(nll.mean()))
