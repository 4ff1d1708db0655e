"""questkv.layers.linear.Linear: nn.Linear's product through ops.linear, on either backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from questkv.layers.linear import Linear, MergedLinear


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear_at_one_row_and_several(backend, bias):
    if backend == "triton":
        pytest.importorskip("triton")  # one row goes through the GEMV (under the interpreter here)
    gen = _gen()
    layer = Linear(96, 40, bias=bias)
    layer.backend = backend
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    for rows in (1, 3):
        x = torch.randn(rows, 96, generator=gen)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_merged_linear_is_a_linear():
    layer = MergedLinear(24, {"a": 8, "b": 8})
    assert isinstance(layer, Linear) and layer.backend == "auto"
