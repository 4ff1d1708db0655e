"""One engine step's data, no behaviour: the work the scheduler hands the runner (:class:`ScheduledBatch`), the
prefill rows every rank runs (:class:`PrefillInputs`), rank 0's message to the other ranks under tensor
parallelism (:class:`StepMessage`) and the sampled tokens in flight (:class:`SampledTokens`)."""

from __future__ import annotations

import dataclasses
import operator
from typing import Iterable, Optional

import numpy as np
import torch

from questkv.engine.cuda_graphs import GraphKey
from questkv.engine.sequence import Logprob, Sequence

__all__ = ["PrefillInputs", "SampledTokens", "ScheduledBatch", "StepLogprobs", "StepMessage"]


@dataclasses.dataclass(frozen=True)
class ScheduledBatch:
    """One step's work: the sequences and how many input tokens each feeds, decode rows first.

    The first :attr:`num_decodes` sequences are decode rows (running sequences, one input token each:
    ``seq.last_token``, or the token still in flight under asynchronous scheduling); the others are prefill rows
    (new, recomputed or chunked sequences), the last of which may be :attr:`partial`. Without chunked prefill a
    step holds one kind only; with it a step may hold both (a mixed step).

    Lossless requests (:class:`~questkv.config.SpeculativeConfig`) bring two more kinds of row. A draft row is a
    decode row whose sequence drafts (its input a draft token after the round's first step; its sampled token a
    draft). A verify row (the :attr:`num_verifies` rows after the decode rows) feeds the round's last verified token
    and its ``j`` drafts (``num_new_tokens`` ``j + 1``) at positions ``seq_lens[i] - j - 1`` to ``seq_lens[i] - 1``,
    overwriting the drafts' K/V, and samples ``j + 1`` tokens: dense attention's token at each position. The runner
    runs verify rows as prefill rows that already hold their earlier tokens.

    Attributes:
        seqs: the sequences, in batch order (the order of the sampled tokens).
        num_new_tokens: per sequence, the step's input tokens: 1 on a decode row; on a prefill row its tokens (the
            prompt, plus the tokens generated before a preemption when recomputing) past those it already holds
            (``seq_lens[i] - num_new_tokens[i]`` of them: pages shared from the prefix cache, whole pages, fewer
            than all, and its earlier chunks), all of them or the next chunk.
        seq_lens: per sequence, the tokens it caches once the step's inputs are written (its KV length in the
            step); the step's inputs are positions ``seq_lens[i] - num_new_tokens[i]`` to ``seq_lens[i] - 1``.
        num_decodes: the leading decode rows.
        num_verifies: the verify rows after them.
        drafts: the decode rows (indices) that are draft rows.
        dense_rows: per decode row, whether its step attends densely: the route of
            :func:`~questkv.decode.route.decodes_densely`, or a lossless request's row that does not draft (its
            token is output as it is). The runner and the attention accounting read it.
        ahead: per decode row, the drafts of its verify step still in flight (0: none), or ``()`` when no row has
            one: the row is its next round's first draft, launched before the verify's update
            (:meth:`~questkv.engine.scheduler.Scheduler.waits_for`), and its ``seq_lens`` entry is the longest it
            can be (every draft kept); on the device its input token is the verify's token after the drafts it
            keeps, and its position and KV length move back by the drafts it rejects.
        partial: with chunking, whether the last sequence's prefill goes on in a later step (its ``seq_lens``
            stops short of its tokens): it samples nothing, so the step samples a token for ``seqs[:num_sampled]``
            only (every decode row, and each prefill row that completes).
    """

    seqs: tuple[Sequence, ...]
    num_new_tokens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_decodes: int = 0
    partial: bool = False
    num_verifies: int = 0
    drafts: tuple[int, ...] = ()
    dense_rows: tuple[bool, ...] = ()
    ahead: tuple[int, ...] = ()

    @property
    def num_prefills(self) -> int:
        """The rows after the decode rows, verify rows included (0: a decode-only step): the runner's prefill rows."""
        return len(self.seqs) - self.num_decodes

    def num_sampled_tokens(self, row: int) -> int:
        """Tokens row ``row`` (a sampling row) samples: ``num_new_tokens`` on a verify row, else 1."""
        verify = self.num_decodes <= row < self.num_decodes + self.num_verifies
        return self.num_new_tokens[row] if verify else 1

    @property
    def num_sampled(self) -> int:
        """The leading sequences of :attr:`seqs` that sample a token in this step: all but a partial one."""
        return len(self.seqs) - self.partial

    @property
    def seq_ids(self) -> tuple[int, ...]:
        """``PagedKVCache`` sequence ids, in batch order."""
        return tuple(seq.cache_id for seq in self.seqs)

    @property
    def num_tokens(self) -> int:
        """All input tokens of the step."""
        return sum(self.num_new_tokens)

    def forced_targets(self) -> Optional[list[int]]:
        """Per sampled token, the forced token of its output (``SamplingParams.forced_token_ids``; -1 where none, and
        never on a verify row: forced tokens exclude drafts); ``None`` when no row samples a forced output."""
        if not any(seq.sampling_params.forced_token_ids for seq in self.seqs[:self.num_sampled]):
            return None  # (the common case, asked every step: no per-token list)
        targets, any_forced = [], False
        for row, (seq, seq_len) in enumerate(zip(self.seqs[:self.num_sampled], self.seq_lens)):
            index = seq_len - seq.num_prompt_tokens  # the output this step samples for the row
            forced = seq.is_forced(index)
            targets += [seq.sampling_params.forced_token_ids[index] if forced else -1] * self.num_sampled_tokens(row)
            any_forced |= forced
        return targets if any_forced else None

    def sampling_rows(self, engine_seed: int) -> tuple[list[list[float]], list[list[int]]]:
        """Per sampled token, ``[temperature, top_p]`` and ``[top_k, seed, output index]`` (a verify row's tokens at
        its consecutive outputs; the seed :meth:`Sequence.sampling_seed`'s; an :attr:`ahead` row's index as if its
        verify kept no draft: the runner adds the drafts it keeps on the device)."""
        floats, ints = [], []
        for row, (seq, seq_len) in enumerate(zip(self.seqs[:self.num_sampled], self.seq_lens)):
            p, count, seed = seq.sampling_params, self.num_sampled_tokens(row), seq.sampling_seed(engine_seed)
            seq_len -= self.ahead[row] if row < len(self.ahead) else 0
            for j in range(count):  # the row's outputs, from seq_len - count on
                floats.append([p.temperature, p.top_p])
                ints.append([p.top_k, seed, seq_len - count + 1 + j - seq.num_prompt_tokens])
        return floats, ints

    def token_rows(self, token_ids: Iterable) -> list[list[int]]:
        """``token_ids`` as :meth:`~questkv.engine.scheduler.Scheduler.update` takes them (per sampling row, its token;
        on a verify row the list of its ``num_new_tokens``), checked, as one list of ints per row.

        Raises:
            ValueError: another count of rows or of a verify row's tokens, or a token that is not an int >= 0.
        """
        rows = list(token_ids)
        if len(rows) != self.num_sampled:
            raise ValueError(f"update got {len(rows)} token ids for a batch of {self.num_sampled} sampling sequences")
        for i, row in enumerate(rows):
            count = self.num_sampled_tokens(i)
            verify = self.num_decodes <= i < self.num_decodes + self.num_verifies
            tokens = list(row) if verify and isinstance(row, (list, tuple)) else [row]
            if verify and len(tokens) != count:
                raise ValueError(f"update: verify row {i} must get a list of {count} token ids, got {row!r}")
            for j, token in enumerate(tokens):
                try:
                    tokens[j] = operator.index(token)
                except TypeError:
                    raise ValueError(f"update: token_ids[{i}] must be an int, got {token!r}") from None
                if tokens[j] < 0:
                    raise ValueError(f"update: token_ids[{i}] must be >= 0, got {tokens[j]}")
            rows[i] = tokens
        return rows


@dataclasses.dataclass(frozen=True)
class PrefillInputs:
    """The prefill rows of a step, as every rank runs them (:meth:`ModelRunner._run_prefill`).

    Attributes:
        seq_ids, num_new_tokens, seq_lens, partial: the :class:`ScheduledBatch`'s, of its prefill rows.
        token_ids: the prefill rows' input tokens, sequence after sequence (``sum(num_new_tokens)`` of them).
        num_verifies: the leading rows that are verify rows (lossless requests): their logits are every position's.
        in_flight: ``(index in token_ids, row of the step before's sampled tokens)`` of each input token still in
            flight (a verify row's last draft, launched just before: its id in ``token_ids`` is a placeholder).
    """

    seq_ids: tuple[int, ...]
    num_new_tokens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    partial: bool
    token_ids: list[int]
    num_verifies: int = 0
    in_flight: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class StepMessage:
    """What rank 0 sends the other ranks for one step (tensor parallelism), before it runs the step itself.

    Attributes:
        pages: ``(seq_id, start, pages, seq_len)`` for every sequence whose page-table row changed since the last
            message (:meth:`~questkv.cache.paged.PagedKVCache.mirror`): the whole row on its prefill, new pages after.
        prefill: the step's prefill rows, or ``None`` (a decode-only step).
        decode: the step's decode rows: the packed decode inputs ``[NUM_INPUTS, padded]``
            (:data:`questkv.engine.model_runner.NUM_INPUTS`) int64 (a numpy array: it pickles in ~10 µs, a tensor in
            ~70) and the graph key, or ``None``. Both set: a mixed step.
        count: the tokens the step samples (broadcast from rank 0; none for a step that only prefills part of a
            prompt): one per sampling sequence, ``num_new_tokens`` per verify row.
        rows: the step's sampling rows; with verify rows, rank 0 then broadcasts each one's next input token and
            the drafts it kept, ``[2, rows]`` int64 (``StepTokens._next_inputs``).
        capture: prepare the startup (``graph_capture="startup"``: every decode graph, then the prefill launches;
            :meth:`~questkv.engine.model_runner.ModelRunner.prepare_startup`), nothing else.
        verify: a step of aligned lossless verify rows (:meth:`ModelRunner._run_verify`'s arguments), or ``None``.
        bounds: ``(pages, counts)`` whose key bounds rank 0 recomputed since its last message (lossless rewinds,
            :meth:`~questkv.cache.paged.PagedKVCache.recompute_bounds`), done first.
    """

    pages: tuple[tuple[int, int, list[int], int], ...]
    prefill: Optional[PrefillInputs] = None
    decode: Optional[tuple[np.ndarray, GraphKey]] = None
    count: int = 0
    rows: int = 0
    capture: bool = False
    verify: Optional[tuple[np.ndarray, GraphKey, tuple[int, ...]]] = None
    bounds: tuple[list[int], list[int]] = ([], [])


@dataclasses.dataclass(frozen=True)
class StepLogprobs:
    """The log-probabilities of a step's output tokens, on the host (pinned on CUDA), one row per sampled token
    (row after row of the batch, a verify row's ``num_new_tokens``), computed for a step with a row that asks for
    them (``SamplingParams.logprobs``) or is at a forced output.

    Attributes:
        outputs: ``[n]`` int64, each row's output token: the forced token at a forced output, else the sampled one.
        chosen: ``[n]`` float32, its log-probability (``log_softmax`` of the float32 logits).
        rank: ``[n]`` int64, 1 plus the tokens strictly more likely.
        top_ids, top_logprobs: ``[n, N]`` int64 and float32, the ``N`` most likely tokens and theirs, most likely
            first (``N``: the most any row asks for, possibly 0).
    """

    outputs: torch.Tensor
    chosen: torch.Tensor
    rank: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


@dataclasses.dataclass(frozen=True)
class SampledTokens:
    """The tokens one launched step samples: a host copy in flight and the event that completes it.

    Attributes:
        host: ``[n]`` int64 on the host (pinned on CUDA), one per sampled token, valid once ``done`` has completed.
        done: the CUDA event recorded after the copies, ``None`` on CPU (the copies are already done).
        logprobs: their :class:`StepLogprobs`, valid once ``done`` has completed; ``None`` when no row of the step
            asks for log-probabilities or is at a forced output.
    """

    host: torch.Tensor
    done: Optional[torch.cuda.Event]
    logprobs: Optional[StepLogprobs] = None

    def token_ids(self) -> list[int]:
        """Wait for the step and return its tokens, in batch order."""
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()

    def logprobs_by_row(self, batch: ScheduledBatch) -> Optional[list[list[dict[int, Logprob]]]]:
        """Wait for the step and return, per sampling row of ``batch`` and per token it sampled, the output token's
        :class:`Logprob` and those of the row's ``SamplingParams.logprobs`` most likely tokens, as a dict from token
        id (the output token first; the output token's alone for a row that asks for none: a forced output's
        log-probability is read from it). ``None`` without :attr:`logprobs`."""
        if self.logprobs is None:
            return None
        if self.done is not None:
            self.done.synchronize()
        step = self.logprobs
        outputs, chosen, rank = step.outputs.tolist(), step.chosen.tolist(), step.rank.tolist()
        top_ids, top_logprobs = step.top_ids.tolist(), step.top_logprobs.tolist()
        rows, at = [], 0
        for row, seq in enumerate(batch.seqs[:batch.num_sampled]):
            tokens = []
            for t in range(at, at + batch.num_sampled_tokens(row)):
                entry = {outputs[t]: Logprob(chosen[t], rank[t])}
                for j in range(seq.sampling_params.logprobs or 0):
                    entry.setdefault(top_ids[t][j], Logprob(top_logprobs[t][j], j + 1))
                tokens.append(entry)
            rows.append(tokens)
            at += batch.num_sampled_tokens(row)
        return rows
