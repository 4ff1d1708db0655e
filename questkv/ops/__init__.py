"""Quest ops (and the decode step's dense linear layer, RMSNorm and gated activation) behind one dispatch point.

Every op has a torch reference (:mod:`questkv.ops.reference`) and, for CUDA tensors, a Triton
kernel with the same signature. ``backend="auto"`` picks the kernel for CUDA tensors and the
reference otherwise; ``"torch"`` and ``"triton"`` force one. Layouts are documented in
:mod:`questkv.ops.reference`; the quantized linear ops' references and formats are in
:mod:`questkv.ops.quant_reference`, their CUDA twins in :mod:`questkv.ops.triton.quant_ops`.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from questkv.config import BACKENDS
from questkv.ops import quant_reference, reference, reuse_reference
from questkv.ops.pages import LayerPages
from questkv.ops.reference import to_pool_dtype

__all__ = [
    "LayerPages",
    "append_kv",
    "gather_selections",
    "int4_matmul",
    "linear",
    "page_scores",
    "select_pages",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prepare_int4_matmul",
    "prepare_paged_prefill_attention",
    "quant_matmul",
    "recompute_key_bounds",
    "resolve_backend",
    "rms_norm",
    "rope_append_kv",
    "silu_and_mul",
    "store_selections",
    "to_pool_dtype",
]


@functools.lru_cache(maxsize=None)
def _triton_module() -> ModuleType:
    try:
        return importlib.import_module("questkv.ops.triton")
    except ImportError as error:
        raise RuntimeError(f"backend='triton' needs the triton package: {error}") from error


def resolve_backend(tensor: torch.Tensor, backend: str = "auto") -> ModuleType:
    """The module (reference or Triton) that runs an op on ``tensor`` under ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and not tensor.is_cuda):
        return reference
    if backend == "auto":
        try:
            return _triton_module()
        except RuntimeError:
            return reference
    return _triton_module()


def append_kv(k_pages, v_pages, kmin, kmax, slots, keys, values, backend: str = "auto") -> None:
    """See :func:`questkv.ops.reference.append_kv`."""
    resolve_backend(k_pages, backend).append_kv(k_pages, v_pages, kmin, kmax, slots, keys, values)


def rope_append_kv(k_pages, v_pages, kmin, kmax, slots, q, keys, values, cos, sin, backend: str = "auto") -> None:
    """See :func:`questkv.ops.reference.rope_append_kv`."""
    resolve_backend(k_pages, backend).rope_append_kv(k_pages, v_pages, kmin, kmax, slots, q, keys, values, cos, sin)


def recompute_key_bounds(k_pages, kmin, kmax, pages, counts) -> None:
    """:func:`questkv.ops.reference.recompute_key_bounds` (torch on every device: a few pages per verify step)."""
    reference.recompute_key_bounds(k_pages, kmin, kmax, pages, counts)


def linear(x, weight, bias=None, backend: str = "auto"):
    """See :func:`questkv.ops.reference.linear` (on CUDA, one row through a GEMV: :mod:`questkv.ops.triton.gemv`)."""
    return resolve_backend(x, backend).linear(x, weight, bias)


def rms_norm(x, weight, eps, residual=None, backend: str = "auto"):
    """See :func:`questkv.ops.reference.rms_norm`."""
    return resolve_backend(x, backend).rms_norm(x, weight, eps, residual)


def silu_and_mul(x, backend: str = "auto"):
    """See :func:`questkv.ops.reference.silu_and_mul`."""
    return resolve_backend(x, backend).silu_and_mul(x)


def page_scores(q, kmin, kmax, page_table, seq_lens, page_size, selection="kv_head", group_reduction="sum", backend="auto"):
    """See :func:`questkv.ops.reference.page_scores`."""
    return resolve_backend(q, backend).page_scores(
        q, kmin, kmax, page_table, seq_lens, page_size, selection, group_reduction
    )


def select_pages(scores, seq_lens, page_size, budget_pages, sink_pages=0, recent_pages=0, budgets=None, backend="auto"):
    """See :func:`questkv.ops.reference.select_pages`."""
    return resolve_backend(scores, backend).select_pages(
        scores, seq_lens, page_size, budget_pages, sink_pages, recent_pages, budgets
    )


def paged_decode_attention(q, k_pages, v_pages, page_table, seq_lens, selected=None, sm_scale=None, budgets=None,
                           selection_cols=None, backend="auto"):
    """See :func:`questkv.ops.reference.paged_decode_attention`."""
    return resolve_backend(q, backend).paged_decode_attention(
        q, k_pages, v_pages, page_table, seq_lens, selected, sm_scale, budgets, selection_cols
    )


def paged_prefill_attention(q, k_pages, v_pages, page_table, query_starts, seq_lens, max_query_len=None, sm_scale=None,
                            backend="auto"):
    """See :func:`questkv.ops.reference.paged_prefill_attention`."""
    return resolve_backend(q, backend).paged_prefill_attention(
        q, k_pages, v_pages, page_table, query_starts, seq_lens, max_query_len, sm_scale
    )


def prepare_paged_prefill_attention(q_dtype, num_q_heads, k_pages, v_pages, table_width, backend="auto") -> int:
    """Make :func:`paged_prefill_attention` over these pools ready before its first call: the Triton kernel
    compiles every launch configuration a prefill can take (:func:`questkv.ops.triton.compile_prefill_launches`),
    the reference needs nothing. Returns the launches run."""
    if resolve_backend(k_pages, backend) is reference:
        return 0
    return _triton_module().compile_prefill_launches(q_dtype, num_q_heads, k_pages, v_pages, table_width)


def gather_selections(pages, selected_at, slots, due, seq_lens, page_size, budget_pages, backend="auto"):
    """See :func:`questkv.ops.reuse_reference.gather_selections` (selection reuse)."""
    return _reuse_module(pages, backend).gather_selections(
        pages, selected_at, slots, due, seq_lens, page_size, budget_pages
    )


def store_selections(pages, selected_at, counters, slots, rows, backend="auto") -> None:
    """See :func:`questkv.ops.reuse_reference.store_selections` (selection reuse)."""
    _reuse_module(pages, backend).store_selections(pages, selected_at, counters, slots, rows)


def _reuse_module(tensor: torch.Tensor, backend: str) -> ModuleType:
    """The module (:mod:`~questkv.ops.reuse_reference` or :mod:`questkv.ops.triton`) that runs a selection memory
    op on ``tensor`` under ``backend``."""
    module = resolve_backend(tensor, backend)
    return reuse_reference if module is reference else module


def _quant_module(tensor: torch.Tensor, backend: str) -> ModuleType:
    """The module (:mod:`~questkv.ops.quant_reference` or :mod:`questkv.ops.triton.quant_ops`) that runs a quantized
    linear op on ``tensor`` under ``backend``."""
    if resolve_backend(tensor, backend) is reference:
        return quant_reference
    return _triton_quant_ops()


@functools.lru_cache(maxsize=None)
def _triton_quant_ops() -> ModuleType:
    return importlib.import_module("questkv.ops.triton.quant_ops")


def quant_matmul(x, qweight, scales, zeros, method, group_size=128, bias=None, backend="auto"):
    """See :func:`questkv.ops.quant_reference.quant_matmul` (on CUDA ``int8`` and ``int8_grouped``, by rows:
    :func:`questkv.ops.triton.quant_ops.quant_matmul`)."""
    return _quant_module(x, backend).quant_matmul(x, qweight, scales, zeros, method, group_size, bias)


def int4_matmul(x, words, scales, zeros, group_size=128, bias=None, backend="auto"):
    """See :func:`questkv.ops.quant_reference.int4_matmul` (on CUDA by rows:
    :func:`questkv.ops.triton.quant_ops.int4_matmul`)."""
    return _quant_module(x, backend).int4_matmul(x, words, scales, zeros, group_size, bias)


def prepare_int4_matmul(device: torch.device) -> None:
    """Make :func:`int4_matmul`'s kernels ready on ``device`` before their first call (CUDA: build or load the
    tensor-core kernel's extension, :mod:`questkv.ops.cuda.int4_mma`; elsewhere nothing). Call it outside CUDA
    graph capture."""
    if device.type == "cuda":
        _triton_quant_ops().prepare_int4_matmul(device)
