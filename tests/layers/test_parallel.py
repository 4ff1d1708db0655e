"""Tensor-parallel sharding without processes: each rank's slice of a float or packed checkpoint weight is the
matching part of the whole one (dequantized), and a row-parallel shard that would cut quantization groups is
refused naming the weight. The sharded model itself runs in tests/engine/test_tensor_parallel.py."""

import pytest
import torch

from questkv.distributed.group import TensorParallel
from questkv.layers.parallel import shard_tensor
from questkv.ops.quant_reference import dequantize, quantize_weight


@pytest.mark.parametrize("method,group", [("int4", 32), ("int8", 128)])
@pytest.mark.parametrize("dim", [0, 1], ids=["column-parallel", "row-parallel"])
def test_each_ranks_packed_slice_dequantizes_to_its_part_of_the_whole_weight(method, group, dim):
    weight = torch.randn(8, 128)
    packed = quantize_weight(weight, method, group)
    whole = dequantize(*packed, method, group)  # [8, 128]
    parts = [dequantize(*shard_tensor("w", packed, dim, TensorParallel(rank, 2)), method, group) for rank in (0, 1)]
    assert torch.equal(torch.cat(parts, dim=dim), whole)


def test_float_slices_are_views_of_the_ranks_rows_or_columns():
    weight = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(shard_tensor("w", weight, 0, TensorParallel(1, 2)), weight[2:])
    assert torch.equal(shard_tensor("w", weight, 1, TensorParallel(2, 3)), weight[:, 4:])


def test_a_row_parallel_shard_that_would_cut_groups_is_refused_naming_the_weight():
    packed = quantize_weight(torch.randn(8, 64), "int4", 64)  # one group per row
    with pytest.raises(ValueError, match=r"weight 'layers.0.down': 1 quantization groups of 64 input features do not "
                                         r"split evenly over tensor_parallel_size=2"):
        shard_tensor("layers.0.down", packed, 1, TensorParallel(0, 2))
    with pytest.raises(ValueError, match=r"weight 'q': dimension 0 of size 6 is not divisible by tensor_parallel_size=4"):
        shard_tensor("q", torch.zeros(6, 4), 0, TensorParallel(0, 4))


@pytest.mark.parametrize("rank,size", [(0, 1), (2, 2), (-1, 2)])
def test_a_rank_outside_the_group_or_a_group_of_one_is_refused(rank, size):
    with pytest.raises(ValueError, match=r"TensorParallel\.(size|rank) must be"):
        TensorParallel(rank, size)
