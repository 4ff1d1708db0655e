"""What one forward pass over a padded batch writes to, and reads from, the page pool.

The HF drop-in (:class:`~questkv.integrations.hf.QuestCache`) counts positions as transformers
does (a left-padded batch has pad positions) but stores only the real tokens. At layer 0 of every
forward it works out, once, where the forward's real tokens go and what each layer then reads; the
result is a :class:`ForwardState`, frozen, so no layer changes what the next one reads. No
transformers here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class ForwardState:
    """One forward's view of the page pool, shared by all its layers.

    Attributes:
        new_token_mask: ``[batch, new_positions]`` bool, True where the new position holds a
            real (stored) token, False for padding.
        rows: ``[new stored tokens]`` int64, the flat ``batch * new_positions`` index of every
            real new token, sequence after sequence: it picks them out of a layer's new K/V.
        slots: ``[new stored tokens]`` int64, their slots (``page * page_size + offset``), in the
            same order (:meth:`PagedKVCache.reserve`).
        page_table: ``[batch, max_pages]`` int32; seq_lens: ``[batch]`` int32, stored tokens per
            sequence, the new ones included.
        past_positions: positions (pads included) every layer held before this forward.
        stored_slots: ``[stored tokens]`` int64, the slot of every stored token, sequence after
            sequence, in order; set only when :attr:`reads_dense_kv` (else ``None``).
        dense_rows: per sequence, whether a decode step of its length attends densely on Quest layers
            (:func:`~questkv.decode.route.decodes_densely`), or ``None`` without Quest.
    """

    new_token_mask: torch.Tensor
    rows: torch.Tensor
    slots: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    past_positions: int
    stored_slots: Optional[torch.Tensor] = None
    dense_rows: Optional[list[bool]] = None

    def __post_init__(self) -> None:
        if self.reads_dense_kv and self.stored_slots is None:
            raise ValueError(
                f"ForwardState.stored_slots is required for a forward of {self.new_positions} new positions over "
                f"{self.past_positions} past ones (its attention reads every stored token densely)"
            )

    @property
    def new_positions(self) -> int:
        return self.new_token_mask.shape[1]

    @property
    def is_decode(self) -> bool:
        """One new position over a non-empty cache: attention reads the pages (Quest or dense)."""
        return self.new_positions == 1 and self.past_positions > 0

    @property
    def reads_dense_kv(self) -> bool:
        """Several new positions over a non-empty cache (chunked prefill): attention is dense over
        every stored token, read back from the pages (see :meth:`needs_stored_slots`)."""
        return self.needs_stored_slots(self.new_positions, self.past_positions)

    @staticmethod
    def needs_stored_slots(new_positions: int, past_positions: int) -> bool:
        """Whether a forward of ``new_positions`` over ``past_positions`` reads every stored token."""
        return past_positions > 0 and new_positions != 1
