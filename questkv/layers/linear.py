"""The engine's dense linear layers: :class:`Linear` (through the one dispatch point, :func:`questkv.ops.linear`)
and fused projections, one GEMM where a checkpoint stores several (q/k/v, gate/up).

Owns the row layout of the fused weight and the copy of each checkpoint shard into its rows; which
checkpoint name is which shard is ``questkv.models.llama``'s business.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from questkv import ops
from questkv.validation import check_choice, check_int

__all__ = ["Linear", "MergedLinear", "copy_param", "shard_offsets"]


def copy_param(name: str, param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into ``param`` (any dtype or device), after checking its shape.

    ``name`` (the checkpoint name) only serves the error message.
    """
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(loaded.shape)}, the model expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded)


def shard_offsets(owner: str, shard_sizes: dict[str, int]) -> dict[str, int]:
    """Each shard's first row in a fused projection whose output rows are ``shard_sizes`` back to back, after
    checking that there is at least one shard and each has a row (``ValueError`` naming ``owner``'s field)."""
    if not shard_sizes:
        raise ValueError(f"{owner}.shard_sizes must name at least one shard, got {{}}")
    offsets, offset = {}, 0
    for shard, size in shard_sizes.items():
        check_int(f"{owner}.shard_sizes[{shard!r}]", size, minimum=1)
        offsets[shard] = offset
        offset += size
    return offsets


class Linear(nn.Linear):
    """``nn.Linear`` whose product goes through :func:`questkv.ops.linear` on ``backend`` (``"auto"``; ``"torch"``
    forces the reference): on CUDA a single row (a decode step at batch 1) and a small weight take questkv's GEMV."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.backend = "auto"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in_features]`` → ``[T, out_features]``, ``x``'s dtype."""
        return ops.linear(x, self.weight, self.bias, backend=self.backend)


class MergedLinear(Linear):
    """A :class:`Linear` whose output features are named shards back to back.

    ``MergedLinear(hidden, {"q": Hq * D, "k": Hkv * D, "v": Hkv * D})`` is the fused QKV projection and
    ``MergedLinear(hidden, {"gate": I, "up": I})`` the fused gate/up projection: one GEMM instead of three or
    two, with the weight rows of shard ``s`` at ``offsets[s] : offsets[s] + sizes[s]``.

    Args:
        in_features: input features.
        shard_sizes: output features of each shard, in row order (a dict keeps its insertion order).
        bias: whether the projection has a bias (every shard then has its slice of it).
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        offsets = shard_offsets("MergedLinear", shard_sizes)
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets = offsets

    def load_shard(self, name: str, shard: str, param_name: str, loaded: torch.Tensor) -> None:
        """Copy checkpoint tensor ``loaded`` (``[shard_size, in_features]`` for ``"weight"``,
        ``[shard_size]`` for ``"bias"``; checkpoint name ``name``) into the rows of ``shard``."""
        check_choice("MergedLinear.load_shard shard", shard, tuple(self.shard_sizes))
        params = ("weight", "bias") if self.bias is not None else ("weight",)
        check_choice("MergedLinear.load_shard param_name", param_name, params)
        start = self.shard_offsets[shard]
        rows = getattr(self, param_name)[start : start + self.shard_sizes[shard]]
        copy_param(name, rows, loaded)

    def split(self, out: torch.Tensor) -> Sequence[torch.Tensor]:
        """Split ``out`` ``[T, out_features]`` (this layer's output) into one ``[T, size]`` view per shard."""
        return out.split(tuple(self.shard_sizes.values()), dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, shards={self.shard_sizes}"
