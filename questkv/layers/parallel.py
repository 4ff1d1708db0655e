"""Tensor-parallel sharding of the model's weights: which slice of each checkpoint tensor a rank holds, and the
two layers whose forward changes (the vocab-parallel embedding and LM head).

Megatron's layout, as vLLM's: the fused QKV and gate/up projections are column-parallel (each rank holds its
heads' and its intermediate features' rows, output stays sharded), the output and down projections row-parallel
(each rank holds the matching input columns; ``LlamaAttention`` / ``LlamaMLP`` all-reduce their output; the bias is
held by rank 0 only, zeros elsewhere, so the sum adds it once). These stay plain ``nn.Linear`` / ``MergedLinear``
of the local shape, so weight quantization (:func:`~questkv.layers.quantized_linear.quantize_linears`) works on
shards: a row-parallel shard's ``int4`` groups are the full weight's groups when the local input features are a
multiple of the group size (else ``ValueError`` naming the layer and the group size), and its ``int8`` row scales
are the whole rows' (:func:`row_absmax`), so that every tensor-parallel size quantizes to the same weights.

``LlamaForCausalLM.load_weights`` slices each checkpoint tensor as it streams by (:func:`shard_tensor` for the
projections, float or packed; :func:`shard_of` for the embedding and the head). A sharded parameter carries how to
cut it from the full tensor (:func:`mark_sharded`), so that random weights are drawn at the full shape and sliced:
every tensor-parallel size gives the same model for one seed. Reading the full tensor and keeping a slice is the simple
way for now (each rank reads the whole checkpoint); reading only the slice from safetensors is a later step.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from questkv.distributed.group import TensorParallel
from questkv.ops.quant_reference import QuantizedWeight

__all__ = ["ParallelLMHead", "VocabParallelEmbedding", "mark_column_parallel", "mark_row_parallel", "mark_sharded",
           "row_absmax", "row_parallel_bias", "shard_of", "shard_tensor"]

Shard = Callable[[torch.Tensor], torch.Tensor]
Weight = Union[torch.Tensor, QuantizedWeight]


def mark_sharded(param: torch.Tensor, full_shape: tuple[int, ...], shard: Shard) -> None:
    """Record on ``param`` its unsharded shape and ``shard(full) -> this rank's slice`` (read by
    :func:`shard_of` and :func:`~questkv.models.weights.init_dummy_weights`)."""
    param.tp_full_shape = tuple(full_shape)
    param.tp_shard = shard


def shard_of(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of ``full`` for ``param`` (``full`` itself for a parameter every rank holds whole)."""
    shard = getattr(param, "tp_shard", None)
    return full if shard is None else shard(full)


def shard_tensor(name: str, tensor: Weight, dim: int, tp: TensorParallel) -> Weight:
    """Rank ``tp.rank``'s slice of checkpoint weight ``name`` along ``dim`` (0: output features, column-parallel;
    1: input features, row-parallel): a float tensor or a packed
    :class:`~questkv.ops.quant_reference.QuantizedWeight` (``int4`` ``[N, K // 2]`` codes, ``int8`` /
    ``int8_grouped`` ``[N, K]``; scales and zeros ``[K // group, N]`` or ``[N]``).

    Raises:
        ValueError: the dimension is not divisible by ``tp.size``, or a row-parallel shard of a grouped format
            would cut a quantization group (naming the weight and the group size).
    """
    if not isinstance(tensor, QuantizedWeight):
        return _narrow(tensor, dim, tp, name)
    qweight, scales, zeros = tensor
    if dim == 0:  # output rows: codes' rows, scales' and zeros' last dim
        return QuantizedWeight(_narrow(qweight, 0, tp, name), _narrow(scales, scales.dim() - 1, tp, name),
                               None if zeros is None else _narrow(zeros, 1, tp, name))
    qweight = _narrow(qweight, 1, tp, name)
    if scales.dim() == 1:  # int8: one scale per output row, every rank keeps all
        return QuantizedWeight(qweight, scales, zeros)
    groups = scales.shape[0]
    if groups % tp.size:
        in_features = qweight.shape[1] * tp.size * (2 if qweight.dtype == torch.uint8 else 1)
        raise ValueError(f"weight {name!r}: {groups} quantization groups of {in_features // groups} input features "
                         f"do not split evenly over tensor_parallel_size={tp.size}; a shard must hold whole groups")
    zeros = None if zeros is None else _narrow(zeros, 0, tp, name)
    return QuantizedWeight(qweight, _narrow(scales, 0, tp, name), zeros)


def _narrow(tensor: torch.Tensor, dim: int, tp: TensorParallel, name: str) -> torch.Tensor:
    size = tensor.shape[dim]
    if size % tp.size:
        raise ValueError(f"weight {name!r}: dimension {dim} of size {size} is not divisible by "
                         f"tensor_parallel_size={tp.size}")
    part = size // tp.size
    return tensor.narrow(dim, tp.rank * part, part)


def _padded_vocab(vocab_size: int, tp: TensorParallel) -> int:
    """``vocab_size`` rounded up to a multiple of the group size (the last rank's extra rows are zeros)."""
    return -(-vocab_size // tp.size) * tp.size


def _vocab_rows(full: torch.Tensor, rows: int, tp: TensorParallel) -> torch.Tensor:
    """``full`` ``[vocab_size, hidden]`` → rank ``tp.rank``'s ``[rows, hidden]`` (zero-padded past the vocabulary)."""
    padded = F.pad(full, (0, 0, 0, rows * tp.size - full.shape[0]))  # [rows * size, hidden]
    return padded[tp.rank * rows:(tp.rank + 1) * rows]


class VocabParallelEmbedding(nn.Embedding):
    """An embedding whose rows (tokens) are split over the ranks: rank ``r`` holds tokens ``[r * V', (r + 1) * V')``
    of the vocabulary padded to ``size * V'``; each rank looks up the ids it holds (zeros for the others) and
    the all-reduce sums the one non-zero row of every token.

    Args:
        vocab_size, hidden_size: the full embedding's shape. tp: the group.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        rows = _padded_vocab(vocab_size, tp) // tp.size
        super().__init__(rows, hidden_size)
        self.tp, self.vocab_size, self.start = tp, vocab_size, tp.rank * rows
        mark_sharded(self.weight, (vocab_size, hidden_size), lambda full: _vocab_rows(full, rows, tp))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` ``[T]`` int64 (any id of the vocabulary) → ``[T, hidden_size]``, the same on every rank."""
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        h = h.masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(h)


class ParallelLMHead(nn.Linear):
    """The LM head split by vocabulary rows like :class:`VocabParallelEmbedding` (so a tied head shares its
    weight): each rank computes its rows' logits, the all-gather gives every rank the full ``[N, vocab_size]``.

    Args:
        hidden_size, vocab_size: the full head's shape. tp: the group.
    """

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        rows = _padded_vocab(vocab_size, tp) // tp.size
        super().__init__(hidden_size, rows, bias=False)
        self.tp, self.vocab_size, self.start = tp, vocab_size, tp.rank * rows
        mark_sharded(self.weight, (vocab_size, hidden_size), lambda full: _vocab_rows(full, rows, tp))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[N, hidden_size]`` → ``[N, vocab_size]`` logits of the whole vocabulary, on every rank."""
        return self.tp.all_gather(super().forward(hidden))[:, :self.vocab_size]


def mark_column_parallel(linear: nn.Linear, full_sizes: tuple[int, ...], tp: TensorParallel) -> None:
    """Mark a column-parallel ``linear`` (a fused projection of shards of ``full_sizes`` output rows, each split
    over the ranks): its weight (and bias) hold this rank's rows of every shard, back to back."""
    def shard(full: torch.Tensor) -> torch.Tensor:
        return torch.cat([_narrow(part, 0, tp, "column-parallel") for part in full.split(full_sizes, dim=0)])

    for param in (linear.weight, linear.bias):
        if param is not None:
            mark_sharded(param, (sum(full_sizes), *param.shape[1:]), shard)


def mark_row_parallel(linear: nn.Linear, tp: TensorParallel) -> None:
    """Mark a row-parallel ``linear``: its weight holds this rank's input columns; its bias is rank 0's (zeros on
    the others, so that the all-reduce of the outputs adds it once)."""
    mark_sharded(linear.weight, (linear.out_features, linear.in_features * tp.size),
                 lambda full: _narrow(full, 1, tp, "row-parallel"))
    linear.weight.tp_row_parallel = True
    if linear.bias is not None:
        mark_sharded(linear.bias, tuple(linear.bias.shape), lambda full: row_parallel_bias(full, tp))


def row_absmax(tp: TensorParallel) -> Callable[[nn.Linear], Optional[torch.Tensor]]:
    """For :func:`~questkv.layers.quantized_linear.quantize_linears`: a row-parallel layer's whole rows' largest
    magnitudes (``[out_features]`` float32, the maximum over the ranks: one all-reduce per layer, every rank calling
    for the same layers in the same order), so that its ``int8`` row scales are the unsharded layer's; ``None``
    for a layer that holds whole rows."""
    def absmax(linear: nn.Linear) -> Optional[torch.Tensor]:
        if not getattr(linear.weight, "tp_row_parallel", False):
            return None
        return tp.all_max(linear.weight.detach().float().abs().amax(dim=1))  # [N]

    return absmax


def row_parallel_bias(full: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A row-parallel layer's bias on this rank: ``full`` on rank 0, zeros elsewhere."""
    return full if tp.rank == 0 else torch.zeros_like(full)
