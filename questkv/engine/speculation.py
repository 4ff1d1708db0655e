"""How many tokens a lossless round drafts: the engine's choice, from the step times and acceptance it measures.

A lossless round of ``k`` drafts costs ``k`` draft steps and one verify step and yields, with a per-token
acceptance probability ``p``, ``E(k) = (1 - p**(k + 1)) / (1 - p)`` tokens on average (Leviathan et al. 2023); a
dense step yields one. So drafting pays while ``E(k) / (k * t_draft + t_verify) > 1 / t_dense``. The engine times
each step from its scheduling (or the update of the step before, when it was launched ahead of that update) to its
own update, so that a round's steps add up to the round's wall time; the policy keeps a running mean of each kind
of step per batch size (of a verify step per round length too: its ``k + 1`` rows per sequence through every
linear and attention cost more as ``k`` grows), the acceptance over recent rounds, and picks ``k`` in ``[0, max_k]``
with the best predicted tokens per second (0: dense steps). A round length whose verify was never timed is
predicted from the nearest one that was, along the line from the dense step (a verify of no draft is one). Every
kind of step is measured again now and then (a dense step every :data:`PROBE_EVERY` rounds, a round of ``max_k``
after :data:`PROBE_EVERY` dense steps), so the choice follows the batch, the context and the text. A probe round
that leaves dense the choice doubles the dense steps before the next one, up to :data:`MAX_PROBE_EVERY`, and goes
straight there where drafting could not pay even if every draft were kept (a draft step as dear as a dense one: a
1.5B model at batch 1 ran at 0.94x of dense with a probe every 32 steps, ``lossless-real-h200-qwen2.5-coder-1.5b-warm``,
each probe costing about two steps more than it yields). Every step's output is dense attention's whichever it
picks: only the speed depends on it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from questkv.config import SpeculativeConfig
    from questkv.engine.sequence import Sequence

__all__ = ["MAX_PROBE_EVERY", "PROBE_EVERY", "SpeculationPolicy", "StepKind", "draft_reuse_steps", "expected_tokens",
           "keep_verified", "verified_next_inputs"]

PROBE_EVERY = 32
"""Rounds between two dense steps that refresh the dense step's time, and dense steps between two rounds that
refresh the draft and verify steps' times (at first: see :data:`MAX_PROBE_EVERY`)."""

MAX_PROBE_EVERY = 8 * PROBE_EVERY
"""The most dense steps between two probe rounds: the interval doubles from :data:`PROBE_EVERY` each time a probe
round leaves dense the choice, and returns to it when a round wins."""

_WEIGHT = 0.2
"""The weight of a new measurement in the running means (about the last 5 steps of a kind count)."""

_PRIOR_ACCEPTANCE = 0.8
"""Per-token acceptance assumed before a batch size has verified anything."""


class StepKind(enum.Enum):
    """The kinds of step whose wall time the policy learns from."""

    DENSE = "dense"
    DRAFT = "draft"
    VERIFY = "verify"


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a round of ``k`` drafts yields on average when each draft is kept with probability ``acceptance``
    (independently, up to the first rejection), the verify's own token included: ``sum(acceptance**i, i=0..k)``."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclasses.dataclass
class _Bucket:
    """What the policy knows about one batch size: running means of step seconds, acceptance counts."""

    seconds: dict = dataclasses.field(default_factory=dict)  # StepKind.DENSE / DRAFT -> running mean
    verify_by_drafts: dict = dataclasses.field(default_factory=dict)  # a verify's drafts per round -> running mean
    kept: float = 0.0  # drafts kept, and drafts tested (kept ones plus the first rejected one of each round)
    tested: float = 0.0
    rounds_since_dense: int = 0
    dense_since_round: int = 0
    probe_every: int = PROBE_EVERY  # dense steps before the next probe round
    steps: dict = dataclasses.field(default_factory=dict)  # "dense" / "draft" / "verify-K" -> steps recorded

    @property
    def timed(self) -> bool:
        """Whether a dense, a draft and a verify step have been timed (what :meth:`SpeculationPolicy._best_k`
        needs)."""
        return StepKind.DRAFT in self.seconds and StepKind.DENSE in self.seconds and bool(self.verify_by_drafts)


class SpeculationPolicy:
    """The engine-wide choice of draft tokens per round (:meth:`draft_tokens`), learnt from :meth:`record_step` and
    :meth:`record_round`.

    Args:
        max_k: ``SpeculativeConfig.num_speculative_tokens``, the most drafts per round.
        adaptive: ``SpeculativeConfig.adaptive``; ``False``: :meth:`draft_tokens` is always ``max_k``.
    """

    def __init__(self, max_k: int, adaptive: bool = True) -> None:
        self.max_k = max_k
        self.adaptive = adaptive
        self._buckets: dict[int, _Bucket] = {}

    def _bucket(self, batch: int) -> _Bucket:
        bucket = self._buckets.get(batch)
        if bucket is None:  # (not setdefault: it would build a bucket on every call, several a step)
            bucket = self._buckets[batch] = _Bucket()
        return bucket

    def acceptance(self, batch: int) -> float:
        """The per-token acceptance measured at ``batch`` rows (a prior before any round)."""
        bucket = self._bucket(batch)
        if bucket.tested < 1:
            return _PRIOR_ACCEPTANCE
        return bucket.kept / bucket.tested

    def draft_tokens(self, batch: int) -> int:
        """Drafts per round for a step of ``batch`` decoding rows: ``max_k`` until a round has been timed, 0 for one
        step to time a dense one, then the ``k`` of the best predicted speed (0: dense is faster)."""
        if not self.adaptive:
            return self.max_k
        bucket = self._bucket(batch)
        draft, dense = bucket.seconds.get(StepKind.DRAFT), bucket.seconds.get(StepKind.DENSE)
        if draft is None or not bucket.verify_by_drafts or bucket.dense_since_round >= bucket.probe_every:
            return self.max_k
        if dense is None or bucket.rounds_since_dense >= PROBE_EVERY:
            return 0
        return self._best_k(batch)

    def _best_k(self, batch: int, acceptance: Optional[float] = None) -> int:
        """The ``k`` in ``[0, max_k]`` of the best predicted tokens per second from the measured times (a dense step,
        a draft step and a verify step timed at ``batch`` rows) at ``acceptance`` (default: the measured one)."""
        bucket = self._bucket(batch)
        draft, dense = bucket.seconds[StepKind.DRAFT], bucket.seconds[StepKind.DENSE]
        p = self.acceptance(batch) if acceptance is None else acceptance
        best_k, best_rate = 0, 1.0 / dense
        for k in range(1, self.max_k + 1):
            rate = expected_tokens(p, k) / (k * draft + self.verify_seconds(batch, k))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def verify_seconds(self, batch: int, k: int) -> float:
        """The predicted seconds of a verify step of ``batch`` rows after ``k`` drafts: measured, or from the
        nearest measured round length ``m`` (the longer on a tie) as ``dense + (verify(m) - dense) * k / m``.
        Needs a verify step timed at ``batch`` rows (and a dense step, unless ``k`` was timed)."""
        timed = self._bucket(batch).verify_by_drafts
        if k in timed:
            return timed[k]
        nearest = min(timed, key=lambda m: (abs(m - k), -m))
        dense = self._bucket(batch).seconds[StepKind.DENSE]
        return dense + (timed[nearest] - dense) * k / nearest

    def record_step(self, kind: StepKind, batch: int, seconds: float, drafts: int = 0) -> None:
        """A step of ``kind`` over ``batch`` rows took ``seconds`` (wall, see the module's docstring); a verify step
        checked rounds of at most ``drafts`` drafts (its rows' positions less one; at least 1)."""
        if kind is StepKind.VERIFY and drafts < 1:
            raise ValueError(f"a verify step checks at least 1 draft per round, got drafts={drafts}")
        bucket = self._bucket(batch)
        means = bucket.verify_by_drafts if kind is StepKind.VERIFY else bucket.seconds
        key = drafts if kind is StepKind.VERIFY else kind
        old: Optional[float] = means.get(key)
        means[key] = seconds if old is None else (1 - _WEIGHT) * old + _WEIGHT * seconds
        name = f"verify-{drafts}" if kind is StepKind.VERIFY else kind.value
        bucket.steps[name] = bucket.steps.get(name, 0) + 1
        if kind is StepKind.DENSE:
            bucket.rounds_since_dense = 0
            bucket.dense_since_round += 1
            if bucket.timed and bucket.dense_since_round == 1 and self._never_pays(batch):  # (the round's times fresh)
                bucket.probe_every = MAX_PROBE_EVERY
        elif kind is StepKind.VERIFY:
            if bucket.timed:
                if self._best_k(batch):
                    bucket.probe_every = PROBE_EVERY
                elif bucket.dense_since_round >= bucket.probe_every:  # a probe round that leaves dense the choice
                    bucket.probe_every = (MAX_PROBE_EVERY if self._never_pays(batch)
                                          else min(2 * bucket.probe_every, MAX_PROBE_EVERY))
            bucket.rounds_since_dense += 1
            bucket.dense_since_round = 0

    def snapshot(self) -> dict[int, dict]:
        """What the policy has learnt, per batch size, for reports: the running means of a dense and a draft step
        and of a verify step per round length (ms), the acceptance, the ``k`` it would pick now (``None`` before
        every kind of step is timed) and the steps recorded per kind (``"dense"``, ``"draft"``, ``"verify-K"``)."""
        report = {}
        for batch, bucket in sorted(self._buckets.items()):
            report[batch] = {
                "dense_ms": _ms(bucket.seconds.get(StepKind.DENSE)),
                "draft_ms": _ms(bucket.seconds.get(StepKind.DRAFT)),
                "verify_ms": {k: _ms(t) for k, t in sorted(bucket.verify_by_drafts.items())},
                "acceptance": self.acceptance(batch), "k": self._best_k(batch) if bucket.timed else None,
                "steps": dict(bucket.steps)}
        return report

    def _never_pays(self, batch: int) -> bool:
        """Whether drafting loses to dense steps at ``batch`` rows even if every draft were kept (a draft step as
        dear as a dense one, a 1.5B model at batch 1). Only the step times can change that, so the next probe waits
        :data:`MAX_PROBE_EVERY` dense steps."""
        return self._best_k(batch, acceptance=1.0) == 0

    def record_round(self, batch: int, drafted: int, kept: int) -> None:
        """A verify of ``batch`` rows kept ``kept`` of a row's ``drafted`` drafts (once per verified row)."""
        bucket = self._bucket(batch)
        bucket.kept = (1 - _WEIGHT / batch) * bucket.kept + kept
        bucket.tested = (1 - _WEIGHT / batch) * bucket.tested + kept + (kept < drafted)


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else 1e3 * seconds


def draft_reuse_steps(config: Optional["SpeculativeConfig"]) -> int:
    """Decode steps one selection serves in a lossless engine (``config``; 0 without one), which the decode buffers
    and the selection memory are sized for (``QuestConfig.selection_interval``): a round's drafts attend one
    selection, its first draft's, and the pages begun since it in full: ``k`` steps."""
    return 0 if config is None else config.num_speculative_tokens


def keep_verified(seq: "Sequence", tokens: list[int], policy: Optional[SpeculationPolicy], rows: int) -> list[int]:
    """The tokens a verify row of ``seq`` keeps: its drafts while they equal ``tokens`` (dense attention's), then the
    token after them; counts the round on the sequence and, for a step of ``rows`` decoding rows, in ``policy``."""
    drafts = seq.draft_token_ids
    accepted = 0
    while accepted < len(drafts) and tokens[accepted] == drafts[accepted]:
        accepted += 1
    seq.num_verify_steps += 1
    _count_round(seq.draft_tokens_by_position, seq.accepted_tokens_by_position, len(drafts), accepted)
    if policy is not None:
        policy.record_round(rows, len(drafts), accepted)
    return tokens[:accepted + 1]


def _count_round(drafted: list[int], kept: list[int], drafts: int, accepted: int) -> None:
    """A verified round of ``drafts`` drafts whose first ``accepted`` were kept, counted by draft position in
    ``drafted`` and ``kept`` (grown alike as needed, so that a position drafted and never kept counts 0 kept)."""
    for counts in (drafted, kept):
        counts.extend([0] * (drafts - len(counts)))
    for i in range(drafts):
        drafted[i] += 1
        kept[i] += i < accepted


def verified_next_inputs(tokens: torch.Tensor, offsets: torch.Tensor, drafts: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`keep_verified`'s choice on the device, for every row of a step at once, so that the next round's first
    draft can be launched before the verify's update: per row, the next step's input token (the token after the
    drafts it keeps) and how many drafts it keeps.

    Args:
        tokens: ``[num tokens]`` int64, the step's sampled tokens, row after row (a verify row's ``k + 1``).
        offsets: ``[rows]`` int64, each row's first token in ``tokens``.
        drafts: ``[rows, width]`` int64, a verify row's ``k <= width`` drafts then -1; any other row's -1 only
            (a token is never -1: no draft is kept and its one token is the next input).

    Returns:
        ``[rows]`` int64 next input tokens and ``[rows]`` int64 drafts kept.
    """
    width = drafts.shape[1]
    index = offsets[:, None] + torch.arange(width + 1, dtype=torch.int64, device=tokens.device)
    sampled = tokens[index.clamp(max=tokens.shape[0] - 1)]  # [rows, width + 1]: past a row's tokens never compared
    kept = (sampled[:, :width] == drafts).to(torch.int64).cumprod(dim=1).sum(dim=1)
    return sampled.gather(1, kept[:, None])[:, 0], kept
