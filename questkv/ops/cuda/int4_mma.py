"""``int4`` times up to 32 rows of ``x`` on tensor cores: a CUDA C++ kernel (``int4_mma.cu``) over the K-major words
every ``int4`` kernel reads (:func:`~questkv.ops.quant_reference.pack_int4_k_major`: no second copy of the codes).

Why CUDA C++ and not Triton: a few rows are a memory-bound product whose codes must become tensor-core operands in
registers. ``mma.sync.m16n8k16`` takes the weight as its ``A`` operand, and a lane's 32-bit word of 8 nibbles of one
output is exactly what its ``A`` fragment needs from that output for two MMAs (the features' order inside an MMA is
free as long as ``x``'s ``B`` fragment follows it), so each word becomes two operand registers with one shift and
one ``lop3`` each and never leaves the registers. Triton chooses operand layouts itself: its kernel over the same
words (:mod:`questkv.ops.triton.int4_words`) converts every dequantized tile through shared memory, 3.1× its bytes
floor at 5 rows on an H100 (``benchmarks/results/linear-h100-words-m5.md``). How the kernel maps words, features and
outputs is in the ``.cu`` file's header.

Built at first use with :func:`torch.utils.cpp_extension.load` (nvcc and a C++ compiler needed then, once; the
build is cached under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``); never on a machine
without CUDA. :func:`available` says whether it loaded (a failed build warns once). Launched with programmatic
dependent launch where :func:`~questkv.ops.triton._common.use_pdl` allows it, as the Triton kernels are
(``benchmarks/results/linear-h100-mma-pdl.md`` against ``-nopdl.md``).

:func:`questkv.ops.int4_matmul` sends it 2 to :data:`MMA_MAX_M` rows where it is built
(:data:`~questkv.ops.triton.quant_ops.INT4_KERNELS`, from ``benchmarks/results/linear-h200-mma.md``); its
comparison with the torch reference on a GPU is ``tests/ops/test_cuda_int4_mma.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import warnings
from pathlib import Path
from types import ModuleType
from typing import Callable, Optional

import torch

from questkv.ops.quant_reference import check_int4_words

__all__ = ["MMA_MAX_M", "MMA_OUTPUTS", "Int4MmaConfig", "available", "check_product", "extension_for", "fits",
           "int4_mma", "max_warps", "plan_int4_mma"]

MMA_MAX_M = 32
"""Rows of ``x`` one launch takes (four MMA column tiles of 8)."""

MMA_GROUP = 128
"""The group size the kernel reads (its scales and zero points per 128 input features)."""

MMA_OUTPUTS = 64
"""Outputs per warp and per block: ``N`` must be a multiple."""

MMA_MAX_WARPS = 8
"""Warps per block at most (the kernel's launch bounds: 256 threads); 4 above 16 rows (:func:`max_warps`)."""

MMA_WARPS_PER_SM = ((8, 12), (MMA_MAX_M, 8))
"""``(most rows, warps per SM)``: :func:`plan_int4_mma`'s split aims at this many warps in flight per SM (fewer for
more rows: each warp then holds more accumulators and its split's partials cost more). 17 to 32 rows keep 8: of 2 to
12 per SM it gave the fastest token in the H100 sweep at 24 and 32 rows (``benchmarks/results/linear-mma32.md``)."""

_SOURCES = ("int4_mma.cu", "int4_gemv.cu", "int4_mma_binding.cpp")
_HEADERS = ("int4_common.cuh",)  # hashed into the build flags: torch rebuilds on a changed source or flag only


@dataclasses.dataclass(frozen=True)
class Int4MmaConfig:
    """One :func:`int4_mma` launch: ``warps`` per block (each takes whole groups of the block's 64 outputs),
    ``split`` blocks per 64 outputs (each a range of whole groups; the last to finish sums their partials)."""

    warps: int
    split: int


@functools.lru_cache(maxsize=None)
def _extension() -> Optional[ModuleType]:
    """The built extension, or ``None`` (with one warning) where it cannot be built or loaded."""
    logging.getLogger("questkv.ops").info("questkv: building or loading the int4 CUDA kernels (nvcc, about a minute "
                                          "the first time on a machine; cached in TORCH_EXTENSIONS_DIR)")
    try:
        from torch.utils.cpp_extension import load

        here = Path(__file__).parent
        headers = hashlib.sha256(b"".join((here / h).read_bytes() for h in _HEADERS)).hexdigest()[:16]
        return load(name="questkv_int4_mma", sources=[str(here / s) for s in _SOURCES],
                    extra_cuda_cflags=["-O3", f"-DQUESTKV_INT4_HEADERS={headers}"], extra_cflags=["-O3"],
                    verbose=False)
    except Exception as error:  # noqa: BLE001 - any build or load failure leaves the Triton kernels in place
        warnings.warn(f"questkv: the int4 CUDA kernels (questkv/ops/cuda/int4_mma.cu, int4_gemv.cu) could not be "
                      f"built ({type(error).__name__}: {error}); int4 layers use the Triton kernels for every row count",
                      RuntimeWarning, stacklevel=3)
        return None


def available(device: torch.device) -> bool:
    """Whether :func:`int4_mma` runs on ``device``: a CUDA GPU of compute capability 8.0 or newer (bf16 MMA) and the
    extension built (the first call builds it: about a minute, once per machine)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    return _extension() is not None


def fits(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> bool:
    """Whether :func:`int4_mma` takes this product: 1 to :data:`MMA_MAX_M` contiguous, 16-byte aligned rows of bf16
    or fp16 ``x``, scales in ``x``'s dtype and zero points in it or uint8, group 128, outputs a multiple of
    :data:`MMA_OUTPUTS` (:func:`available` is the device's question)."""
    return (x.dim() == 2 and 1 <= x.shape[0] <= MMA_MAX_M and x.dtype in (torch.bfloat16, torch.float16)
            and scales.dtype == x.dtype and zeros.dtype in (x.dtype, torch.uint8)
            and group_size == MMA_GROUP and words.shape[-1] % MMA_OUTPUTS == 0 and x.shape[1] % MMA_GROUP == 0
            and x.data_ptr() % 16 == 0 and x.stride(-1) == 1 and x.stride(0) == x.shape[1])


def max_warps(m: int) -> int:
    """Warps per block :func:`int4_mma` takes for ``m`` rows: the block's warps sum in shared memory, 64 outputs ×
    8 rows per column tile × 4 bytes each, within the 48 KiB a launch gets without opting in (so 4 above 16 rows)."""
    return MMA_MAX_WARPS if m <= 16 else 4


def plan_int4_mma(m: int, n: int, k: int, device: Optional[torch.device] = None) -> Int4MmaConfig:
    """The launch :func:`int4_mma` uses for ``m`` rows, ``n`` outputs and ``k`` input features on ``device``
    (``None`` or a CPU: an H200's 132 SMs). Fitted to the warps × split sweep of every llama2-7b and llama3.1-8b
    linear at 2, 5 and 16 rows on an H200 (``benchmarks/results/linear-h200-mma-sweep.md``: within 1 % of the sweep's
    best over all linears of a token):

    * 8 warps where the 64-output tiles are fewer than the SMs (a block then needs more warps to keep loads in
      flight), 2 where more than 8 rows meet more than two tiles per SM (the register file is the limit), else 4;
    * the groups split over a power of two of blocks nearest to :data:`MMA_WARPS_PER_SM` warps per SM in all, each
      warp at least one group.
    """
    from questkv.ops.triton._common import num_sms

    sms = num_sms(device or torch.device("cpu"))
    tiles = n // MMA_OUTPUTS
    groups = k // MMA_GROUP
    if tiles < sms:
        warps = max_warps(m)
    elif m > 8 and tiles > 2 * sms:
        warps = 2
    else:
        warps = 4
    per_sm = next(w for most, w in MMA_WARPS_PER_SM if m <= most)
    blocks_per_tile = per_sm * sms / (tiles * warps)
    split = 2 ** round(math.log2(blocks_per_tile)) if blocks_per_tile > 1 else 1
    return Int4MmaConfig(warps, max(1, min(split, groups // warps)))


def check_product(op: str, x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int, bias: Optional[torch.Tensor], fits_product: Callable[..., bool], takes: str) -> int:
    """The checks a CUDA int4 launcher ``op`` makes before anything else: ``x`` ``[M, K]``, the words' format
    (:func:`~questkv.ops.quant_reference.check_int4_words`), ``fits_product(x, words, scales, zeros, group_size)``
    (``takes`` says what it takes) and a bias ``[N]`` in ``x``'s dtype; ``ValueError`` naming the first that fails.

    Returns:
        ``N``, the outputs.
    """
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [M, K], got shape {tuple(x.shape)}")
    n = check_int4_words(x.shape[1], words, scales, zeros, group_size, op)
    if not fits_product(x, words, scales, zeros, group_size):
        raise ValueError(f"{op} takes {takes}; got x {tuple(x.shape)} {x.dtype}, scales {scales.dtype}, zeros "
                         f"{zeros.dtype}, group size {group_size}, words {tuple(words.shape)}")
    if bias is not None and (bias.dtype != x.dtype or tuple(bias.shape) != (n,)):
        raise ValueError(f"{op}: bias must be [{n}] in x's dtype {x.dtype}, got {bias.dtype} {tuple(bias.shape)}")
    return n


def extension_for(op: str, x: torch.Tensor) -> ModuleType:
    """The built extension for ``op`` on ``x``'s device: ``ValueError`` for a tensor off CUDA, ``RuntimeError`` where
    the extension could not be built (the warning says why)."""
    if not x.is_cuda:
        raise ValueError(f"{op} runs on CUDA tensors, got x on {x.device} (the torch reference: "
                         "questkv.ops.quant_reference.int4_matmul)")
    extension = _extension()
    if extension is None:
        raise RuntimeError(f"{op}: the CUDA extension is not available on this machine (see the warning)")
    return extension


def int4_mma(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             group_size: int = MMA_GROUP, bias: Optional[torch.Tensor] = None,
             config: Optional[Int4MmaConfig] = None) -> torch.Tensor:
    """``y = x @ w.T + bias`` for ``x`` ``[M, K]`` bf16 / fp16 (``M`` ≤ :data:`MMA_MAX_M`) and an ``int4`` weight
    held as K-major words ``[K // 8, N]`` int32 with ``scales`` ``[K // 128, N]`` in ``x``'s dtype and ``zeros``
    in ``x``'s dtype or uint8 (:mod:`questkv.ops.quant_reference`'s format), on a CUDA device where
    :func:`available`; ``config`` overrides :func:`plan_int4_mma`. The maths of
    :func:`~questkv.ops.triton.int4_words.int4_words_matmul`: per group, float32 sums of ``x`` times ``128 + q``
    (bf16; fp16: ``1024 + q``), then the group's scale and zero point.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    n = check_product("int4_mma", x, words, scales, zeros, group_size, bias, fits,
                      f"1 to {MMA_MAX_M} contiguous bf16/fp16 rows, scales in their dtype, zero points in it or uint8, "
                      f"group size {MMA_GROUP} and outputs in multiples of {MMA_OUTPUTS}")
    m, k = x.shape
    cfg = config or plan_int4_mma(m, n, k, x.device)
    if not 1 <= cfg.warps <= max_warps(m) or cfg.split < 1:
        raise ValueError(f"int4_mma: a config for {m} rows takes 1 to {max_warps(m)} warps and a split of at least 1, "
                         f"got {cfg}")
    extension = extension_for("int4_mma", x)
    from questkv.ops.triton._common import split_reduction, use_pdl

    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    per_split, _, part, counters = split_reduction(k // MMA_GROUP, cfg.split, out, n // MMA_OUTPUTS,
                                                   placeholder=None)
    # .contiguous(): no-ops for a layer's own buffers, copies for views a caller may pass
    extension.int4_mma(x, words.contiguous(), scales.contiguous(), zeros.contiguous(),
                       None if bias is None else bias.contiguous(), part, counters, out, per_split, cfg.warps,
                       use_pdl(x.device))
    return out
