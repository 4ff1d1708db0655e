"""Lossless rounds: how many drafts a sequence takes, when it verifies, when its next round may start.

A lossless request (``seq.quest.speculative_tokens`` k > 0) decodes in rounds while the route of its next step is
Quest's: draft steps until it holds :meth:`Rounds.draft_limit` drafts, then a verify step
(:mod:`questkv.engine.scheduler` schedules them). The round length is the policy's
(:class:`~questkv.engine.speculation.SpeculationPolicy`), asked once per step (:meth:`Rounds.plan`) and fixed for a
round when its first draft is scheduled (:meth:`Rounds.count_draft`): where neighbouring lengths predict close rates
the choice flips with the noise of the step times, and a round that ended at the first step whose choice was shorter
than its drafts so far ran shorter than any step chose.
"""

from __future__ import annotations

from typing import Optional

from questkv.config import MAX_SPECULATIVE_TOKENS, QuestConfig
from questkv.decode.route import decodes_densely
from questkv.engine.sequence import Sequence, SequenceStatus
from questkv.engine.speculation import SpeculationPolicy

__all__ = ["Rounds"]


class Rounds:
    """The scheduler's rules for lossless rounds.

    Args:
        quest: the engine's Quest configuration (a step that would decode densely does not draft:
            :func:`~questkv.decode.route.decodes_densely`).
        speculation: the engine's choice of drafts per round, or ``None``: every lossless request drafts its
            ``speculative_tokens``.
        max_model_len: the most tokens of one sequence.
    """

    def __init__(self, quest: Optional[QuestConfig], speculation: Optional[SpeculationPolicy],
                 max_model_len: int) -> None:
        self.quest, self.speculation, self.max_model_len = quest, speculation, max_model_len
        self.k = MAX_SPECULATIVE_TOKENS  # the most drafts per round in the step being scheduled
        self._planned = False

    def plan(self, decoding: int, once: bool = False) -> None:
        """Fix the most drafts per round of the next scheduled step: what the policy allows ``decoding`` decode rows
        (without a policy, each request's own ``speculative_tokens``). ``once``: the step's scheduling, which keeps
        the answer of a plan made just before it (``Scheduler.waits_for``), so that the two agree."""
        if not (once and self._planned):
            self.k = MAX_SPECULATIVE_TOKENS if self.speculation is None else self.speculation.draft_tokens(decoding)
        self._planned = not once

    def draft_limit(self, seq: Sequence, pending: int = 0) -> int:
        """Drafts the lossless ``seq`` takes this round (after ``pending`` more outputs): its ``speculative_tokens``,
        fewer where the policy picked fewer (for a round under way: when it started) or where the round's verify
        would otherwise pass ``max_tokens`` or ``max_model_len`` (it outputs up to one token more than its drafts)."""
        outputs, tokens = seq.num_output_tokens + pending, seq.num_tokens + pending
        return min(seq.quest.speculative_tokens, seq.round_drafts if seq.num_drafts else self.k,
                   seq.sampling_params.max_tokens - outputs - 1, self.max_model_len - tokens - 1)

    def may_start(self, seq: Sequence, seq_len: int, pending: int = 0) -> bool:
        """Whether a step that gives ``seq`` ``seq_len`` cached tokens may make it draft (a lossless request, a draft
        limit above 0 after ``pending`` more outputs, a route of Quest's), its tokens so far being all on the host."""
        return (seq.quest.speculative_tokens > 0 and self.draft_limit(seq, pending) > 0
                and not decodes_densely(self.quest, seq.quest.token_budget, seq_len))

    def count_draft(self, seq: Sequence) -> None:
        """A draft step of ``seq`` is scheduled: counted in flight, and a round that it starts takes the step's
        most drafts per round as its own."""
        if not seq.num_drafts:
            seq.round_drafts = self.k
        seq.num_drafts_in_flight += 1

    def due(self, seq: Sequence) -> bool:
        """Whether ``seq`` holds every draft of its round (updated or in flight): it verifies in the next step."""
        return bool(seq.num_drafts) and seq.num_drafts >= self.draft_limit(seq)

    def drafts(self, seq: Sequence, seq_len: int) -> bool:
        """Whether the decode row ``seq`` (``seq_len`` cached tokens, its next position allocated) drafts: it is in a
        lossless round, its verify in flight let the next one start (:meth:`may_draft_ahead`), or it may start one
        from tokens all on the host (none in flight but this step's: the draft limit counts outputs)."""
        if seq.num_drafts or seq.verify_in_flight:
            return True
        return seq.num_in_flight == 1 and self.may_start(seq, seq_len)

    def may_draft_ahead(self, seq: Sequence) -> bool:
        """Whether the running ``seq``, its verify in flight, may start its next round before the verify's update,
        whatever it keeps (1 to all its drafts + 1 tokens): no forced output is left, the round starts at the
        shortest length and drafts at least once after the longest run."""
        return (seq.status is SequenceStatus.RUNNING and not seq.is_forced(seq.num_output_tokens)
                and self.may_start(seq, seq.num_tokens + 1, seq.verify_in_flight + 1))
