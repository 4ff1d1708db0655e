"""Helpers shared by the Quest Triton kernels and their launchers."""

from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

_DEFAULT_SMS = 132  # an H100/H200; the split heuristic's choice on a CPU (interpreter) run

# Programmatic dependent launch (sm_90+): each Quest kernel is launched so that it may start while the
# kernel before it in the stream finishes, and waits (``griddepcontrol.wait``) before its first read of
# memory that earlier kernels wrote. On by default: on the H200 it matched the reference in every check and
# made the step faster at every point of benchmarks/results/kernels-h200.md (there, with PDL off, the
# 'PDL switched' column). Module state so that a benchmark can time both settings; the environment
# variable QUESTKV_PDL ("1" or "0", read at import) sets it for a whole process.
def _pdl_from_env() -> bool:
    value = os.environ.get("QUESTKV_PDL", "1")
    if value not in ("0", "1"):
        raise ValueError(f"QUESTKV_PDL must be '0' or '1', got {value!r}")
    return value == "1"


PDL = _pdl_from_env()


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``).

    The kernels then upcast their ``tl.dot`` operands to float32: the interpreter's bf16 dot
    multiplies the raw 16-bit patterns. On a GPU the operands stay in their dtype.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_pdl(device: torch.device) -> bool:
    """Whether launches on ``device`` use programmatic dependent launch: :data:`PDL`, on a CUDA GPU of
    compute capability 9.0 or newer, never under the interpreter."""
    return PDL and device.type == "cuda" and not interpreting() and _capability(device) >= (9, 0)


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device) -> tuple[int, int]:
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


def next_pow2(value: int) -> int:
    return triton.next_power_of_2(max(int(value), 1))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (132 for a CPU tensor: the split heuristic's target)."""
    if device.type != "cuda":
        return _DEFAULT_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def check_shape(name: str, tensor: torch.Tensor, shape: tuple) -> None:
    """Raise ``ValueError`` unless ``tensor.shape == shape``."""
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """Kernels index the innermost dimension with stride 1; raise ``ValueError`` otherwise."""
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tensor.stride()}")


@triton.jit
def block_scores(q, k, qk_scale, IEEE: tl.constexpr):
    """``q`` ``[M, D]`` times the key block ``k`` ``[N, D]``, scaled: ``[M, N]`` float32 logits (log2 domain with a
    ``qk_scale`` holding log2(e)). ``IEEE``: float32 inputs keep a float32 product (a TF32 dot would cost ~1e-3
    relative error)."""
    if IEEE:
        return tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    return tl.dot(q, tl.trans(k)) * qk_scale


def check_e4m3_pairs(v_pages: torch.Tensor) -> None:
    """An fp8 value pool is read in pairs of channels (:func:`load_e4m3_as_f16`): raise ``ValueError`` unless its
    rows start at even offsets and hold an even number of channels."""
    if v_pages.dtype == torch.float8_e4m3fn and any(n % 2 for n in (*v_pages.stride()[:3], v_pages.shape[-1])):
        raise ValueError(f"fp8 v_pages must have an even head_dim and even strides, got shape {tuple(v_pages.shape)} "
                         f"and strides {v_pages.stride()}")


@triton.jit
def load_e4m3_as_f16(pages_ptr, rows, live, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The e4m3 rows ``rows`` ``[N, 1]`` (element offsets into ``pages_ptr``, even; ``live`` ``[N]``, else zeros)
    as float16 ``[N, BLOCK_D]``, loaded as pairs (int16) and converted by ``cvt.rn.f16x2.e4m3x2``. The
    conversion's inputs are then what the loop pipeline stages in shared memory: a plain float8 load that feeds
    ``tl.dot``'s value operand is staged as bytes and read back one byte per instruction (``LDS.U8``: the operand
    wants consecutive keys, the page consecutive channels), where float16 values take ``ldmatrix.trans``."""
    pair = tl.arange(0, BLOCK_D // 2)
    words = tl.load(pages_ptr.to(tl.pointer_type(tl.int16)) + rows // 2 + pair[None, :],
                    mask=live[:, None] & (pair < HEAD_DIM // 2)[None, :], other=0)
    low, high = tl.inline_asm_elementwise(
        "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }", "=h,=h,h", [words],
        dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    return tl.reshape(tl.join(low, high), (words.shape[0], BLOCK_D))


@triton.jit
def round_e4m3(x):
    """``x`` rounded to the nearest float8 e4m3fn value (ties to even, saturating at ±448 as torch's cast does), as
    float32; integer and exact float32 arithmetic only (no float8 cast: the interpreter rounds those wrongly)."""
    x = x.to(tl.float32)
    a = tl.minimum(tl.abs(x), 448.0)
    biased = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF  # float32 exponent field (0 for 0 and subnormals)
    step = tl.maximum(biased, 121) - 3  # e4m3's spacing there: 2 ** (max(e, -6) - 3), as a biased exponent
    y = a * ((254 - step) << 23).to(tl.float32, bitcast=True)  # a / spacing, exact: in [0, 16)
    n = y.to(tl.int32)
    frac = y - n.to(tl.float32)
    n += ((frac > 0.5) | ((frac == 0.5) & ((n & 1) == 1))).to(tl.int32)
    r = n.to(tl.float32) * (step << 23).to(tl.float32, bitcast=True)  # the rounded magnitude, exact
    return tl.where(x < 0, -r, r)


@triton.jit
def split_query_e4m3(q, high, HARDWARE: tl.constexpr):
    """Rows of ``q`` ``[M, D]`` as e4m3 for tensor-core dots with e4m3 keys, in two parts: a row where ``high``
    ``[M]`` holds ``hi``, the others ``lo``, with ``q ~= (hi + lo / 16) * scale`` per row; each row is scaled so that
    its largest component is e4m3's largest finite value (448), ``hi`` holds 4 significant bits of every component
    and ``lo`` the next 4 (``hi``'s rounding residual times 16): together about bfloat16's 8. Returns the rows
    ``[M, D]`` (float8e4nv rounded by the hardware with ``HARDWARE``, else float32 by :func:`round_e4m3`) and the
    factor ``[M]`` float32 that turns a row's dot into its part of the score (``scale``, or ``scale / 16`` for
    ``lo``; 1 for a row of zeros)."""
    qf = q.to(tl.float32)
    amax = tl.max(tl.abs(qf), axis=1)
    up = 448.0 / tl.where(amax > 0, amax, 448.0)
    qs = qf * up[:, None]
    if HARDWARE:
        hi = qs.to(tl.float8e4nv)
        lo = ((qs - hi.to(tl.float32)) * 16.0).to(tl.float8e4nv)
    else:
        hi = round_e4m3(qs)
        lo = round_e4m3((qs - hi) * 16.0)
    return tl.where(high[:, None], hi, lo), tl.where(high, 1.0, 0.0625) / up


@triton.jit
def online_softmax_step(s, v, acc, m_i, l_i, IEEE: tl.constexpr):
    """One key block of a flash-attention online softmax in base 2: scores ``s`` ``[M, N]`` float32 (log2 domain,
    ``-inf`` where masked) and values ``v`` ``[N, D]`` update the running ``acc`` ``[M, D]``, row maximum ``m_i``
    and row sum ``l_i`` ``[M]`` (float32; ``m_i`` starts at ``-inf``, so a row with no live key so far stays
    empty). ``IEEE``: float32 values, an exact float32 product. Returns ``(acc, m_new, l_i)``."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def last_to_arrive(counter, programs):
    """Take a ticket on ``counter`` (an int32 that is zero before the launch): true in the one program of
    ``programs`` that arrives last. A CTA barrier first makes every thread's stores precede the ticket, and the
    ``acq_rel`` atomic makes every other program's stores visible to the last one, which may then read them
    (a split reduction's partials). That program hands the counter back with :func:`reset_ticket`."""
    tl.debug_barrier()
    return tl.atomic_add(counter, 1, sem="acq_rel") == programs - 1


@triton.jit
def reset_ticket(counter):
    """Zero a counter of :func:`last_to_arrive` for the next launch (graph replays need no memset)."""
    tl.atomic_xchg(counter, 0)


@triton.jit
def sum_split_partials(part_ptr, split_stride, rn, nmask, splits, REDUCE_CHUNK: tl.constexpr):
    """Sum over ``splits`` float32 partials ``part_ptr + s * split_stride + rn`` (``rn`` ``[BLOCK_N]``, masked by
    ``nmask``) in fixed chunks of ``REDUCE_CHUNK`` splits, in split order (deterministic), each chunk's loads issued
    together and read past L1 (other programs wrote them)."""
    c = tl.arange(0, REDUCE_CHUNK)
    acc = tl.zeros([rn.shape[0]], dtype=tl.float32)
    for first in range(0, splits, REDUCE_CHUNK):
        sp = first + c
        parts = tl.load(part_ptr + sp[:, None] * split_stride + rn[None, :],
                        mask=(sp < splits)[:, None] & nmask[None, :], other=0.0, cache_modifier=".cg")
        acc += tl.sum(parts, axis=0)
    return acc


_TICKETS: dict[torch.device, torch.Tensor] = {}


def ticket_counters(device: torch.device, size: int) -> torch.Tensor:
    """The device's zeroed int32 tickets for :func:`last_to_arrive`, at least ``size`` of them, shared by every
    split kernel's launches (each launch leaves them zero): launches must not run concurrently on two streams."""
    counters = _TICKETS.get(device)
    if counters is None or counters.numel() < size:
        counters = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
        _TICKETS[device] = counters
    return counters


def split_reduction(units: int, requested: int, out: torch.Tensor, tiles: int, placeholder: Optional[torch.Tensor]
                    ) -> tuple[int, int, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The reduction's ``units`` (groups, K steps) over at most ``requested`` blocks per output tile, none empty:
    ``(per_split, split, part, counters)``, with float32 partials ``[split, M, N]`` for ``out`` ``[M, N]`` and the
    tickets of ``tiles`` output tiles (:func:`ticket_counters`) when ``split > 1``, else ``placeholder`` for both
    (never read)."""
    per_split = math.ceil(units / requested)
    split = math.ceil(units / per_split)
    if split == 1:
        return per_split, split, placeholder, placeholder
    part = torch.empty((split, *out.shape), dtype=torch.float32, device=out.device)
    return per_split, split, part, ticket_counters(out.device, tiles)
