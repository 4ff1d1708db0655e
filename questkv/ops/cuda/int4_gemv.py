"""``int4`` times one row of ``x`` on CUDA cores: a CUDA C++ GEMV (``int4_gemv.cu``) over the K-major words every
``int4`` kernel reads (:func:`~questkv.ops.quant_reference.pack_int4_k_major`), built in one extension with the
tensor-core kernel (:mod:`questkv.ops.cuda.int4_mma`: the same build, cache and
:func:`~questkv.ops.cuda.int4_mma.available`).

Where it runs (:func:`takes`): one row of a layer whose 32-output tiles are at most two per SM. There a block's
warps split the groups of its 32 outputs and sum in shared memory, where the Triton GEMV, whose programs own 256-512
outputs, splits K over up to 32 programs whose partials a last program sums: on an H200 llama3.1-8b's qkv / o / down
took 8.1 / 5.8 / 13.2 µs against 8.4 / 7.0 / 15.3; on wider layers (gate_up, the LM head) each block stages all of
``x`` for too little work and the Triton GEMV stays faster (22.5 / 81.9 against 22.9 / 86.7;
``benchmarks/results/linear-h200-gemv-cuda.md``). Both hold about 128 registers a thread (25 % occupancy) and wait on
their loads. The ``.cu`` file's header has the mapping.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from questkv.ops.cuda.int4_mma import check_product, extension_for

__all__ = ["GEMV_OUTPUTS", "GEMV_STAGES", "CudaGemvConfig", "fits", "int4_gemv_cuda", "plan_int4_gemv_cuda", "takes"]

GEMV_GROUP = 128
"""The group size the kernel reads."""

GEMV_OUTPUTS = 32
"""Outputs per block: ``N`` must be a multiple."""

GEMV_STAGES = (2, 3)
"""Groups a warp holds in registers: the one it multiplies and one or two ahead."""

GEMV_MAX_WARPS = 16
"""Warps per block at most (the kernel's launch bounds: 512 threads)."""

GEMV_MAX_SMEM = 160 * 1024
"""Shared memory a block may take (the ``.cu`` launcher's opt-in): ``x`` staged as float32 with its sums, 544 bytes
per group, plus 128 bytes per warp (:func:`smem_bytes`): 299 groups (K = 38,272) in one block of 8 warps; above,
:func:`plan_int4_gemv_cuda` splits K."""

GEMV_MAX_TILES_PER_SM = 2
""":func:`questkv.ops.int4_matmul` sends one row here where the 32-output tiles are at most this many per SM; above,
the Triton GEMV (a block stages all of ``x`` for its 32 outputs: too little work per block there). On an H200
(``benchmarks/results/linear-h200-gemv-cuda.md``'s sweep, µs, this kernel's best launch against the Triton GEMV):
llama3.1-8b's qkv 8.1 / 8.4 (192 tiles), o 5.8 / 7.0 (128), down 13.2 / 15.3 (128); gate_up 22.9 / 22.5 (896),
LM head 86.7 / 81.9 (4008)."""


@dataclasses.dataclass(frozen=True)
class CudaGemvConfig:
    """One :func:`int4_gemv_cuda` launch: ``warps`` per block (each takes whole groups of the block's 32 outputs in
    turn), ``split`` blocks per 32 outputs (each a range of whole groups), ``stages`` groups in registers per warp."""

    warps: int
    split: int
    stages: int = 3


def smem_bytes(per_split: int, warps: int) -> int:
    """The dynamic shared memory of a block of ``warps`` over ``per_split`` groups (the ``.cu`` launcher's sum)."""
    return (per_split * (GEMV_GROUP + 8) + warps * GEMV_OUTPUTS) * 4


def fits(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> bool:
    """Whether :func:`int4_gemv_cuda` takes this product: one contiguous, 16-byte aligned row of bf16 or fp16 ``x``,
    scales in its dtype and zero points in it or uint8, group 128, outputs a multiple of :data:`GEMV_OUTPUTS`."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and scales.dtype == x.dtype and zeros.dtype in (x.dtype, torch.uint8)
            and group_size == GEMV_GROUP and words.shape[-1] % GEMV_OUTPUTS == 0 and x.shape[1] % GEMV_GROUP == 0
            and x.data_ptr() % 16 == 0 and x.stride(-1) == 1)


def plan_int4_gemv_cuda(n: int, k: int, device: Optional[torch.device] = None) -> CudaGemvConfig:
    """The launch :func:`int4_gemv_cuda` uses for ``n`` outputs and ``k`` input features on ``device`` (``None`` or a
    CPU: an H200's 132 SMs), from the H200 sweep of llama3.1-8b's shapes (:data:`GEMV_MAX_TILES_PER_SM`'s file): no
    split of K over blocks (a split cost 5-30 % at every shape: each block stages its ``x`` and the partials take a
    round trip), 2 stages, and 16 warps splitting a block's groups where the 32-output tiles are at most one per SM
    (o, down: 5.8 and 13.2 µs against 6.0 and 16.5 with 8), 8 up to two per SM (qkv: 8.1 against 9.6 with 16), 4
    above (gate_up: 22.9 against 25.5); K is split in two only where one block's ``x`` would not fit
    :data:`GEMV_MAX_SMEM`."""
    from questkv.ops.triton._common import num_sms

    sms = num_sms(device or torch.device("cpu"))
    tiles = n // GEMV_OUTPUTS
    warps = 16 if tiles <= sms else 8 if tiles <= 2 * sms else 4
    groups = k // GEMV_GROUP
    split = 1
    while smem_bytes(-(-groups // split), warps) > GEMV_MAX_SMEM:
        split *= 2
    return CudaGemvConfig(warps, split, stages=2)


def takes(n: int, device: torch.device) -> bool:
    """Whether :func:`questkv.ops.int4_matmul` sends one row of a product with ``n`` outputs here on ``device``
    (:data:`GEMV_MAX_TILES_PER_SM`)."""
    from questkv.ops.triton._common import num_sms

    return n // GEMV_OUTPUTS <= GEMV_MAX_TILES_PER_SM * num_sms(device)


def int4_gemv_cuda(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   group_size: int = GEMV_GROUP, bias: Optional[torch.Tensor] = None,
                   config: Optional[CudaGemvConfig] = None) -> torch.Tensor:
    """``y = x @ w.T + bias`` for one row ``x`` ``[1, K]`` bf16 / fp16 and an ``int4`` weight held as K-major words
    ``[K // 8, N]`` int32 with ``scales`` ``[K // 128, N]`` in ``x``'s dtype and ``zeros`` in ``x``'s dtype or
    uint8 (:mod:`questkv.ops.quant_reference`'s format), on a CUDA device where
    :func:`~questkv.ops.cuda.int4_mma.available`; ``config`` overrides :func:`plan_int4_gemv_cuda`.

    Returns:
        ``[1, N]`` in ``x.dtype``.
    """
    n = check_product("int4_gemv_cuda", x, words, scales, zeros, group_size, bias, fits,
                      f"one contiguous bf16/fp16 row, scales in its dtype, zero points in it or uint8, group size "
                      f"{GEMV_GROUP} and outputs in multiples of {GEMV_OUTPUTS}")
    k = x.shape[1]
    cfg = config or plan_int4_gemv_cuda(n, k, x.device)
    groups = k // GEMV_GROUP
    if not 1 <= cfg.warps <= GEMV_MAX_WARPS or cfg.split < 1 or cfg.stages not in GEMV_STAGES:
        raise ValueError(f"int4_gemv_cuda: a config takes 1 to {GEMV_MAX_WARPS} warps, a split of at least 1 and "
                         f"stages in {GEMV_STAGES}, got {cfg}")
    per_split = -(-groups // cfg.split)
    if smem_bytes(per_split, cfg.warps) > GEMV_MAX_SMEM:
        raise ValueError(f"int4_gemv_cuda: {per_split} groups per block need {smem_bytes(per_split, cfg.warps)} "
                         f"bytes of shared memory, more than {GEMV_MAX_SMEM}: split K further (got {cfg})")
    extension = extension_for("int4_gemv_cuda", x)
    from questkv.ops.triton._common import split_reduction, use_pdl

    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    per_split, _, part, counters = split_reduction(groups, cfg.split, out, n // GEMV_OUTPUTS, placeholder=None)
    extension.int4_gemv(x.contiguous(), words.contiguous(), scales.contiguous(), zeros.contiguous(),
                        None if bias is None else bias.contiguous(), part, counters, out, per_split, cfg.warps,
                        cfg.stages, use_pdl(x.device))
    return out
