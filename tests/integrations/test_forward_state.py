"""ForwardState: the frozen per-forward view of the page pool that every layer of a forward reads."""

import dataclasses

import pytest
import torch

from questkv.integrations.forward_state import ForwardState


def state(new_token_mask: torch.Tensor, past_positions: int, stored_slots=None) -> ForwardState:
    batch = new_token_mask.shape[0]
    rows = new_token_mask.flatten().nonzero().squeeze(1)
    slots = torch.randperm(64)[: rows.numel()]
    page_table = torch.zeros(batch, 4, dtype=torch.int32)
    seq_lens = torch.full((batch,), 5, dtype=torch.int32)
    return ForwardState(new_token_mask, rows, slots, page_table, seq_lens, past_positions, stored_slots)


def test_one_new_position_over_a_non_empty_cache_is_a_decode_step():
    mask = torch.rand(3, 1) < 2  # all real
    decode = state(mask, past_positions=7)
    assert decode.is_decode and not decode.reads_dense_kv and decode.new_positions == 1
    first = state(mask, past_positions=0)  # a one-token prompt on an empty cache is a prefill
    assert not first.is_decode and not first.reads_dense_kv


def test_a_chunk_over_a_non_empty_cache_reads_every_stored_token():
    mask = torch.rand(2, 5) < 0.7
    mask[:, -1] = True
    with pytest.raises(ValueError, match="ForwardState.stored_slots is required"):
        state(mask, past_positions=3)
    chunk = state(mask, past_positions=3, stored_slots=torch.arange(11))
    assert chunk.reads_dense_kv and not chunk.is_decode and chunk.new_positions == 5
    prefill = state(mask, past_positions=0)
    assert not prefill.reads_dense_kv and not prefill.is_decode


def test_a_forward_state_is_frozen():
    forward = state(torch.ones(2, 1, dtype=torch.bool), past_positions=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        forward.past_positions = 5
