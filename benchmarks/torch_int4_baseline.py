"""torch's own int4 kernel, ``torch.ops.aten._weight_int4pack_mm`` (tinygemm; CUDA, bf16 only), as a baseline of
``linear_bench.py``: an ``int4`` weight converted to its layout, and the product.

Engines held it as a second copy of the codes for 2 to 4 rows until questkv's tensor-core kernel over the words
(:mod:`questkv.ops.cuda.int4_mma`) beat it there (``benchmarks/results/linear-h200-mma.md``).
"""

from __future__ import annotations

from typing import Optional

import torch

from questkv.ops.quant_reference import unpack_int4

__all__ = ["tinygemm_matmul", "tinygemm_pack"]


def tinygemm_pack(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int = 128,
                  inner_k_tiles: Optional[int] = None,
                  high_nibble_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``int4`` weight (:mod:`questkv.ops.quant_reference` format, ``qweight`` ``[N, K // 2]`` uint8) in
    ``_weight_int4pack_mm``'s layout.

    tinygemm computes ``w = (q - 8) * s + z'``; ours ``(q - z) * s``, so ``z' = (8 - z) * s`` (rounded to bf16).
    Its packer takes ``uint8 [N, K // 2]`` with element ``2j`` in the high nibble (torchao's order;
    ``high_nibble_first=False`` keeps ours, for a check of that order on the GPU).

    Returns:
        ``(packed, scales_and_zeros)``: the packer's output and ``[K // group_size, N, 2]`` bf16.
    """
    q = unpack_int4(qweight)  # [N, K]
    k = q.shape[1]
    if high_nibble_first:
        pairs = (q[:, 0::2] << 4) | q[:, 1::2]
    else:
        pairs = q[:, 0::2] | (q[:, 1::2] << 4)
    if inner_k_tiles is None:
        inner_k_tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
    packed = torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), inner_k_tiles)
    s = scales.float()
    scales_and_zeros = torch.stack((s, (8 - zeros.float()) * s), dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_and_zeros


def tinygemm_matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int = 128,
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` ``[M, K]`` bf16 through ``torch.ops.aten._weight_int4pack_mm`` → ``[M, N]`` bf16."""
    y = torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)
    return y if bias is None else y + bias
