"""What one engine step takes and gives besides its :class:`~questkv.engine.scheduled_batch.ScheduledBatch`: the
prefill rows every rank runs, rank 0's message to the other ranks (tensor parallelism), and the sampled tokens in
flight."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from questkv.engine.cuda_graphs import GraphKey

__all__ = ["PrefillInputs", "SampledTokens", "StepMessage"]


@dataclasses.dataclass(frozen=True)
class PrefillInputs:
    """The prefill rows of a step, as every rank runs them (:meth:`ModelRunner._run_prefill`).

    Attributes:
        seq_ids, num_new_tokens, seq_lens, partial: the :class:`ScheduledBatch`'s, of its prefill rows.
        token_ids: the prefill rows' input tokens, sequence after sequence (``sum(num_new_tokens)`` of them).
        num_verifies: the leading rows that are verify rows (lossless requests): their logits are every position's.
    """

    seq_ids: tuple[int, ...]
    num_new_tokens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    partial: bool
    token_ids: list[int]
    num_verifies: int = 0


@dataclasses.dataclass(frozen=True)
class StepMessage:
    """What rank 0 sends the other ranks for one step (tensor parallelism), before it runs the step itself.

    Attributes:
        pages: ``(seq_id, start, pages, seq_len)`` for every sequence whose page-table row changed since the last
            message (:meth:`~questkv.cache.paged.PagedKVCache.mirror`): the whole row on its prefill, new pages after.
        prefill: the step's prefill rows, or ``None`` (a decode-only step).
        decode: the step's decode rows: the packed decode inputs ``[NUM_INPUTS, padded]`` (:data:`questkv.engine.model_runner.NUM_INPUTS`) int64 (a numpy array: it
            pickles in ~10 µs, a tensor in ~70) and the graph key, or ``None``. Both set: a mixed step.
        count: the tokens the step samples (broadcast from rank 0; none for a step that only prefills part of a
            prompt): one per sampling sequence, ``num_new_tokens`` per verify row.
        capture: capture every decode graph (``graph_capture="startup"``), nothing else.
        verify: a step of aligned lossless verify rows (:meth:`ModelRunner._run_verify`'s arguments), or ``None``.
        bounds: ``(pages, counts)`` whose key bounds rank 0 recomputed since its last message (lossless rewinds,
            :meth:`~questkv.cache.paged.PagedKVCache.recompute_bounds`), done first.
    """

    pages: tuple[tuple[int, int, list[int], int], ...]
    prefill: Optional[PrefillInputs] = None
    decode: Optional[tuple[np.ndarray, GraphKey]] = None
    count: int = 0
    capture: bool = False
    verify: Optional[tuple[np.ndarray, GraphKey, tuple[int, ...]]] = None
    bounds: tuple[list[int], list[int]] = ([], [])


@dataclasses.dataclass(frozen=True)
class SampledTokens:
    """The tokens one launched step samples: a host copy in flight and the event that completes it.

    Attributes:
        host: ``[batch]`` int64 on the host (pinned on CUDA), valid once ``done`` has completed.
        done: the CUDA event recorded after the copies, ``None`` on CPU (the copies are already done).
        logprobs: ``[batch]`` float32 on the host (pinned on CUDA), each row's log-probability of its forced
            token (``SamplingParams.forced_token_ids``; rows without one hold junk), valid once ``done`` has
            completed; ``None`` when no row of the step is at a forced output.
    """

    host: torch.Tensor
    done: Optional[torch.cuda.Event]
    logprobs: Optional[torch.Tensor] = None

    def token_ids(self) -> list[int]:
        """Wait for the step and return its tokens, in batch order."""
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()

    def forced_logprobs(self) -> Optional[list[float]]:
        """Wait for the step and return :attr:`logprobs` as a list (``None`` without forced rows)."""
        if self.logprobs is None:
            return None
        if self.done is not None:
            self.done.synchronize()
        return self.logprobs.tolist()
