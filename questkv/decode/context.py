"""Per-step metadata that the runner hands to every layer of the model (no module-level state).

A :class:`StepContext` says where the step's new tokens go in the page pool and what each sequence attends: its
leading decode rows (:class:`DecodeRows`, one token each, or a verify step's few) and its prefill rows after them
(:class:`PrefillRows`), either part possibly absent. A decode-only step is what a CUDA graph captures; a step with prefill rows runs
eagerly, decode rows included (a mixed step of chunked prefill). The runner builds one per step (on CUDA, decode
rows hold the static buffers of a captured graph); :meth:`StepContext.for_prefill` and
:meth:`StepContext.for_decode` build eager ones straight from a :class:`~questkv.cache.paged.PagedKVCache` (tests,
the CPU path).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from questkv.cache.paged import PagedKVCache
from questkv.decode.selection_memory import ReuseRows
from questkv.decode.step import QuestDecodeStep


@dataclasses.dataclass(slots=True)
class DecodeRows:
    """The decode rows of a step: one new token per sequence (or ``num_queries``, a lossless verify step's), the
    step's leading tokens.

    Attributes:
        page_table: ``[batch, max_pages]`` int32, the sequences' pages.
        seq_lens: ``[batch]`` int32, tokens per sequence with the new one, ``>= 1`` in every row (padding rows of a
            captured batch too).
        step: the step object whose buffers every layer's decode attention uses in turn (dense layers call
            ``.dense``, sparse layers ``.sparse``), built for ``batch`` rows.
        budgets: ``[batch]`` int32 token budget of each sequence for sparse layers, or ``None`` for the step's
            configured budget.
        reuse: selection reuse: the rows that select in this step and every sparse layer's selections (sparse
            layer ``i``, the model's layer ``dense_layers + i``, reads ``reuse.selected[i]``); ``None``: every row
            selects.
        dense: every row of the step decodes densely (:class:`~questkv.decode.route.StepRoute` ``DENSE``): sparse
            layers attend every page too (``step`` is a dense one).
        num_queries: new tokens per sequence, each sequence's in a run, attending the cache and, causally, each
            other (``step`` built for as many; more than one: a verify step, ``dense``).
    """

    page_table: torch.Tensor
    seq_lens: torch.Tensor
    step: QuestDecodeStep
    budgets: Optional[torch.Tensor] = None
    reuse: Optional[ReuseRows] = None
    dense: bool = False
    num_queries: int = 1

    @property
    def num_tokens(self) -> int:
        """The decode rows' tokens, ``num_queries`` per row (a shape: no device read)."""
        return self.seq_lens.shape[0] * self.num_queries


@dataclasses.dataclass(slots=True)
class PrefillRows:
    """The prefill rows of a step: every sequence brings its tokens (prompt, or prompt and generated tokens when a
    preempted sequence is recomputed) past its ``cached_lens``, all of them or the next chunk.

    Attributes:
        page_table: ``[batch, max_pages]`` int32, the sequences' pages.
        seq_lens: ``[batch]`` int32, tokens per sequence with the new ones.
        query_starts: ``batch + 1`` host ints: sequence ``i``'s tokens are ``[query_starts[i], query_starts[i + 1])``
            of the prefill rows' tokens (counted from the first prefill token, after any decode rows).
        cached_lens: ``batch`` host ints, the tokens each sequence already holds in the pool before its new ones
            (whole shared pages of the prefix cache, its earlier chunks of a chunked prefill), whose K/V its new
            tokens attend too; ``None``: every sequence starts empty.
        query_starts_on_device: ``query_starts`` as a ``[batch + 1]`` int32 tensor on the step's device, copied
            once by :meth:`query_starts_tensor` (``None`` until then).
    """

    page_table: torch.Tensor
    seq_lens: torch.Tensor
    query_starts: list[int]
    cached_lens: Optional[list[int]] = None
    query_starts_on_device: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)

    def query_starts_tensor(self) -> torch.Tensor:
        """``query_starts`` as a ``[batch + 1]`` int32 tensor on the step's device, copied once per step and
        shared by every layer (the paged prefill attention's input)."""
        if self.query_starts_on_device is None:
            starts = torch.tensor(self.query_starts, dtype=torch.int32)
            self.query_starts_on_device = starts.to(self.page_table.device, non_blocking=True)
        return self.query_starts_on_device


@dataclasses.dataclass(slots=True)
class StepContext:
    """What one forward step of the engine's model reads.

    Attributes:
        slots: ``[num_tokens]`` int64, ``page * page_size + offset`` of every new token in the flat token order
            of the step's ``input_ids``: the decode rows' tokens first, then the prefill rows', sequence after
            sequence.
        decode: the leading decode rows, or ``None``.
        prefill: the prefill rows after them, or ``None``.
    """

    slots: torch.Tensor
    decode: Optional[DecodeRows] = None
    prefill: Optional[PrefillRows] = None

    @classmethod
    def for_prefill(cls, cache: PagedKVCache, seq_ids: Sequence[int],
                    num_new_tokens: Sequence[int]) -> "StepContext":
        """Reserve the pages of ``num_new_tokens[i]`` tokens for every (empty) sequence
        ``seq_ids[i]`` and describe the prefill step that writes them."""
        for seq_id in seq_ids:
            if cache.seq_len(seq_id) != 0:
                raise ValueError(f"prefill starts a sequence: sequence {seq_id} already holds {cache.seq_len(seq_id)} tokens")
        if any(n < 1 for n in num_new_tokens):
            raise ValueError(f"prefill needs >= 1 token per sequence, got {list(num_new_tokens)}")
        slots = cache.reserve(seq_ids, num_new_tokens)
        page_table, seq_lens = cache.batch(seq_ids)
        starts = [0]
        for n in num_new_tokens:
            starts.append(starts[-1] + n)
        return cls(slots, prefill=PrefillRows(page_table, seq_lens, starts))

    @classmethod
    def for_decode(
        cls,
        cache: PagedKVCache,
        seq_ids: Sequence[int],
        decode_step: QuestDecodeStep,
        budgets: Optional[torch.Tensor] = None,
    ) -> "StepContext":
        """Reserve one slot per sequence and describe a decode step over ``decode_step``'s buffers
        (built for ``len(seq_ids)`` sequences and at least the batch's page count)."""
        slots = cache.reserve(seq_ids, [1] * len(seq_ids))
        page_table, seq_lens = cache.batch(seq_ids, max_pages=decode_step.max_pages)
        return cls(slots, decode=DecodeRows(page_table, seq_lens, decode_step, budgets))
