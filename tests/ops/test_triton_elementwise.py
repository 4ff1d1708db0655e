"""RMSNorm and SiLU-and-multiply (questkv.ops.triton.elementwise) against the torch reference, under the Triton
interpreter, and through the dispatch point.

The interpreter truncates float32 → bf16 / fp16 casts where a GPU rounds to nearest, so the 16-bit cases are
checked to a tolerance of a couple of units in their last place; float32 to 1e-5. Fresh random inputs per test.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from questkv import ops  # noqa: E402
from questkv.ops import reference  # noqa: E402
from questkv.ops.triton import elementwise  # noqa: E402
from tests.helpers import INTERPRETER_TOL, fresh_generator, rel_err  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 100), (1, 4096)])  # rows of a decode step, odd widths, 8B's
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_reference(dtype, shape, with_residual):
    gen = fresh_generator()
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    weight = (1 + torch.randn(shape[-1], generator=gen) * 0.1).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype) if with_residual else None
    got = elementwise.rms_norm(x, weight, 1e-5, residual)
    want = reference.rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        assert got[1].dtype == dtype and got[1].shape == x.shape
        assert rel_err(got[1], want[1]) < INTERPRETER_TOL[dtype]
        got, want = got[0], want[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) < INTERPRETER_TOL[dtype]


def test_rms_norm_reads_a_strided_view_and_promotes_to_the_weight_dtype():
    gen = fresh_generator()
    wide = torch.randn(4, 2, 48, generator=gen)
    x = wide[:, 1, :32]  # rows 96 apart, last dimension contiguous
    weight = torch.randn(32, generator=gen, dtype=torch.float64)
    got = elementwise.rms_norm(x, weight, 1e-6)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, reference.rms_norm(x, weight, 1e-6), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 2 * 96), (2, 3, 2 * 1500), (1, 2 * 14336)])  # a masked tail, two blocks
def test_silu_and_mul_matches_the_reference(dtype, shape):
    x = (torch.randn(shape, generator=fresh_generator()) * 4).to(dtype)
    got = elementwise.silu_and_mul(x)
    want = reference.silu_and_mul(x)
    assert got.dtype == dtype and got.shape == want.shape
    assert rel_err(got, want) < INTERPRETER_TOL[dtype]


def test_dispatch_and_empty_inputs():
    gen = fresh_generator()
    x, weight = torch.randn(2, 16, generator=gen), torch.randn(16, generator=gen)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5, backend="triton"), reference.rms_norm(x, weight, 1e-5))
    torch.testing.assert_close(ops.silu_and_mul(x, backend="triton"), reference.silu_and_mul(x))
    assert ops.rms_norm(x, weight, 1e-5) is not None  # CPU tensors: "auto" takes the reference
    empty = torch.empty(0, 16)
    assert elementwise.rms_norm(empty, weight, 1e-5).shape == (0, 16)
    assert elementwise.silu_and_mul(empty).shape == (0, 8)


def test_bad_arguments_are_named():
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match=r"rms_norm: weight must have shape \(16,\), got \(15,\)"):
        elementwise.rms_norm(x, torch.randn(15), 1e-5)
    with pytest.raises(ValueError, match=r"rms_norm: residual must match x"):
        elementwise.rms_norm(x, torch.randn(16), 1e-5, torch.randn(2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"silu_and_mul: .* must be even; got 15"):
        elementwise.silu_and_mul(torch.randn(2, 15))
