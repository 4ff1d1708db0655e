"""Triton kernels of the Quest ops, with the reference ops' signatures (see :mod:`questkv.ops`).

Each public op allocates its output and launches; the ``*_into`` variants write into
preallocated buffers with no host synchronisation, for :class:`questkv.decode.QuestDecodeStep`
and CUDA graphs. Layouts: :mod:`questkv.ops.reference`.
"""

from questkv.ops.triton.append import append_kv, rope_append_kv
from questkv.ops.triton.decode_attention import (
    attention_buffers,
    paged_decode_attention,
    paged_decode_attention_into,
    plan_splits,
)
from questkv.ops.triton.elementwise import rms_norm, silu_and_mul
from questkv.ops.triton.estimate import page_scores, page_scores_into
from questkv.ops.triton.gemv import linear
from questkv.ops.triton.prefill_attention import compile_prefill_launches, paged_prefill_attention
from questkv.ops.triton.reuse import gather_selections, store_selections
from questkv.ops.triton.select import select_buffers, select_pages, select_pages_into

__all__ = [
    "append_kv",
    "attention_buffers",
    "compile_prefill_launches",
    "gather_selections",
    "linear",
    "page_scores",
    "page_scores_into",
    "paged_decode_attention",
    "paged_decode_attention_into",
    "paged_prefill_attention",
    "plan_splits",
    "rms_norm",
    "rope_append_kv",
    "select_buffers",
    "select_pages",
    "select_pages_into",
    "silu_and_mul",
    "store_selections",
]
