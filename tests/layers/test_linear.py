"""questkv.layers.linear.Linear (through ops.linear) and the Llama MLP's fused one-token path."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from questkv import ops
from questkv.layers.linear import Linear, MergedLinear
from questkv.models.llama import LlamaMLP, ModelSpec
from questkv.ops.reference import silu_and_mul
from tests.helpers import tiny_config


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_nn_linear_and_gated_applies_silu_and_mul_first(bias):
    gen = _gen()
    layer = Linear(24, 40, bias=bias)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(3, 24, generator=gen)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    h = torch.randn(3, 48, generator=gen)
    torch.testing.assert_close(layer(h, gated=True), F.linear(silu_and_mul(h), layer.weight, layer.bias))
    assert isinstance(MergedLinear(24, {"a": 8, "b": 8}), Linear)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("family", ["llama3", "llama_mha"])  # llama_mha: MLP biases
def test_mlp_one_token_fused_path_equals_the_separate_activation(monkeypatch, backend, family):
    if backend == "triton":
        pytest.importorskip("triton")
    # every ops.linear call forced onto one backend: with "triton" a single row goes through the GEMV (interpreter)
    monkeypatch.setattr(ops, "linear", functools.partial(ops.linear, backend=backend))
    spec = ModelSpec.from_hf_config(tiny_config(family))
    mlp = LlamaMLP(spec)
    gen = _gen()
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(3, spec.hidden_size, generator=gen)
    batched = mlp(x)  # three rows: the separate SiluAndMul, then the down projection
    for row in range(3):
        torch.testing.assert_close(mlp(x[row : row + 1]), batched[row : row + 1], rtol=1e-5, atol=1e-5)
