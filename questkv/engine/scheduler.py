"""Continuous batching: which sequences run each step, page admission, preemption, token stops.

The scheduler owns the waiting queue and the running batch and asks ``PagedKVCache`` for page counts; it
never touches a tensor (the runner computes slots and writes K/V) and never sees text (stop strings are the
engine's, through :meth:`Scheduler.finish`).

Cache invariant, for every running sequence ``seq``: ``cache.seq_len(seq.cache_id) == seq.num_tokens +
seq.num_in_flight - 1``. :meth:`Scheduler.schedule` allocates the positions of a step's input tokens and counts
the token the step will sample as in flight; :meth:`Scheduler.update` appends it. Synchronously (update right after
each step) that is ``seq.num_tokens - 1`` between steps: the cache holds every token but the last sampled one,
which is the next step's input. Under asynchronous scheduling the engine schedules step N+1 before it updates
step N, so a decode input may be a token still in flight (the runner reads it on the device); a sequence whose
in-flight tokens will surely end it by length is not scheduled again, and one that stops on a token or a stop
string costs at most one discarded step.

A sequence therefore caches at most ``num_prompt_tokens + max_tokens - 1 <= max_model_len - 1`` tokens.

Chunked prefill (``chunked_prefill=True``): a step mixes decode tokens and prefill chunks, vLLM V1's way. Every
running sequence that can decode brings its one token, and prefill work fills the rest of the step's
``max_num_batched_tokens`` tokens. One running sequence at most (the newest, :attr:`Scheduler.prefilling`) may hold
a part of its tokens only, ``cache.seq_len < seq.num_tokens`` with nothing in flight; it is no decode row and
samples nothing until the step that prefills its last chunk.
"""

from __future__ import annotations

import collections
import time
from typing import Iterable, Optional, Union

from questkv.cache.paged import PagedKVCache
from questkv.config import QuestConfig
from questkv.decode.route import decodes_densely
from questkv.engine.sampling_params import check_length
from questkv.engine.step_data import ScheduledBatch
from questkv.engine.sequence import Logprob, Sequence, SequenceStatus
from questkv.engine.rounds import Rounds
from questkv.engine.speculation import SpeculationPolicy, keep_verified
from questkv.validation import check_int

__all__ = ["ROW_KINDS", "STEP_KINDS", "Scheduler"]

STEP_KINDS = ("decode", "prefill", "mixed")
"""The kinds of a scheduled step: decode rows only, prefill rows only, or both (chunked prefill)."""

ROW_KINDS = ("decode", "verify", "prefill")
"""The kinds of a step's rows (:attr:`Scheduler.step_tokens`)."""


class Scheduler:
    """FIFO admission by free pages, prefill before decode (mixed in one step with chunking), preemption of the
    newest by recompute.

    Without chunking each :meth:`schedule` is either a prefill of waiting sequences (admitted in arrival order while
    the batch has fewer than ``max_num_seqs`` running, the prefill tokens stay within ``max_num_batched_tokens``
    (without chunking the first one is always admitted, however long; with the cache's prefix caching, a sequence
    starts on the cached pages of its leading full pages, which cost neither tokens nor free pages, and its full
    pages become shareable at once, by the later sequences of the same batch too: identical prompts admitted
    together are computed once, each later copy computing only the tokens past its last full page, at least one;
    without prefix caching each computes its own) and the pool holds their tokens plus one decode step of every
    running sequence), or else one decode step of every running sequence. When the pool cannot hold the decode step,
    the newest running sequence is preempted: its pages are freed, it returns to the front of the waiting queue and
    is later prefilled again with its prompt and generated tokens.

    With ``chunked_prefill`` (vLLM V1's policy) every step carries at most ``max_num_batched_tokens`` tokens: first
    one decode token of every running sequence that can decode (preempting the newest while the pool cannot hold
    them, as a decode step does), then prefill work in the rest of the budget: the chunked sequence's next chunk,
    then admissions as above, the last of which may take only a chunk of its tokens. That sequence
    (:attr:`prefilling`) holds the pages of its chunks and samples nothing, and the next step continues it before
    admitting anyone else. Its tokens must fit the pool when it is admitted, as an unchunked prompt's; its chunks take
    their pages as they run (its remaining pages are kept from later admissions), and when a chunk cannot get its
    pages (decodes grew meanwhile) it is preempted, to restart from its cached pages. So the running decodes advance
    in every step while long prompts are prefilled, each step's prefill chunk at most ``max_num_batched_tokens``
    minus the decodes. A step with no prefill work is a decode-only step (under its CUDA graph), one with no decode a
    prefill-only step. Full pages of each chunk are offered to the prefix cache as they are computed, so that the
    prompts admitted behind a chunked one (from the step of its last chunk on) hit every full page it shares with
    them.

    Args:
        cache: the engine's KV cache; the scheduler owns its sequences (pages held outside, e.g. the runner's
            scratch page, are simply not available to requests).
        max_num_seqs: the most sequences running at once (<= ``cache.max_seqs``).
        max_num_batched_tokens: without chunking, the most prompt tokens of one prefill step beyond its first
            sequence; with chunking, the most tokens of any step, decode and prefill together (at least
            ``max_num_seqs``, so that every decode fits).
        eos_token_ids: the model's end-of-sequence ids (ignored by requests with ``ignore_eos``).
        max_model_len: the most tokens (prompt plus generated) of one sequence.
        chunked_prefill: split prefills into chunks and mix them with the decode tokens in steps of at most
            ``max_num_batched_tokens`` tokens (see above).
        quest: the engine's Quest configuration, for the route of each decode row
            (:func:`~questkv.decode.route.decodes_densely`: a step that would decode densely does not draft).
        speculation: the engine's choice of drafts per round (lossless requests), or ``None``: every lossless
            request drafts its ``speculative_tokens``.

    Lossless requests (``seq.quest.speculative_tokens`` k > 0) decode in rounds: while the route of its next step is
    Quest's, a sequence drafts (decode rows whose tokens go to ``seq.draft_token_ids``) until it holds
    :meth:`Rounds.draft_limit <questkv.engine.rounds.Rounds.draft_limit>` drafts; then every drafting sequence
    verifies in the same step (rounds stay aligned, so that draft steps stay decode-only steps). A verify keeps the
    longest prefix of drafts that dense attention agrees with, plus its token; the cache drops the rest
    (:meth:`~questkv.cache.paged.PagedKVCache.rewind`). A lossless sequence that drafts nothing (its route is
    dense, the policy chose 0 drafts, or one token is left) decodes densely. Cache invariant with drafts:
    ``cache.seq_len == seq.num_tokens + len(seq.draft_token_ids) + seq.num_in_flight - 1``.

    ``waiting`` (a deque) and ``running`` (a list, oldest first) are for reading; change them through the
    methods.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        chunked_prefill: bool = False,
        quest: Optional[QuestConfig] = None,
        speculation: Optional[SpeculationPolicy] = None,
    ) -> None:
        if not isinstance(cache, PagedKVCache):
            raise ValueError(f"Scheduler.cache must be a PagedKVCache, got {type(cache).__name__}")
        check_int("Scheduler.max_num_seqs", max_num_seqs, minimum=1, maximum=cache.max_seqs)
        check_int("Scheduler.max_num_batched_tokens", max_num_batched_tokens, minimum=1)
        if chunked_prefill and max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"Scheduler.max_num_batched_tokens={max_num_batched_tokens} must be >= max_num_seqs={max_num_seqs} "
                "with chunked prefill: every step carries one token of each decoding sequence"
            )
        check_int("Scheduler.max_model_len", max_model_len, minimum=2)  # one prompt token, one generated
        eos_token_ids = frozenset(eos_token_ids)
        for token in eos_token_ids:
            check_int("Scheduler.eos_token_ids", token, minimum=0)
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.chunked_prefill = bool(chunked_prefill)
        self.quest = quest
        self.speculation = speculation
        self.rounds = Rounds(quest, speculation, max_model_len)
        self._prefilling: Optional[Sequence] = None
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._live: dict[str, Sequence] = {}
        self.prefix_queried_tokens = 0  # prefill tokens looked up in the prefix cache, and those found (cumulative)
        self.prefix_hit_tokens = 0
        # Cumulative, over the scheduled steps: how many of each kind ("decode": decode rows only, "prefill": prefill
        # rows only, "mixed": both) and their input tokens by kind of row ("decode", "prefill").
        self.step_counts = dict.fromkeys(STEP_KINDS, 0)
        self.step_tokens = dict.fromkeys(ROW_KINDS, 0)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def prefilling(self) -> Optional[Sequence]:
        """The running sequence whose chunked prefill is incomplete (no token in flight, samples nothing yet), or
        ``None``."""
        return self._prefilling

    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ``ValueError`` unless a request of this size can run (alone, if need be).

        The request must fit ``max_model_len`` (:func:`check_length`), and the most tokens the sequence ever
        caches (``num_prompt_tokens + max_tokens - 1``) must fit one sequence's page-table row and the pages
        available to requests (free or held by running sequences).
        """
        check_length(num_prompt_tokens, max_tokens, self.max_model_len)
        cached = num_prompt_tokens + max_tokens - 1
        need = self.cache.pages_for_tokens(cached)
        held = {page for seq in self.running for page in self.cache.pages_of(seq.cache_id)}  # shared pages once
        usable = self.cache.num_free_pages + len(held)  # the pages available to requests
        if need > min(usable, self.cache.max_pages_per_seq):
            limit = (
                f"one sequence may hold at most max_pages_per_seq={self.cache.max_pages_per_seq}"
                if self.cache.max_pages_per_seq < usable
                else f"the KV cache has {usable} pages for requests"
            )
            raise ValueError(
                f"a request of {num_prompt_tokens} prompt tokens and max_tokens={max_tokens} caches up to {cached} "
                f"tokens, {need} pages of {self.cache.page_size}, but {limit}; shorten the prompt, lower "
                f"max_tokens or give the KV cache more memory"
            )

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (status ``WAITING``, no pages) after checking that it fits (:meth:`check_fits`)."""
        if not isinstance(seq, Sequence):
            raise ValueError(f"Scheduler.add takes a Sequence, got {type(seq).__name__}")
        if seq.status is not SequenceStatus.WAITING or seq.cache_id is not None:
            raise ValueError(
                f"Scheduler.add takes a new waiting sequence; request {seq.request_id!r} has status "
                f"{seq.status.name} and cache_id {seq.cache_id}"
            )
        if seq.request_id in self._live:
            raise ValueError(f"request id {seq.request_id!r} is already waiting or running")
        self.check_fits(seq.num_prompt_tokens, seq.sampling_params.max_tokens)
        self.waiting.append(seq)
        self._live[seq.request_id] = seq

    def schedule(self) -> Optional[ScheduledBatch]:
        """The next step. Without chunking: a prefill (admitted waiting sequences) if there is one, else a decode
        step of every running sequence (preempting the newest while the pool cannot hold it). With chunking: the
        decode rows of every running sequence that can decode (preempting likewise), then prefill rows (the
        chunked sequence's next chunk, then admissions) in the rest of the token budget. ``None`` when nothing is
        left to launch. Pages for the step's input tokens are allocated here."""
        if self.speculation is not None:  # (else every round is as long as its request asks)
            self.rounds.plan(self._num_decoding(), once=True)
        if self.chunked_prefill:
            decodes, verifies = self._schedule_decode()
            taken = len(decodes) + sum(seq.num_drafts + 1 for seq in verifies)
            prefills, news = self._schedule_prefill(self.max_num_batched_tokens - taken)
        else:
            prefills, news = self._schedule_prefill(self.max_num_batched_tokens)
            decodes, verifies = ([], []) if prefills else self._schedule_decode()
        if not decodes and not verifies and not prefills:
            if not self.running and self.waiting and not self.waiting[0].num_in_flight:
                seq = self.waiting[0]
                raise RuntimeError(
                    f"request {seq.request_id!r} ({seq.num_tokens} tokens) waits with nothing running but cannot "
                    f"be admitted: {self.cache.num_free_pages} pages free of {self.cache.num_pages}, "
                    f"{len(self.cache.sequences)} of {self.cache.max_seqs} cache sequence slots in use"
                )
            return None
        seqs = (*decodes, *verifies, *prefills)
        verified = tuple(seq.num_drafts + 1 for seq in verifies)  # (the last draft may be in flight)
        ahead = tuple(seq.verify_in_flight for seq in decodes)  # first drafts launched ahead of their verify's update
        for seq in verifies:
            seq.verify_in_flight = seq.num_drafts
        decoding = decodes or verifies  # (a verify row is decode work: a step of verifies and prefills is mixed)
        self.step_counts["mixed" if decoding and prefills else "decode" if decoding else "prefill"] += 1
        self.step_tokens["decode"] += len(decodes)
        self.step_tokens["verify"] += sum(verified)
        self.step_tokens["prefill"] += sum(news)
        seq_lens = tuple(self.cache.seq_len(seq.cache_id) for seq in seqs)
        drafts = tuple(i for i, (seq, seq_len) in enumerate(zip(decodes, seq_lens))
                       if seq.quest.speculative_tokens and self.rounds.drafts(seq, seq_len))
        drafting = set(drafts)
        for i in drafts:
            self.rounds.count_draft(decodes[i])
        dense = tuple(decodes_densely(self.quest, seq.quest.token_budget, seq_len)
                      or (seq.quest.speculative_tokens > 0 and i not in drafting)
                      for i, (seq, seq_len) in enumerate(zip(decodes, seq_lens)))
        return ScheduledBatch(
            seqs, (1,) * len(decodes) + verified + tuple(news), seq_lens, num_decodes=len(decodes),
            partial=bool(prefills) and prefills[-1] is self._prefilling, num_verifies=len(verifies),
            drafts=drafts, dense_rows=dense, ahead=ahead if any(ahead) else (),
        )

    def waits_for(self, in_flight: Optional[ScheduledBatch]) -> bool:
        """Whether the next step needs the tokens of the step ``in_flight`` (launched, not yet updated; ``None``:
        none) on the host, so that the engine must update that step before it schedules the next (asynchronous
        scheduling). A lossless round's draft steps and its verify are launched ahead, as decode steps are (a row's
        input token in flight is read on the device; the verify's update comes after its last draft's), and so is
        the next round's first draft after a verify whose every row may start it whatever it keeps
        (:meth:`Rounds.may_draft_ahead`) while every decoding sequence gets its next page without a preemption: its
        input token, position and KV length then follow on the device from the tokens the verify keeps. Otherwise a
        round needs them at its ends: after a verify (the tokens it keeps set the lengths) and before a round starts
        (its drafts are counted from the outputs). Asks the policy for the next :meth:`schedule`'s drafts once, so
        that the answer and the step agree."""
        if self.speculation is not None:
            self.rounds.plan(self._num_decoding())
        if in_flight is None:
            return False
        if in_flight.num_verifies:
            verifies = in_flight.seqs[in_flight.num_decodes:in_flight.num_decodes + in_flight.num_verifies]
            decoding = [seq.cache_id for seq in self.running if self._decodes(seq)]
            return not (all(map(self.rounds.may_draft_ahead, verifies))
                        and self.cache.can_reserve(decoding, [1] * len(decoding)))
        return any(seq.quest.speculative_tokens and seq.num_in_flight and not seq.num_drafts and self._decodes(seq)
                   and self.rounds.may_start(seq, self.cache.seq_len(seq.cache_id) + 1) for seq in self.running)

    def update(
        self, batch: ScheduledBatch, token_ids: Iterable,
        logprobs: Optional[list[list[dict[int, Logprob]]]] = None,
    ) -> list[Sequence]:
        """Append the token each sequence of ``batch`` sampled, apply the token stops (end-of-sequence unless
        ``ignore_eos``, ``stop_token_ids``, ``max_tokens``, ``max_model_len``) and free the pages of the finished
        sequences at once. Sequences finished since :meth:`schedule` (aborted, or stopped by the update of the
        step before) are skipped: their tokens are discarded. A sequence preempted since :meth:`schedule` gets
        its token (it was sampled from its whole context) and may finish while waiting.

        At a forced output (``SamplingParams.forced_token_ids``) the forced token is appended instead: the
        sampled token goes to ``seq.forced_choices`` and the forced token's log-probability to
        ``seq.forced_logprobs``; only ``max_tokens`` and ``max_model_len`` stop there.

        A draft row's token goes to ``seq.draft_token_ids``, with no stop. A verify row keeps the longest prefix of
        its drafts that equals its tokens, then its token after them (dense attention's choice: its argmax, or its
        draw); the cache drops the positions past them and recomputes the round's pages' key bounds; the kept
        tokens are appended one by one, each with its stops (a stop inside the kept run ends it there).

        Args:
            token_ids: per sequence of ``batch.seqs[:batch.num_sampled]`` (a partial prefill samples nothing),
                the token it sampled; on a verify row the list of its ``num_new_tokens`` tokens.
            logprobs: per sampling sequence of ``batch`` and per token it sampled, the output token's log-probability
                and the most likely tokens' (:meth:`SampledTokens.logprobs_by_row
                <questkv.engine.step_data.SampledTokens.logprobs_by_row>`), kept in ``seq.output_logprobs`` when its
                request asks for them; needed when a live sequence is at a forced output.

        Returns:
            The sequences that finished in this update, in batch order.
        """
        sampled = batch.seqs[:batch.num_sampled]
        rows = batch.token_rows(token_ids)
        if logprobs is not None and [len(row) for row in logprobs] != [len(row) for row in rows]:
            raise ValueError(f"update got log-probabilities for {[len(row) for row in logprobs]} tokens per row, "
                             f"for a batch that sampled {[len(row) for row in rows]}")
        live = [(i, seq, tokens) for i, (seq, tokens) in enumerate(zip(sampled, rows)) if not seq.is_finished]
        if logprobs is None and any(seq.is_forced(seq.num_output_tokens) for _, seq, _ in live):
            raise ValueError("update: a sequence is at a forced output but no logprobs were given")
        for _, seq, _ in live:
            cached = None if seq.cache_id is None else self.cache.seq_len(seq.cache_id)
            expected = seq.num_tokens + len(seq.draft_token_ids) + seq.num_in_flight - 1
            running_ok = seq.status is SequenceStatus.RUNNING and cached == expected
            preempted_ok = seq.status is SequenceStatus.WAITING and cached is None
            if seq.num_in_flight < 1 or not (running_ok or preempted_ok):
                raise RuntimeError(
                    f"request {seq.request_id!r} in the batch has status {seq.status.name}, {seq.num_tokens} tokens, "
                    f"{len(seq.draft_token_ids)} drafts, {seq.num_in_flight} in flight and {cached} cached; a "
                    f"scheduled sequence must be running with its tokens and in-flight inputs cached (or preempted since)"
                )
        for seq in sampled:
            seq.num_in_flight -= 1
        for i in batch.drafts:
            sampled[i].num_drafts_in_flight -= 1
        verifying = range(batch.num_decodes, batch.num_decodes + batch.num_verifies)
        kept = {i: keep_verified(seq, rows[i], self.speculation, batch.num_decodes + batch.num_verifies)
                for i, seq, _ in live if i in verifying}
        for i in verifying:
            sampled[i].verify_in_flight = 0
        self._rewind([(seq, kept[i]) for i, seq, _ in live if i in kept and seq.cache_id is not None])
        now = time.perf_counter()
        finished = []
        drafts = set(batch.drafts)
        for i, seq, tokens in live:
            if i in kept:
                tokens = kept[i]
            elif i in drafts:
                if seq.status is SequenceStatus.RUNNING:  # (a round preempted since is recomputed without its drafts)
                    seq.draft_token_ids.append(tokens[0])
                continue
            for j, token in enumerate(tokens):
                stop = self._append(seq, token, logprobs[i][j] if logprobs is not None else None, now)
                if stop is not None:
                    self.finish(seq, *stop)
                    finished.append(seq)
                    break
        return finished

    def _rewind(self, rounds: list[tuple[Sequence, list[int]]]) -> None:
        """Drop the verified sequences' positions past their kept tokens (all but the last, which is the next
        input) and the next round's first draft if it is in flight (its position follows them), and recompute the
        key bounds of the pages their round wrote (that draft's key included: its step ran before)."""
        if rounds:
            start = [seq.num_tokens - 1 for seq, _ in rounds]  # the round's first input: its last verified token
            self.cache.rewind([seq.cache_id for seq, _ in rounds],
                              [seq.num_tokens + len(kept) - 1 + seq.num_in_flight for seq, kept in rounds], start)
        for seq, _ in rounds:
            seq.draft_token_ids = []

    def _append(self, seq: Sequence, token: int, logprobs: Optional[dict[int, Logprob]], now: float
                ) -> Optional[tuple[SequenceStatus, Optional[int]]]:
        """Append one sampled token of ``seq`` (its forced token at a forced output) and its ``logprobs`` (the
        output token's entry first), offer its filled pages to the prefix cache, and return the stop it hits, if
        any."""
        forced = seq.is_forced(seq.num_output_tokens)
        if forced:
            seq.forced_choices.append(token)
            token = seq.sampling_params.forced_token_ids[seq.num_output_tokens]
            seq.forced_logprobs.append(logprobs[token].logprob)
        if seq.sampling_params.logprobs is not None:
            seq.output_logprobs.append(logprobs)
        seq.output_token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if seq.cache_id is not None:
            self._register(seq)  # before a finish frees its pages: a later turn may share its output
        return seq.token_stop(token, self.eos_token_ids, self.max_model_len, forced)

    def finish(
        self, seq: Sequence, status: SequenceStatus, reason: Union[int, str, None] = None
    ) -> None:
        """Finish a waiting or running sequence with a finished ``status`` and ``stop_reason``; its pages
        are freed at once. The engine calls it for stop strings: a sequence that :meth:`update` has just
        finished (by length or a stop token) may be relabelled ``FINISHED_STOPPED`` with the stop string that
        its last token completed; an aborted one stays aborted."""
        if not isinstance(status, SequenceStatus) or not status.is_finished:
            raise ValueError(f"Scheduler.finish needs a finished status, got {status!r}")
        if seq.is_finished:
            if seq.status is not SequenceStatus.FINISHED_ABORTED and status is SequenceStatus.FINISHED_STOPPED:
                seq.status, seq.stop_reason = status, reason
                return
            raise ValueError(f"request {seq.request_id!r} already finished ({seq.status.name})")
        if self._live.get(seq.request_id) is not seq:
            raise ValueError(f"request {seq.request_id!r} is not waiting or running in this scheduler")
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._free(seq)
        else:
            self.waiting.remove(seq)
        del self._live[seq.request_id]
        seq.status, seq.stop_reason = status, reason
        seq.finished_time = time.perf_counter()

    def abort(self, request_id: str) -> bool:
        """Finish a waiting or running request as aborted, freeing its pages at once; ``False`` if no such
        request is waiting or running."""
        seq = self._live.get(request_id)
        if seq is None:
            return False
        self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return True

    def _schedule_prefill(self, budget: int) -> tuple[list[Sequence], list[int]]:
        """The prefill rows of a step of at most ``budget`` prefill tokens (without chunking: beyond the first
        sequence) and each one's new tokens, their pages allocated: the chunked sequence's next chunk, then
        admissions."""
        cache = self.cache
        seqs: list[Sequence] = []
        news: list[int] = []
        if budget < 1:  # decodes fill the step
            return seqs, news
        # Keep room for the next decode step of the running sequences and of the admitted ones, and for the rest of a
        # chunked prefill, so that an admission does not force a preemption on the very next step.
        reserved = sum(self._pages_to_come(seq) for seq in self.running if seq is not self._prefilling)
        computed = 0
        seq = self._prefilling
        if seq is not None:  # its next chunk first
            chunk = min(seq.num_tokens - cache.seq_len(seq.cache_id), budget)
            if cache.can_reserve([seq.cache_id], [chunk]):
                self._take_chunk(seq, chunk)
                seqs.append(seq)
                news.append(chunk)
                computed = chunk
                reserved += self._pages_to_come(seq)
            else:  # decodes took its pages meanwhile: it restarts (from its cached pages) once it fits again
                self.running.remove(seq)
                self._preempt(seq)
        partial = self._prefilling is not None
        while (not partial and self.waiting and len(self.running) < self.max_num_seqs
               and len(cache.sequences) < cache.max_seqs):
            head = self.waiting[0]
            if head.num_in_flight:  # preempted with a token in flight: recomputed once the token is known
                break
            count = head.num_tokens
            total = cache.pages_for_tokens(min(count + 1, head.max_cached_tokens(self.max_model_len)))
            most = (count - 1) // cache.page_size if cache.prefix_caching else 0
            if reserved + total - most > cache.num_free_pages:
                break  # not even the longest hit would fit: spare the lookup (a blocked queue head waits each step)
            # A prefix-cache hit leaves at least the last token to compute (the step needs its logits); it may be
            # on pages an earlier sequence of this step computes (registered by _take_chunk below).
            hit = []
            if cache.prefix_caching:
                tokens = head.all_token_ids
                if len(head.page_hashes) < count // cache.page_size:
                    cache.extend_hashes(head.page_hashes, tokens)  # once per page, however often it waits
                hit = cache.match_prefix(tokens, most, head.page_hashes)
            new = count - len(hit) * cache.page_size
            take = new
            if computed + new > budget:
                if not self.chunked_prefill:
                    if seqs:
                        break
                else:
                    take = budget - computed  # a first chunk; the step is then full
                    if take < 1:
                        break
            # Hit pages cost nothing, except evictable ones (they stop counting as free); pages are taken below,
            # so `reserved` keeps only what the admitted sequences take later (rest of the prompt, next decode).
            if reserved + total - len(hit) + cache.prefix_cost(hit) > cache.num_free_pages:
                break
            if cache.prefix_caching:
                self.prefix_queried_tokens += count
                self.prefix_hit_tokens += len(hit) * cache.page_size
            self.waiting.popleft()
            head.cache_id = cache.add_sequence()
            cache.share_prefix(head.cache_id, hit)
            if head.num_cached_tokens is None:
                head.num_cached_tokens = len(hit) * cache.page_size
            head.status = SequenceStatus.RUNNING
            self.running.append(head)
            self._take_chunk(head, take)
            reserved += self._pages_to_come(head)
            computed += take
            seqs.append(head)
            news.append(take)
            partial = self._prefilling is not None
        return seqs, news

    def _take_chunk(self, seq: Sequence, count: int) -> None:
        """Allocate the next ``count`` tokens of the running ``seq``'s prefill and offer its full pages to the prefix
        cache: shareable at once, since every layer writes the step's K/V before it attends, so that a later
        sequence of this very batch may read them (the runner computes the batch in order). A prefill that ends
        here has its token in flight; one that does not is :attr:`prefilling`."""
        cache = self.cache
        cache.allocate([seq.cache_id], [count])
        seq.num_prefilled_tokens = cache.seq_len(seq.cache_id)
        if cache.prefix_caching:
            if len(seq.page_hashes) < seq.num_prefilled_tokens // cache.page_size:
                cache.extend_hashes(seq.page_hashes, seq.all_token_ids)
            cache.register(seq.cache_id, seq.all_token_ids, seq.page_hashes)
        if seq.num_prefilled_tokens < seq.num_tokens:
            self._prefilling = seq
        else:
            self._prefilling = None
            seq.num_in_flight = 1

    def _pages_to_come(self, seq: Sequence) -> int:
        """Pages the running ``seq`` takes before its next decode step is scheduled: the rest of its prefill's
        and its next token's (one decode step's when prefilled)."""
        cache = self.cache
        if seq is not self._prefilling:
            return cache.pages_needed(seq.cache_id, 1)
        held = len(cache.pages_of(seq.cache_id))
        return cache.pages_for_tokens(min(seq.num_tokens + 1, seq.max_cached_tokens(self.max_model_len))) - held

    def _schedule_decode(self) -> tuple[list[Sequence], list[Sequence]]:
        """The decode rows and the verify rows of a step, their next token's pages allocated: every running sequence
        that decodes, after preempting the newest running sequences (a chunked one first, being the newest) while
        the pool cannot hold them. A lossless sequence verifies when it holds its round's drafts
        (:meth:`Rounds.due <questkv.engine.rounds.Rounds.due>`), or when another one verifies and it holds any."""

        def decoding() -> list[Sequence]:
            return [seq for seq in self.running if self._decodes(seq)]

        seqs = decoding()
        while not self.cache.can_reserve([seq.cache_id for seq in seqs], [1] * len(seqs)):
            if len(self.running) == 1:
                seq = self.running[0]
                raise RuntimeError(
                    f"request {seq.request_id!r} runs alone but cannot get room for its next token: it caches "
                    f"{self.cache.seq_len(seq.cache_id)} tokens in {len(self.cache.pages_of(seq.cache_id))} pages, "
                    f"{self.cache.num_free_pages} pages free of {self.cache.num_pages} (max_pages_per_seq="
                    f"{self.cache.max_pages_per_seq}); check_fits should have refused it"
                )
            self._preempt(self.running.pop())
            seqs = decoding()
        self.cache.allocate([seq.cache_id for seq in seqs], [1] * len(seqs))
        for seq in seqs:
            seq.num_in_flight += 1
        due = any(self.rounds.due(seq) for seq in seqs if seq.num_drafts)
        verify = {id(seq) for seq in seqs if due and seq.num_drafts}
        if due and any(seq.num_drafts_in_flight > 1 for seq in seqs):
            raise RuntimeError("a verify step was scheduled with two drafts of a row in flight; the engine updates "
                               "all but the last first (Scheduler.waits_for)")
        return [seq for seq in seqs if id(seq) not in verify], [seq for seq in seqs if id(seq) in verify]

    def _num_decoding(self) -> int:
        """The running sequences that decode in the next step (:meth:`_decodes`)."""
        return sum(map(self._decodes, self.running))

    def _decodes(self, seq: Sequence) -> bool:
        """Whether the running ``seq`` is a decode row: its prefill is done and its in-flight tokens do not
        surely finish it."""
        return seq is not self._prefilling and not seq.ends_in_flight(self.max_model_len)

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.draft_token_ids, seq.verify_in_flight = [], 0  # a preempted round is recomputed from its verified tokens
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _free(self, seq: Sequence) -> None:
        self.cache.free_sequence(seq.cache_id)
        seq.cache_id = None
        if seq is self._prefilling:  # finished or preempted mid-prefill: it restarts from its (cached) pages
            self._prefilling = None

    def _register(self, seq: Sequence) -> None:
        """Offer the sequence's newly filled pages to the prefix cache (cheap when none filled up). A Quest request
        (``seq.quest``) offers only its prefilled pages: a token that a Quest step computed attended part of its
        context, so its K/V are not those of a prefill of the same tokens (a dense or lossless request's are:
        a verify step overwrites the drafts' K/V with dense attention's, all but its newest token's, which the next
        round's first draft writes, possibly launched before the update that appended the token)."""
        cache = self.cache
        if not cache.prefix_caching:
            return
        known = min(cache.seq_len(seq.cache_id), seq.num_tokens)
        if seq.quest.speculative_tokens:  # verified K/V, but its newest token's: the next round's first draft's
            known = min(known, seq.num_tokens - 1)
        elif not seq.quest.dense:
            known = min(known, seq.num_prefilled_tokens)
        if known // cache.page_size > cache.num_registered_pages(seq.cache_id):
            cache.register(seq.cache_id, seq.all_token_ids[:known])
